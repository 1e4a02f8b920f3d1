"""`knnper-edge`: the device command line. Its commands, registered at the end of this module:

- predict: labels (and probabilities) for an .npy of raw inputs
- evaluate: accuracy on a labelled .npz
- add: learn from labelled samples, rewriting the bundle in place
- init: a bundle for a new device from its own data
- info: verify a bundle and summarize its manifest
- export-onnx: the whole prediction as one ONNX graph
- upgrade: carry the bundle's samples to a new model version
- keygen: an Ed25519 key pair for signing bundles

A command is a function `run(args) -> int` and one `register_command(command(...))` (see
docs/extending.md). Every error, bad input included, is one line on stderr, `knnper-edge:
error: ...`, and exit status 2; set KNNPER_EDGE_DEBUG=1 to get the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from zipfile import BadZipFile, ZipFile

import numpy as np

from ._io import (
    JSONFileError,
    NpzRows,
    array_file_bytes,
    fsync_file,
    is_stdout,
    load_arrays,
    memory_limit,
    open_regular,
    output_target,
    read_json,
    replace_synced,
    temp_path,
)
from .arg_types import (
    byte_count,
    check_outputs,
    k_neighbours,
    kernel_sigma,
    output_dir,
    output_file,
    output_file_or_stdout,
    seed,
    threads,
)
from .cli_help import examples, install_hint, package_version
from .commands import Command, Parser, UsageError, add_commands, command
from .datastores import DEVICE_RECIPES
from .datastores.recipes import describe_recipe
from .errors import one_line
from .interrupt import INTERRUPTED
from .knn import DEFAULT_K, DEFAULT_SIGMA
from .manifest import FORMAT, Manifest
from .ort_format import MODEL_FORMATS
from .predictor_graph import graph_backends
from .preprocess import is_one_sample
from .runtime import Runtime, check_labels

PROG = "knnper-edge"
EXIT_ERROR = 2
STRATEGIES = ("fifo", "concatenate", "fixed")
BUNDLE_HELP = "bundle directory (a client_NNNN folder that `knnper export` wrote)"
COMMANDS: dict[str, Command] = {}  # by name, in the order of the help


def register_command(cmd: Command) -> None:
    """Make `cmd` a command of knnper-edge (a name already taken is refused)."""
    if cmd.name in COMMANDS:
        raise ValueError(f"knnper-edge already has a command {cmd.name!r}")
    COMMANDS[cmd.name] = cmd


EXAMPLE = "bundles/500k/client_0003"  # the README's bundle, in the examples
ORDER_OF_USE = examples(
    f"knnper-edge info {EXAMPLE}                          # 1. check it",
    f"knnper-edge predict {EXAMPLE} --input x.npy         # 2. use it",
    f"knnper-edge evaluate {EXAMPLE} --data test.npz      # 3. measure it",
    f"knnper-edge add {EXAMPLE} --data new.npz            # 4. teach it",
    note="Order of use: a bundle comes from `knnper export` on the server (one client_NNNN "
    "folder per device), or from `knnper-edge init` with the device's own data; `info` checks "
    "it, `predict` and `evaluate` use it, `add` teaches it labelled samples (rewriting it in "
    "place), `export-onnx` makes one ONNX file of it for apps without Python, `keygen` makes "
    "the key pair that signs bundles. `knnper-edge COMMAND --help` gives each one's options.",
)
INPUT_SPEC_HELP = (
    "JSON file with the input spec (what the encoder takes): for images "
    '{"kind": "image", "shape": [H, W, C], "dtype": "uint8", "mean": [C floats], '
    '"std": [C floats > 0]} (a pixel becomes (x/255 - mean) / std), for text '
    '{"kind": "tokens", "shape": [L], "dtype": "int64", "vocab_size": V}; a bundle\'s '
    'manifest.json works too (its "input" field is read)'
)


def _build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog=PROG,
        description="kNN-Per personalized inference on the device: "
        "predict, evaluate and keep learning with a bundle that `knnper export` wrote.",
        epilog=ORDER_OF_USE,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    p.add_argument(
        "--threads",
        type=threads,
        default=1,
        help="onnxruntime intra-op and numpy BLAS threads (1 is fastest at batch 1)",
    )
    p.add_argument(
        "--trusted-key",
        action="append",
        metavar="PUBLIC.pem",
        help="refuse bundles not signed by this Ed25519 key (repeat for several; default: "
        "signatures are not checked)",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_commands(sub, COMMANDS.values())
    return p


def _predict_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("bundle", help=BUNDLE_HELP)
    s.add_argument("--input", required=True, help="X.npy: uint8 images NHWC or token ids")
    s.add_argument(
        "--output",
        type=output_file_or_stdout,
        help="write the [N, C] probabilities here (.npy; - or /dev/stdout: the .npy "
        "bytes to standard output, the summary then going to stderr; an existing "
        "path must be a regular file or a link to one)",
    )
    s.add_argument(
        "--labels",
        action="store_true",
        help="print every predicted label, one per line (default: a summary)",
    )


def _evaluate_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("bundle", help=BUNDLE_HELP)
    s.add_argument("--data", required=True, help=".npz with x and y (or x_test and y_test)")


def _add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("bundle", help=BUNDLE_HELP)
    s.add_argument("--data", required=True, help=".npz with x and y (or x_train and y_train)")
    s.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=None,
        help="fifo: evict the oldest samples for the new; concatenate: grow to the "
        "budget, then evict; fixed: keep the datastore as it is (default: the "
        "bundle's update_strategy)",
    )


def _init_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--encoder", required=True, help="encoder.onnx")
    s.add_argument("--data", required=True, help=".npz with x, y (or x_train, y_train)")
    s.add_argument(
        "--budget",
        required=True,
        type=byte_count,
        help="bytes, or with a unit: 500000, 500kB, 1.5MB, 2MiB",
    )
    s.add_argument(
        "--out",
        required=True,
        type=output_dir,
        help="bundle directory to write (refused if it holds a bundle, unless --force)",
    )
    s.add_argument(
        "--force",
        action="store_true",
        help="replace the bundle --out holds (it loses what `add` taught it)",
    )
    spec = s.add_mutually_exclusive_group(required=True)
    spec.add_argument(
        "--like",
        help="take the input spec (and k, sigma, and the server's "
        "pooled lambda rule where it ships one) from this bundle; with "
        "--trusted-key its signature is verified and --encoder must be the "
        "encoder it signs, or its export's shared encoder.onnx signed beside it "
        "(encoder.onnx.sig.json) and of the model version it records",
    )
    spec.add_argument("--input-spec", help=INPUT_SPEC_HELP)
    s.add_argument(
        "--k",
        type=k_neighbours,
        default=None,
        help=f"neighbours of the kNN head (default: --like's, else {DEFAULT_K})",
    )
    s.add_argument(
        "--sigma",
        type=kernel_sigma,
        default=None,
        help=f"kernel width of the kNN head (default: --like's, else {DEFAULT_SIGMA:g})",
    )
    s.add_argument(
        "--recipes",
        default=",".join(DEVICE_RECIPES),
        help="comma-separated candidates, e.g. flat:int8,flat:fp16",
    )
    s.add_argument(
        "--val-fraction",
        type=float,
        default=0.2,
        help="fraction of the data held out to choose the recipe and lambda",
    )
    s.add_argument("--seed", type=seed, default=0, help="seed of the validation split")
    s.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="fifo",
        help="the bundle's update strategy for later `add` calls",
    )
    s.add_argument(
        "--client-id",
        type=int,
        default=-1,
        help="client id written in the manifest (-1: a device of its own)",
    )
    s.add_argument(
        "--keep-inputs",
        action="store_true",
        help="also keep every sample's raw input (counted in the budget, so fewer "
        "samples fit), so that `upgrade` re-embeds them exactly when the model "
        "changes",
    )


def bundle_argument(s: argparse.ArgumentParser) -> None:
    """The bundle a command reads, its first argument."""
    s.add_argument("bundle", help=BUNDLE_HELP)


def _export_onnx_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("bundle", help=BUNDLE_HELP)
    s.add_argument(
        "--out", required=True, type=output_file, help="predictor file to write (.onnx or .ort)"
    )
    s.add_argument(
        "--format",
        choices=MODEL_FORMATS,
        default="onnx",
        help="onnx, or ort: onnxruntime's ORT format for its mobile (Android, iOS) and minimal "
        "builds, with OUT.required_operators.config listing the operators a reduced build needs",
    )
    s.add_argument(
        "--keys-as-inputs",
        action="store_true",
        help="take keys and labels as graph inputs (written beside the graph as "
        "OUT.keys.f32 and OUT.labels.i64) instead of baking them in",
    )


def _upgrade_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("bundle", help=BUNDLE_HELP)
    s.add_argument(
        "--to",
        required=True,
        help="the release's bundle for this device (a client_NNNN folder of the new export)",
    )
    s.add_argument(
        "--map",
        default=None,
        help="the release's key map file (default: "
        "TO/../upgrades/from-<this bundle's encoder id>.npz)",
    )
    s.add_argument(
        "--force",
        action="store_true",
        help="map the keys even where the release advises to keep the old keys or start "
        "fresh, and go back to an older version (a downgrade, refused without it)",
    )
    s.add_argument(
        "--release-key",
        action="append",
        metavar="PUBLIC.pem",
        help="verify the release (--to) and its key map against this Ed25519 key (repeat for "
        "several), whether or not the bundle itself is signed: a bundle the device built "
        "(init) is not (default: the --trusted-key keys, which the bundle must be signed by)",
    )


def _keygen_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--private", required=True, help="private key to write (PEM, mode 0600)")
    s.add_argument("--public", required=True, help="public key to write (PEM)")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: warning: %(message)s")
    try:
        args = _build_parser().parse_args(argv)
        # values are checked where they are loaded (finite, in range); a floating-point
        # warning would only print numpy's source lines before the one-line error
        with np.errstate(all="ignore"):
            check_outputs(args)
            return COMMANDS[args.command].run(args)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except KeyboardInterrupt:  # every write is atomic: nothing is left half-done
        print(f"{PROG}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as exc:
        if os.environ.get("KNNPER_EDGE_DEBUG"):
            raise
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR


def _one_line(exc: BaseException) -> str:
    """errors.one_line, naming the type of an error a user would not recognise by its text."""
    known = (UsageError, ValueError, OSError, NotImplementedError, BadZipFile)
    text = one_line(exc)
    if isinstance(exc, UsageError) and exc.prog and "--help" not in text:
        return f"{text} (see {exc.prog} --help)"  # a bad flag: where the flags are listed
    return (
        text
        if isinstance(exc, known) or text == type(exc).__name__
        else (f"{type(exc).__name__}: {text}")
    )


# ----------------------------------------------------------------------------- inputs


# What the arrays of one input file may take in memory on a device when they cannot be read in
# rows (one sample, a Fortran-order array); the headers are checked before anything is
# decompressed. Inputs with a sample axis are read CHUNK_ROWS at a time, whatever their size.
DEVICE_INPUT_BYTES = 256 << 20
CHUNK_ROWS = 4096


@contextmanager
def _array_file(path: str) -> Iterator[None]:
    """Reading `path` as an .npy/.npz: what can go wrong, as one line each."""
    try:
        yield
    except FileNotFoundError:
        raise UsageError(f"no such file: {path}") from None
    except IsADirectoryError:
        raise UsageError(f"{path} is a directory, not a file") from None
    except (ValueError, OSError, EOFError, BadZipFile) as exc:
        raise UsageError(f"cannot read {path} as .npy/.npz: {_one_line(exc)}") from None


def _load(path: str):
    with _array_file(path):
        return load_arrays(path, min(DEVICE_INPUT_BYTES, memory_limit()), "arrays")


def _lazy_xy(path: str, alternatives: tuple[tuple[str, str], ...]) -> NpzRows | None:
    """x and y of an .npz as rows read lazily, when they have one label per row; None when
    they cannot be (then `_load_xy` reads them whole, or says what is wrong)."""
    try:
        with open_regular(path) as f, ZipFile(f) as zf:
            names = set(zf.namelist())
        for xk, yk in alternatives:
            if f"{xk}.npy" in names and f"{yk}.npy" in names:
                rows = NpzRows(path, (xk, yk))
                shapes = rows.shapes
                return rows if len(shapes[xk]) >= 2 and len(shapes[yk]) == 1 else None
    except (ValueError, OSError, BadZipFile, KeyError):
        return None
    return None


def _load_xy(path: str, alternatives: tuple[tuple[str, str], ...]) -> tuple[np.ndarray, np.ndarray]:
    data = _load(path)
    if isinstance(data, np.ndarray):
        raise UsageError(f"{path} is a .npy array; expected an .npz with x and y")
    with data:
        try:
            for xk, yk in alternatives:
                if xk in data.files and yk in data.files:
                    return data[xk], data[yk]
        except (ValueError, OSError, EOFError, BadZipFile) as exc:
            raise UsageError(f"cannot read {path}: {_one_line(exc)}") from None
        names = " or ".join(f"{a} and {b}" for a, b in alternatives)
        raise UsageError(f"{path} has arrays {sorted(data.files)}; expected {names}")


# ----------------------------------------------------------------------------- commands


def _trusted(args, paths: list[str] | None = None) -> list | None:
    """The public keys of `paths` (default: --trusted-key), or None where none is given."""
    paths = args.trusted_key if paths is None else paths
    if not paths:
        return None
    from .signing import load_public_key

    return [load_public_key(path) for path in paths]


def _runtime(args) -> Runtime:
    return Runtime.load(
        args.bundle,
        intra_op_threads=args.threads,
        blas_threads=args.threads,
        trusted_keys=_trusted(args),
    )


def cmd_upgrade(args) -> int:
    release_keys = _trusted(args, args.release_key)  # a key that cannot load fails first
    rt = _runtime(args)
    report = rt.upgrade(args.to, key_map=args.map, trusted_keys=release_keys, force=args.force)
    if report.how == "nothing to do":
        print(f"bundle {rt.path} is already at the version of {args.to}: nothing to do")
        return 0
    print("\n".join([f"upgraded      {rt.path}", *report.lines()]))
    return 0


def cmd_predict(args) -> int:
    to_stdout = is_stdout(args.output)
    if to_stdout and args.labels:
        raise UsageError("--output - and --labels both write to standard output; choose one")
    if args.output and not to_stdout and Path(args.output).suffix != ".npy":
        raise UsageError(f"--output must end in .npy, got {args.output}")
    x = _map_npy(args.input)
    rt = _runtime(args)
    if x.ndim == 0 or is_one_sample(x.shape, rt.input_spec):
        x = x[None]  # one sample: the runtime checks it as it would a batch of one
    output = _ProbabilityFile(args.output, x.shape[0], rt.num_classes) if args.output else None
    labels = np.zeros(x.shape[0], np.int64)
    with output or nullcontext():
        for start in range(0, x.shape[0], CHUNK_ROWS):
            proba = rt.predict_proba(x[start : start + CHUNK_ROWS])
            labels[start : start + proba.shape[0]] = proba.argmax(axis=1)
            if output is not None:
                output.array[start : start + proba.shape[0]] = proba
    if args.labels:
        sys.stdout.write("".join(f"{label}\n" for label in labels))
    else:
        print(
            _prediction_summary(labels, rt.num_classes, args.output),
            file=sys.stderr if to_stdout else sys.stdout,
        )
    return 0


def _map_npy(path: str) -> np.ndarray:
    """An .npy memory-mapped (its header checked against its size first): rows are read as
    they are predicted, so a large input is not held in memory."""
    with _array_file(path):
        array_file_bytes(path)
        x = np.load(path, mmap_mode="r", allow_pickle=False)
    if not isinstance(x, np.ndarray):
        x.close()
        raise UsageError(f"{path} is an .npz archive; expected one .npy array")
    return x


class _ProbabilityFile:
    """The [N, C] float64 probabilities written row chunks at a time into a temporary .npy,
    renamed into place (fsynced) only when every row is written: over the regular file the
    path names or links to (`output_target`); for `-` / /dev/stdout, a private temporary
    copied to standard output once complete."""

    def __init__(self, path: str, rows: int, classes: int) -> None:
        self.path = None if is_stdout(path) else output_target(path)
        self.private = tempfile.mkdtemp() if self.path is None else None
        self.tmp = (
            Path(self.private) / "probabilities.npy" if self.path is None else temp_path(self.path)
        )
        self.array = np.lib.format.open_memmap(
            self.tmp, mode="w+", dtype=np.float64, shape=(rows, classes)
        )

    def __enter__(self) -> _ProbabilityFile:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        try:
            if kind is None:
                self.array.flush()
                if self.path is None:
                    sys.stdout.flush()
                    with open(self.tmp, "rb") as f:
                        shutil.copyfileobj(f, sys.stdout.buffer)
                    sys.stdout.buffer.flush()
                else:
                    fsync_file(self.tmp)
                    replace_synced(self.tmp, self.path)
        finally:
            del self.array
            self.tmp.unlink(missing_ok=True)
            if self.private is not None:
                os.rmdir(self.private)


def _prediction_summary(labels: np.ndarray, num_classes: int, output: str | None) -> str:
    """How many inputs, how they spread over the classes, where the probabilities went."""
    counts = np.bincount(labels, minlength=num_classes)
    spread = ", ".join(f"{c}: {n}" for c, n in enumerate(counts) if n)
    where = f"probabilities in {output}" if output else "--output FILE.npy keeps the probabilities"
    return (
        f"predicted {labels.shape[0]} input(s); per label {{{spread}}}; {where}; "
        "--labels prints each one"
    )


def cmd_evaluate(args) -> int:
    alternatives = (("x", "y"), ("x_test", "y_test"))
    rows = _lazy_xy(args.data, alternatives)
    if rows is None:
        x, y = _load_xy(args.data, alternatives)
        if y.ndim != 1 or y.shape[0] == 0:
            raise UsageError(
                f"{args.data}: labels must be a non-empty 1-D array, got {list(y.shape)}"
            )
        chunks, count = [(x, y)], y.shape[0]
    else:
        chunks, count = rows.chunks(CHUNK_ROWS), len(rows)
        if count == 0:
            raise UsageError(f"{args.data}: labels must be a non-empty 1-D array, got [0]")
    rt = _runtime(args)
    correct = np.zeros(3, np.int64)  # kNN-Per, global model, datastore alone
    head = rt.head
    for x, y in chunks:
        y = check_labels(y, y.shape[0], rt.num_classes)
        p_local, p_global = rt.components(x)
        if p_local.shape[0] != y.shape[0]:
            raise UsageError(f"{args.data}: {p_local.shape[0]} inputs but {y.shape[0]} labels")
        for i, p in enumerate((head.mix(p_local, p_global), p_global, p_local)):
            correct[i] += int(np.sum(p.argmax(1) == y))
    right = int(correct[0])
    acc_global, acc_local = (correct[1:] / count).tolist()
    print(
        f"accuracy {100 * right / count:.1f}% on {count} samples ({right} right; "
        f"lambda {rt.lam:g}; global model {100 * acc_global:.1f}%, datastore alone "
        f"{100 * acc_local:.1f}%)"
    )
    return 0


def cmd_add(args) -> int:
    alternatives = (("x", "y"), ("x_train", "y_train"))
    rows = _lazy_xy(args.data, alternatives)
    if rows is None:
        x, y = _load_xy(args.data, alternatives)
        rt = _runtime(args)
        report = rt.add(x, y, strategy=args.strategy)
    else:
        rt = _runtime(args)
        report = rt.add_chunks(rows.chunks(CHUNK_ROWS), len(rows), strategy=args.strategy)
    print(
        f"{report.strategy}: received {report.received}: added {report.added}, "
        f"{_dropped(report)}; evicted {report.evicted} stored before; datastore holds "
        f"{report.size} samples; footprint {report.footprint_bytes}/{rt.budget.total} bytes"
    )
    return 0


def _dropped(report) -> str:
    """Why received samples were not added: every one of them is accounted for."""
    if not report.dropped:
        return "dropped 0"
    if report.strategy == "fixed":
        return f"dropped {report.dropped} (the fixed strategy keeps the datastore as it is)"
    return (
        f"dropped the oldest {report.dropped} of them (the datastore holds at most "
        f"{report.added} samples within its capacity and budget)"
    )


def _read_spec_file(path: str) -> dict:
    try:
        spec = read_json(
            path,
            limit=1 << 20,
            fix="give the input spec as a JSON object (or a bundle's manifest.json)",
        )
    except FileNotFoundError:
        raise UsageError(f"no such file: {path}") from None
    except JSONFileError as exc:
        raise UsageError(f"input spec {exc}") from None
    if isinstance(spec, dict) and "input" in spec and "kind" not in spec:
        spec = spec["input"]  # a whole manifest.json works too
    return spec


def cmd_init(args) -> int:
    from .bundle import read_manifest
    from .device_choice import InitSettings
    from .device_init import init_bundle
    from .knn import CLIENT_RULE

    k, sigma, rule, like = args.k, args.sigma, CLIENT_RULE, None
    if args.trusted_key and not args.like:
        raise UsageError(
            "--trusted-key needs --like SIGNED_BUNDLE with init: --encoder is "
            "verified against that bundle's signature and model version"
        )
    if args.like:
        like = read_manifest(args.like)
        if args.trusted_key:
            _verify_like(args, like)
        spec = like.input
        rule, set_aside = like.new_device_lambda_rule()
        if set_aside:
            print(f"note: {set_aside}", file=sys.stderr)
        k = like.k if k is None else k
        sigma = like.sigma if sigma is None else sigma
    else:
        spec = _read_spec_file(args.input_spec)
    if not Path(args.encoder).is_file():
        raise UsageError(f"no such file: {args.encoder}")
    if not args.force and (Path(args.out) / "manifest.json").is_file():
        raise UsageError(
            f"--out {args.out} already holds a bundle; choose another --out, or add "
            "--force to replace it (it loses what `add` taught it)"
        )
    budget = args.budget
    x, y = _load_xy(args.data, (("x", "y"), ("x_train", "y_train")))
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()] if args.recipes else None
    report = init_bundle(
        args.encoder,
        x,
        y,
        budget,
        args.out,
        input_spec=spec,
        settings=InitSettings(
            k=DEFAULT_K if k is None else k,
            sigma=DEFAULT_SIGMA if sigma is None else sigma,
            recipes=recipes,
            val_fraction=args.val_fraction,
            seed=args.seed,
            client_id=args.client_id,
            update_strategy=args.strategy,
            intra_op_threads=args.threads,
            lambda_rule=rule,
            keep_inputs=args.keep_inputs,
        ),
        release=like,
    )
    acc = "n/a" if report.val_accuracy is None else f"{100 * report.val_accuracy:.1f}%"
    fp = report.manifest.footprint
    print(
        f"wrote {args.out}: {report.recipe}, lambda {report.lam:g}, validation accuracy {acc}; "
        f"footprint {fp.total}/{budget} bytes (encoder {fp.encoder}, datastore {fp.datastore})"
    )
    return 0


def _verify_like(args, like: Manifest) -> None:
    """With --trusted-key, what init takes from --like (the input normalisation, k, sigma, the
    lambda rule) must be what a trusted key signed, and --encoder either the very encoder that
    signature covers or the release's shared encoder (`knnper export` signs it as
    encoder.onnx.sig.json: with the linear base a client's bundle carries an encoder of its
    own), signed by a trusted key and of the model version the signed manifest records. An
    edited manifest, another encoder, or a shared one unsigned or altered is refused
    (SignatureError)."""
    from ._io import read_within
    from .errors import SignatureError
    from .manifest import ENCODER_FILE
    from .signing import load_public_key, verify_file, verify_signature
    from .versions import ModelVersion, encoder_sha256

    keys = [load_public_key(path) for path in args.trusted_key]
    signed = verify_signature(args.like, like, keys, f"--like bundle {args.like}")
    data = read_within(
        args.encoder, args.budget, lambda why: UsageError(f"--encoder {args.encoder} {why}")
    )
    if encoder_sha256(data) == signed.files[ENCODER_FILE]:
        return
    use = f"use {Path(args.like) / ENCODER_FILE} or its export's signed {ENCODER_FILE}"
    try:
        verify_file(args.encoder, data, keys)
    except SignatureError as exc:
        raise SignatureError(
            f"--encoder is not the encoder the signed bundle {args.like} carries, nor a "
            f"signed shared encoder ({exc}); {use}"
        ) from None
    release = ModelVersion.of(signed)
    problem = (
        release.encoder_problem(data, f"--encoder {args.encoder} (signed)")
        if release is not None
        else f"--encoder {args.encoder} is signed, but {args.like} records no model version"
    )
    if problem:
        raise SignatureError(f"{problem}; {use}")


def cmd_info(args) -> int:
    from .versions import describe

    rt = _runtime(args)
    m = rt.manifest
    spec = m.input
    fp = m.footprint
    lines = [
        f"bundle        {rt.path} (every file matches its sha256; format {FORMAT} "
        f"v{m.format_version})",
        f"signature     {_signature_status(rt.path, bool(args.trusted_key))}",
        f"client        {m.client_id}"
        + (
            " (a device's own bundle, from `knnper-edge init`)"
            if m.client_id == -1
            else " (the federated client it was exported for)"
        ),
        f"input         {spec.kind} {list(spec.shape)}",
        f"classes       {m.num_classes}",
        f"embedding     {m.embedding_dim}",
        f"kNN           k={m.k} sigma={m.sigma:g} lambda={m.lam:g}",
        f"datastore     {m.recipe}, {rt.datastore.stored_words()}",
        f"              ({describe_recipe(m.recipe)})",
        f"update        {m.update_strategy}",
        f"footprint     {fp.total} of {m.budget.total} bytes (encoder {fp.encoder}, "
        f"datastore {fp.datastore})",
        f"files         {', '.join(sorted(m.files))}",
        f"version       {describe(rt.version)}",
    ]
    print("\n".join(lines))
    return 0


def cmd_export_onnx(args) -> int:
    from .portable import write_portable

    if importlib.util.find_spec("onnx") is None:
        raise UsageError(
            "export-onnx builds the graph with the onnx package, which this install "
            f"lacks: {install_hint('portable')}"
        )
    if Path(args.out).suffix != f".{args.format}":
        raise UsageError(
            f"--out must end in .{args.format} for --format {args.format}, got {args.out}"
        )
    written = write_portable(
        _runtime(args), args.out, keys_as_inputs=args.keys_as_inputs, model_format=args.format
    )
    print(f"wrote {', '.join(str(p) for p in written)}")
    return 0


def _signature_status(bundle: Path, checked: bool) -> str:
    """Signed and verified, signed but not checked, or unsigned: `info` without a trusted key
    reads a signature's key id but cannot tell whether the manifest still matches it."""
    from .signing import MAX_SIGNATURE_BYTES, SIGNATURE_FILE

    path = Path(bundle) / SIGNATURE_FILE
    if not path.is_file():
        return "unsigned"
    if checked:  # Runtime.load verified it against a trusted key, or refused the bundle
        return "signed and verified against a --trusted-key"
    try:
        key = str(read_json(path, limit=MAX_SIGNATURE_BYTES, fix="")["key"])[:16]
    except (OSError, ValueError, KeyError, TypeError):
        key = "unreadable"
    return (
        f"signed (key {key}...), not checked: give --trusted-key PUBLIC.pem to verify "
        "it and the manifest against it"
    )


