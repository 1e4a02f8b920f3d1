"""The `knnper` console script. Its commands, each registered (edge_runtime.commands, the shape
`knnper-edge` shares) by the module of its group:

- train, evaluate, client-data, pretrain: knnper_cli/train.py
- bench: knnper_cli/bench.py
- export: knnper_cli/export.py
- demo: knnper_cli/demo.py
- experiment: knnper_cli/experiment.py
- deploy: knnper_cli/deploy.py

knnper_cli.commands names them: `--help`, `--version` and a mistyped command are answered
from it, and only the module of the command named is imported (export's imports no torch: its
flags are parsed and its output paths checked before torch is). They run the server side
(torch, scikit-learn, tqdm, onnx, edgeml: the `train` extra); on a runtime-only install (`pip
install knnper`) it says which extra to install, in one line, instead of failing with an import
traceback."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Sequence

from edge_runtime.arg_types import check_outputs, threads
from edge_runtime.cli_help import examples, install_hint, package_version
from edge_runtime.commands import Parser, UsageError
from edge_runtime.errors import one_line
from edge_runtime.interrupt import INTERRUPTED, exit_on_interrupt, exit_quietly_from_now
from fed_train import defaults
from knnper_cli.commands import COMMANDS

SERVER_MODULES = ("torch", "sklearn", "tqdm", "onnx", "edgeml")
DESCRIPTION = (
    "Personalized federated learning through local memorization (kNN-Per): train a "
    "federated run, evaluate it, export per-device bundles. Start with `knnper demo`."
)


def missing_server_modules() -> list[str]:
    return [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]


def main(argv: Sequence[str] | None = None) -> int:
    missing = missing_server_modules()
    args = sys.argv[1:] if argv is None else list(argv)
    if missing and args == ["--version"]:
        print(
            f"knnper {package_version()} (device runtime only: no {', '.join(missing)}; "
            f"the server commands need {install_hint('train')})"
        )
        return 0
    if missing:
        print(
            f"knnper: this install has the device runtime only (no {', '.join(missing)}); "
            f"the server commands need the train extra: {install_hint('train')} "
            "(on a device, use knnper-edge)",
            file=sys.stderr,
        )
        return 2
    return run(argv)


def console() -> int:
    """The `knnper` console script: main(), then, once a command was interrupted and its
    workers are gone, the process ends at once with 130. The interpreter's own exit is
    skipped: a further Ctrl-C there could only print a traceback from an exit handler, and an
    interrupt that landed inside a C extension's import (torch's lazy `torch._dynamo`, sympy)
    can leave CPython's flag that makes it end by SIGINT (-2) whatever the code returned."""
    try:
        code = main()
    except SystemExit as done:  # --help, --version, a usage error: argparse's own exit
        code = done.code
    if code != INTERRUPTED:
        exit_quietly_from_now("knnper")  # a Ctrl-C during the interpreter's own exit
        return code
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _top_parser() -> Parser:
    """`knnper` and its own flags, without its commands (no command module imported)."""
    parser = Parser(
        prog="knnper",
        description=DESCRIPTION,
        epilog=examples(
            "knnper demo                                        # the whole pipeline, a minute",
            "knnper train --out runs/digits                     # 1. train FedAvg",
            "knnper evaluate runs/digits                        # 2. Local, FedAvg, kNN-Per",
            "knnper export runs/digits --out bundles/d --budget 500kB   # 3. bundles per device",
            "knnper client-data runs/digits --client 3 --out data/client_3",
            "knnper-edge evaluate bundles/d/client_0003 --data data/client_3/test.npz  # 4. device",
            note="`knnper COMMAND --help` gives each command's options and an example.",
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument(
        "--threads",
        type=threads,
        default=defaults.THREADS,
        help="torch intra-op threads (1 trained the digits and Fashion-MNIST "
        "models fastest: docs/benchmarks/training.md)",
    )
    return parser


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, one module per command group; with `command`, only the group
    that declares it (only its module is imported)."""
    parser = _top_parser()
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    entries = COMMANDS.values() if command is None else [COMMANDS[command]]
    for module, adder in dict.fromkeys((e.module, e.adder) for e in entries):
        getattr(importlib.import_module(module), adder)(sub)
    return parser


def command_named(argv: Sequence[str] | None) -> str:
    """The command a command line names, from the table of commands alone: `--help`,
    `--version`, a bad `knnper` flag and an unknown or missing command end here (argparse's
    own exit, or a UsageError), before any command module is imported."""
    parser = _top_parser()
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, entry in COMMANDS.items():
        sub.add_parser(name, help=entry.help, add_help=False)
    return parser.parse_known_args(argv)[0].command


def run(argv: Sequence[str] | None = None) -> int:
    """Parse and run one command: its errors are one line and exit 2, Ctrl-C exits 130 (also
    while torch and the command modules import, before the command's own handling)."""
    with exit_on_interrupt("knnper"):
        try:
            args = build_parser(command_named(argv)).parse_args(argv)
            check_outputs(args)  # paths: before the heavy imports, not after them
        except UsageError as err:  # a bad flag: argparse's own exit, in one line
            print(f"{err.prog}: error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        except (ValueError, OSError) as err:
            print(f"knnper: error: {_one_line(err)}", file=sys.stderr)
            return 2
        import numpy as np
        import torch
        from tqdm.contrib.logging import logging_redirect_tqdm

        from fed_train.errors import KnnperError

    torch.set_num_threads(args.threads)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        # files are checked where they are loaded (finite, in range): a floating-point
        # warning would only print numpy's source lines before the one-line error; log lines
        # go above the progress bars, not glued to one
        with np.errstate(all="ignore"), logging_redirect_tqdm():
            return args.func(args)
    except KeyboardInterrupt:
        pass
    except Exception as err:
        # Ctrl-C inside a lazy import (torch imports torch._dynamo at the first optimizer)
        # can surface as another error raised while handling it: still an interruption
        if not _from_interrupt(err):
            if isinstance(err, (KnnperError, ValueError, OSError, MemoryError)):
                print(f"knnper: error: {_one_line(err)}", file=sys.stderr)
                return 2
            raise
    # out of the handler, the interrupted frames are gone: their progress bars close (and
    # print) now, so the message below is the last line
    gc.collect()
    sys.stdout.flush()
    # a worker's last line may still sit on the terminal's line without its newline
    start = "\r\x1b[K" if sys.stderr.isatty() else ""
    print(
        f"{start}knnper: interrupted; run the same command again to resume {args.command}",
        file=sys.stderr,
        flush=True,
    )
    return INTERRUPTED


def _from_interrupt(err: BaseException) -> bool:
    """Whether a KeyboardInterrupt is in the error's chain of causes and contexts."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def _one_line(err: BaseException) -> str:
    """An error as one line: a file system error by its reason and path (a full disk, a path
    under a file), a MemoryError by what it means; multi-line messages joined."""
    if isinstance(err, MemoryError):
        return "out of memory (a size or budget larger than this machine can hold?)"
    if isinstance(err, OSError) and err.strerror:
        where = f": {err.filename}" if err.filename else ""
        return f"{err.strerror}{where}"
    return one_line(err)


if __name__ == "__main__":
    sys.exit(console())
