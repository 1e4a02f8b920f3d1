"""`knnper demo`: the whole pipeline on scikit-learn's digits in about a minute
(export.demo)."""

from __future__ import annotations

import argparse
from pathlib import Path

from edge_runtime.arg_types import output_dir, positive_int, seed
from edge_runtime.cli_help import examples
from edge_runtime.commands import command
from fed_train.knn_request import KNNRequest
from knnper_cli.commands import help_of


def _cmd_demo(args: argparse.Namespace) -> int:
    from export.demo import format_demo_table, run_demo  # torch: after the flags are parsed

    rows, choice = run_demo(
        Path(args.out),
        seed=args.seed,
        progress=not args.no_progress,
        workers=args.workers,
        knn=KNNRequest.from_args(args),
    )
    print(choice.describe())
    print(format_demo_table(rows))
    print(f"run, evaluation and bundles in {args.out}")
    return 0


def add_demo_command(sub: argparse._SubParsersAction) -> None:
    p = command(
        "demo",
        _cmd_demo,
        help=help_of("demo"),
        epilog=examples("knnper demo", "knnper demo --knn-config paper --out runs/demo-paper"),
    ).add_to(sub)
    p.add_argument(
        "--out", default="runs/demo", type=output_dir, help="run directory (re-running resumes it)"
    )
    p.add_argument("--seed", type=seed, default=0, help="seed of the partition and training")
    p.add_argument(
        "--workers",
        type=positive_int,
        default=2,
        help="processes that size clients' datastores in parallel",
    )
    KNNRequest.add_arguments(p)