def cmd_keygen(args) -> int:
    from .signing import generate_key_pair

    key_id = generate_key_pair(args.private, args.public)
    print(f"wrote {args.private} (keep it secret) and {args.public}; key {key_id[:16]}")
    return 0


# ----------------------------------------------------------------------------- registrations
# in the order of the help; a new command is its function and one registration here


register_command(
    command(
        "predict",
        cmd_predict,
        _predict_arguments,
        help="predict labels for an .npy of raw inputs",
        epilog=examples(
            f"knnper-edge predict {EXAMPLE} --input data/client_3/test_x.npy --output p.npy",
            f"knnper-edge predict {EXAMPLE} --input data/client_3/test_x.npy --labels > labels.txt",
        ),
    )
)
register_command(
    command(
        "evaluate",
        cmd_evaluate,
        _evaluate_arguments,
        help="accuracy on a labelled .npz (x, y or x_test, y_test)",
        epilog=examples(
            f"knnper-edge evaluate {EXAMPLE} --data data/client_3/test.npz",
            note="Prints the bundle's accuracy in %, beside the global model's alone "
            "and the datastore's alone.",
        ),
    )
)
register_command(
    command(
        "add",
        cmd_add,
        _add_arguments,
        help="learn from labelled samples (.npz with x, y); rewrites the bundle in place",
        description="Add labelled samples to the bundle's datastore: the bundle is rewritten in "
        "place (a crash leaves the old bundle or the new one, never a mix). Copy the folder "
        "first to keep the bundle as exported.",
        epilog=examples(
            f"knnper-edge add {EXAMPLE} --data data/client_3/val.npz --strategy fifo",
            note="Prints what became of every sample received: added, dropped "
            "(and why), and how many samples stored before were evicted to make "
            "room; then what the datastore holds and its bytes against the "
            "budget.",
        ),
    )
)
register_command(
    command(
        "init",
        cmd_init,
        _init_arguments,
        help="build a bundle for a new device from its own data",
        epilog=examples(
            "knnper-edge init --encoder bundles/500k/encoder.onnx --data "
            f"data/client_7/train.npz --budget 300KB --like {EXAMPLE} --out "
            "bundles/my-device",
            "knnper-edge init --encoder encoder.onnx --data train.npz --budget "
            "2MB --input-spec spec.json --out bundles/my-device",
            note='spec.json, for 28x28 grey images: {"kind": "image", "shape": '
            '[28, 28, 1], "dtype": "uint8", "mean": [0.286], "std": [0.353]}',
        ),
    )
)
register_command(
    command(
        "info",
        cmd_info,
        bundle_argument,
        help="verify a bundle and summarize its manifest",
        epilog=examples(
            f"knnper-edge info {EXAMPLE}",
            f"knnper-edge --trusted-key keys/signing.pub info {EXAMPLE}",
            note="Each line says what it shows: the client the "
            "bundle was exported for (-1: a device's own, from "
            "`init`), the datastore's recipe and each of its parts "
            "in words (n1944: holds at most 1944 samples, beside "
            "how many it stores), and the bytes against the "
            "budget.",
        ),
    )
)
register_command(
    command(
        "export-onnx",
        cmd_export_onnx,
        _export_onnx_arguments,
        # read when the parser is built: a backend registered later counts
        help=lambda: (
            "the whole prediction as one ONNX graph "
            f"({' and '.join(graph_backends())} bundles) for devices without Python"
        ),
        epilog=examples(
            f"knnper-edge export-onnx {EXAMPLE} --out bundles/predictor.onnx",
            f"knnper-edge export-onnx {EXAMPLE} --out bundles/predictor-app.onnx --keys-as-inputs",
            f"knnper-edge export-onnx {EXAMPLE} --out bundles/predictor.ort --format ort",
        ),
    )
)
register_command(
    command(
        "upgrade",
        cmd_upgrade,
        _upgrade_arguments,
        help="carry the bundle's samples to a new model version, in place",
        description="Turn the bundle into the version of a release's bundle (--to): its "
        "encoder and settings, with every sample the bundle stores (the exported ones and those "
        "`add` taught it) carried over: re-embedded where the bundle kept its raw inputs, else "
        "mapped by the map the release ships (upgrades/ beside --to); a ProtoNN bundle keeps "
        "its prototypes and buffer, the release's reverse map folded into its projection. "
        "Crash-safe: killed at any "
        "instant, the bundle is the old version or the new one.",
        epilog=examples(
            f"knnper-edge upgrade {EXAMPLE} --to bundles-v2/500k/client_0003",
            note="Prints the version from -> to, the samples carried and how, "
            "any evicted because the new encoder leaves less room, and the "
            "server's evidence for the map.",
        ),
    )
)
register_command(
    command(
        "keygen",
        cmd_keygen,
        _keygen_arguments,
        help="make an Ed25519 key pair for signing bundles",
        epilog=examples(
            "knnper-edge keygen --private keys/signing.pem --public keys/signing.pub",
            note="Then `knnper export ... --signing-key "
            "keys/signing.pem` signs bundles, and `knnper-edge "
            "--trusted-key keys/signing.pub` refuses any other.",
        ),
    )
)


if __name__ == "__main__":
    sys.exit(main())
