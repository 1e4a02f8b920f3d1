"""`knnper bench table` in this process, at digits scale (eight clients, two rounds)."""

from __future__ import annotations

import argparse

from knnper_cli.bench import add_bench_command

TINY = [
    "--dataset",
    "digits",
    "--clients",
    "8",
    "--rounds",
    "2",
    "--local-epochs",
    "1",
    "--batch-size",
    "16",
    "--lr",
    "0.05",
]
# one round on half of digits' training set: for the tests whose assertions hold at any scale
# (the choices a table makes, what it writes and resumes)
LEAN = [*TINY, "--max-train", "700"]
LEAN[LEAN.index("--rounds") + 1] = "1"


def bench(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-progress", action="store_true")
    add_bench_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["--no-progress", "bench", "table", *argv])
    return args.func(args)
