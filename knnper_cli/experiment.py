"""`knnper experiment NAME --out DIR [--quick]`: one of the paper's experiments into DIR/NAME
(points.csv, clients.csv, a PNG plot, summary.md). Global models are trained into DIR/runs and
shared by every experiment run into the same DIR; finished points are kept in
DIR/NAME/points.jsonl, so an interrupted experiment resumes where it stopped. Grid values are
checked while the command line is parsed, before anything is trained."""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import replace
from pathlib import Path

from experiments.context import QUICK, Context
from experiments.registry import EXPERIMENTS
from experiments.report import write_report
from experiments.spec import IID_ALPHA, Experiment
from fed_train.device import resolve_device
from fed_train.progress import Progress
from knnper_cli.args import (
    add_knn_arguments,
    add_training_arguments,
    config_from_args,
    knn_request,
    positive_int,
)

log = logging.getLogger(__name__)


def _shown(values: tuple) -> str:
    return ",".join("iid" if v == IID_ALPHA else f"{v:g}" for v in values)


def add_experiment_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("experiment", help="the paper's experiments, one command each: CSV, PNG "
                       "plot and a summary with the paper's claims", description=__doc__)
    names = p.add_subparsers(dest="experiment", metavar="NAME", required=True,
                             parser_class=type(p))
    for exp in EXPERIMENTS.values():
        q = names.add_parser(exp.name, help=exp.help, description=f"The paper: {exp.claim}")
        q.add_argument("--out", required=True, help="output folder, shared by the experiments "
                       "(global models in OUT/runs, this one's files in OUT/NAME)")
        q.add_argument("--quick", action="store_true", help="digits at a tiny scale and small "
                       "grids (under a minute; overrides the data and training flags)")
        for grid in exp.grids:
            q.add_argument(f"--{grid.name.replace('_', '-')}", type=grid.argparse_type(),
                           default=argparse.SUPPRESS, metavar="V,V,...",
                           help=f"{grid.help} (default {_shown(grid.full)}; with --quick "
                                f"{_shown(grid.quick)})")
        add_knn_arguments(q)
        q.add_argument("--checkpoint-every", type=positive_int, default=5,
                       help="FedAvg checkpoint period (base-model: every such checkpoint is a "
                            "point)")
        add_training_arguments(q)
        q.set_defaults(func=_cmd_experiment, spec=exp, parser=q)


def command_line(args: argparse.Namespace) -> str:
    """The command that gives these results: the flags that differ from their defaults."""
    parts = ["knnper"] + (["--threads", str(args.threads)] if args.threads else [])
    parts += ["experiment", args.spec.name]
    for action in args.parser._actions:
        if not action.option_strings or action.dest in ("help", "spec", "parser", "func"):
            continue
        value = getattr(args, action.dest, None)  # grids left out are not in args at all
        if value is None or value == action.default:
            continue
        flag = action.option_strings[-1]
        if value is True:
            parts.append(flag)
        elif isinstance(value, tuple):
            parts += [flag, _shown(value)]
        elif isinstance(value, list):
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    return " ".join(parts)


def _cmd_experiment(args: argparse.Namespace) -> int:
    exp: Experiment = args.spec
    config = replace(QUICK, seed=args.seed) if args.quick else config_from_args(args)
    grids = {g.name: getattr(args, g.name, None) or (g.quick if args.quick else g.full)
             for g in exp.grids}
    started = time.perf_counter()
    # how many points an experiment computes is its own business: lines count them, no total
    with Progress(None, desc=f"experiment {exp.name}", unit="point",
                  enabled=not args.no_progress) as bar:
        ctx = Context(Path(args.out), config, knn=knn_request(args), quick=args.quick,
                      progress=not args.no_progress,
                      points_done=lambda computed: bar.update(measured=computed),
                      device=str(resolve_device(args.device)), client_batch=args.client_batch)
        result = exp.run(ctx, grids)
    summary = write_report(exp, result, ctx.out / exp.name, command=command_line(args),
                           scale_line=ctx.scale_line(), started=started)
    print(summary.read_text())
    print(f"wrote {summary.parent}/points.csv, {result.plot.name} and {summary.name}")
    return 0
