"""The `knnper` console script: knnper_cli.main (argparse, logging, the command modules)
imported with Ctrl-C already handled, so an interrupt in the first instant is one line and exit
130 (from its first statement: only the interpreter's own start comes before it)."""

from __future__ import annotations

import sys

from edge_runtime.interrupt import exit_on_interrupt


def main() -> int:
    """`knnper`: knnper_cli.main.console, its imports made with Ctrl-C already handled."""
    with exit_on_interrupt("knnper"):
        from knnper_cli.main import console
    return console()


if __name__ == "__main__":
    sys.exit(main())
