"""The `knnper-edge` console script: edge_runtime.cli, imported (numpy, onnxruntime) with
Ctrl-C already handled, so an interrupt in the first instant is one line and exit 130."""

from __future__ import annotations

import sys

from .interrupt import exit_on_interrupt, exit_quietly_from_now


def main() -> int:
    """`knnper-edge`: edge_runtime.cli.main, its imports made with Ctrl-C already handled."""
    with exit_on_interrupt("knnper-edge"):
        from .cli import main as cli_main
    try:
        code = cli_main()
    except SystemExit as done:  # --help, --version: argparse's own exit
        code = done.code
    exit_quietly_from_now("knnper-edge")  # a Ctrl-C during the interpreter's own exit
    return code


if __name__ == "__main__":
    sys.exit(main())
