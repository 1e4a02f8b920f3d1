"""`knnper bench table`: the paper's comparison tables (experiments.tables)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from edge_runtime.arg_types import output_dir, positive
from edge_runtime.cli_help import examples
from edge_runtime.commands import command
from experiments.lr_tuning import LR_GRID, parse_lr_grid
from experiments.tables import (
    METHODS,
    BenchError,
    TableOptions,
    format_markdown,
    run_seeds,
    run_table,
)
from fed_train import defaults
from fed_train.accelerator import resolve_device
from fed_train.knn_request import KNNRequest
from knnper_cli.commands import help_of
from knnper_cli.training_args import add_training_arguments, config_from_args, from_flags


def _cmd_table(args: argparse.Namespace) -> int:
    if args.lr_grid is not None and not args.tune_lr:
        raise BenchError("--lr-grid is used only with --tune-lr")
    try:
        grid = parse_lr_grid(args.lr_grid) if args.lr_grid is not None else LR_GRID
    except ValueError as err:
        raise BenchError(str(err)) from None
    config = config_from_args(args)
    command = "knnper " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    options = from_flags(  # tune_lr, workers, attribution and client_batch as flagged
        TableOptions,
        args,
        lr_grid=grid,
        hyper={"knnper": {"capacity": args.capacity}},
        progress=not getattr(args, "no_progress", False),
        knn=KNNRequest.from_args(args),
        device=str(resolve_device(args.device)),
    )
    if args.seeds is not None:
        run_seeds(config, args.seeds, Path(args.out), args.methods, options, command=command)
        print((Path(args.out) / "seeds.md").read_text())
        print(f"wrote {args.out}/seeds.md, seeds.csv, seeds.json and seed_S/ per seed")
        return 0
    result = run_table(config, args.methods, Path(args.out), options, command=command)
    print(format_markdown(result))
    print(f"wrote {args.out}/table.md, table1.csv, table2.csv, clients.csv, results.json")
    return 0


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    """`knnper bench table ...`."""
    table_examples = examples(
        "knnper bench table --dataset fashion-mnist --clients 50 --max-train 8000 --rounds 15 "
        "--methods all --out runs/table",
        "knnper bench table --methods local,fedavg,knnper --tune-lr --workers 2 --out runs/t",
        note="Re-running the same command resumes: finished training runs, methods and clients "
        "are kept in OUT.",
    )
    bench = subparsers.add_parser("bench", help=help_of("bench"), epilog=table_examples)
    sub = bench.add_subparsers(dest="bench_command", metavar="table", required=True)
    p = command(
        "table",
        _cmd_table,
        help="every method on one partition: Table 1 (seen clients) and "
        "Table 2 (unseen clients) as CSV and markdown",
        epilog=table_examples,
    ).add_to(sub)
    add_training_arguments(p)
    p.add_argument(
        "--methods", default="all", help=f"all, or a comma-separated list of: {', '.join(METHODS)}"
    )
    p.add_argument(
        "--out", required=True, type=output_dir, help="output folder (re-running resumes it)"
    )
    p.add_argument(
        "--tune-lr",
        action="store_true",
        help="choose each method's learning rate on validation accuracy over the "
        "paper's grid (multiplies the cost by the grid's size)",
    )
    p.add_argument(
        "--lr-grid",
        default=None,
        help="comma-separated learning rates for --tune-lr (default: 10^-0.5 ... 10^-2.5)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=positive(int),
        default=defaults.CHECKPOINT_EVERY,
        help="rounds between checkpoints of each training run, in workers too "
        "(Ctrl-C loses at most this many; a write that would take over a tenth of "
        "the training time waits for a later round)",
    )
    KNNRequest.add_arguments(p)
    p.add_argument(
        "--capacity",
        type=positive(float, 1.0),
        default=1.0,
        help="kNN-Per: fraction of each client's train split in its datastore",
    )
    p.add_argument(
        "--workers",
        type=positive(int),
        default=1,
        help="train the (method, learning rate) runs in this many processes",
    )
    p.add_argument(
        "--seeds",
        type=positive(int),
        default=None,
        help="run the table for this many seeds (--seed, --seed + 1, ...), each with "
        "its own partition and training in OUT/seed_S, and write seeds.md: mean +- "
        "std across seeds and a paired bootstrap interval for kNN-Per minus the best "
        "baseline",
    )
    p.add_argument(
        "--attribution",
        action="store_true",
        help="also evaluate every head on every body (FedAvg, FedRep, pFedGP bodies; "
        "own, linear, GP, kNN and kNN-Per heads) into attribution.csv and table.md",
    )
