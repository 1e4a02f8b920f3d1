"""The `knnper` console script. Its commands run the server side (torch, scikit-learn, tqdm,
onnx, edgeml: the `train` extra); on a runtime-only install (`pip install knnper`) it says which
extra to install, in one line, instead of failing with an import traceback."""

from __future__ import annotations

import importlib.util
import signal
import sys
from collections.abc import Sequence

from edge_runtime.cli_help import install_hint, package_version

SERVER_MODULES = ("torch", "sklearn", "tqdm", "onnx", "edgeml")


def missing_server_modules() -> list[str]:
    return [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]


def main(argv: Sequence[str] | None = None) -> int:
    missing = missing_server_modules()
    args = sys.argv[1:] if argv is None else list(argv)
    if missing and args == ["--version"]:
        print(f"knnper {package_version()} (device runtime only: no {', '.join(missing)}; "
              f"the server commands need {install_hint('train')})")
        return 0
    if missing:
        print(f"knnper: this install has the device runtime only (no {', '.join(missing)}); "
              f"the server commands need the train extra: {install_hint('train')} "
              "(on a device, use knnper-edge)", file=sys.stderr)
        return 2
    from export.cli import main as cli_main  # imports torch: only once we know it is there
    from fed_train.cli import INTERRUPTED

    code = cli_main(argv)
    if code == INTERRUPTED:
        # the command is over and its workers are gone: a further Ctrl-C while the
        # interpreter exits would only print a traceback from an exit handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(main())
