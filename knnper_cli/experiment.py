"""`knnper experiment NAME --out DIR [--quick] [--seeds N]`: one of the paper's experiments into
DIR/NAME (points.csv, clients.csv, a PNG plot, summary.md). Global models are trained into
DIR/runs and shared by every experiment run into the same DIR; finished points are kept in
DIR/NAME/points.jsonl, so an interrupted experiment resumes where it stopped. Grid values are
checked while the command line is parsed, before anything is trained.

With --seeds N the experiment runs for seeds --seed .. --seed+N-1 (each its own partition and
global models, all in DIR/runs and one points.jsonl): each seed's report goes to
DIR/NAME/seed_S/, and DIR/NAME holds the combined one: points.csv with each column's mean and
standard deviation across seeds, clients.csv with every seed's clients (a `seed` column), a plot
of the means, and claims judged on all seeds, clients resampled within their own seed."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from edge_runtime._io import read_json_cache, write_text_atomic
from edge_runtime.arg_types import output_dir, positive_int
from edge_runtime.cli_help import examples
from edge_runtime.commands import command
from experiments import model_update
from experiments.context import QUICK, Context
from experiments.experiment_seeds import combine, combined_result
from experiments.registry import EXPERIMENTS
from experiments.report import SETTINGS_FILE, refuse_other_report, write_report
from experiments.spec import IID_ALPHA, Experiment, ExperimentError
from experiments.table_seeds import seed_dir
from fed_train.accelerator import resolve_device
from fed_train.knn_request import KNNRequest
from fed_train.progress import Progress
from knnper_cli.commands import help_of
from knnper_cli.training_args import (
    add_setting_flags,
    add_training_arguments,
    config_from_args,
    from_flags,
)

log = logging.getLogger(__name__)


def _shown(values: tuple) -> str:
    return ",".join("iid" if v == IID_ALPHA else f"{v:g}" for v in values)


def add_experiment_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "experiment",
        help=help_of("experiment"),
        description=__doc__,
        epilog=examples(
            "knnper experiment capacity --quick --out runs/exp",
            "knnper experiment heterogeneity --dataset fashion-mnist "
            "--clients 30 --rounds 10 --out runs/exp-fmnist",
        ),
    )
    names = p.add_subparsers(dest="experiment", metavar="NAME", required=True, parser_class=type(p))
    for exp in EXPERIMENTS.values():
        q = command(
            exp.name,
            _cmd_experiment,
            help=exp.help,
            description=f"The paper: {exp.claim}",
            epilog=examples(
                f"knnper experiment {exp.name} --quick --out runs/exp",
                f"knnper experiment {exp.name} --quick --seeds 3 --out runs/exp-seeds",
            ),
        ).add_to(names)
        q.add_argument(
            "--out",
            required=True,
            type=output_dir,
            help="output folder, shared by the experiments "
            "(global models in OUT/runs, this one's files in OUT/NAME)",
        )
        q.add_argument(
            "--quick",
            action="store_true",
            help="digits at a tiny scale and small "
            "grids (under a minute; overrides the data and training flags)",
        )
        for grid in exp.grids:
            q.add_argument(
                f"--{grid.name.replace('_', '-')}",
                type=grid.argparse_type(),
                default=argparse.SUPPRESS,
                metavar="V,V,...",
                help=f"{grid.help} (default {_shown(grid.full)}; with --quick "
                f"{_shown(grid.quick)})",
            )
        KNNRequest.add_arguments(q)
        q.add_argument(
            "--checkpoint-every",
            type=positive_int,
            default=5,
            help="FedAvg checkpoint period (base-model: every such checkpoint is a point)",
        )
        add_training_arguments(q)
        q.add_argument(
            "--seeds",
            type=positive_int,
            default=1,
            metavar="N",
            help="run seeds --seed .. --seed+N-1, each with its own partition and "
            "global models: each seed's report in OUT/NAME/seed_S, and in "
            "OUT/NAME the mean +- std across seeds and claims judged on all "
            "seeds (clients resampled within their seed). distribution-shift "
            "runs its own stream seeds (3; 1 with --quick) on every seed's "
            "global model and pools all the streams",
        )
        q.add_argument(
            "--force",
            action="store_true",
            help="replace a report in OUT/NAME that was made with other flags "
            "(without it the command refuses before training anything)",
        )
        q.set_defaults(spec=exp, parser=q)
    _add_model_update(names)


def _add_model_update(names: argparse._SubParsersAction) -> None:
    """`knnper experiment model-update`: its flags default to `model_update.UpdateSettings`."""
    q = command(
        "model-update",
        _cmd_model_update,
        help="what devices keep when the global model "
        "changes: accuracy after an upgrade by path (exact, mapped, stale, "
        "fresh, none) across version gaps (continued, retrained, independent)",
        description=model_update.__doc__,
        epilog=examples(
            "knnper experiment model-update --quick --out runs/exp",
            "knnper experiment model-update --dataset "
            "fashion-mnist --clients 20 --rounds 5 --seeds 3 --out "
            "runs/exp-fmnist",
        ),
    ).add_to(names)
    q.add_argument(
        "--out",
        required=True,
        type=output_dir,
        help="output folder (releases in OUT/model-update/seed_S, the report in OUT/model-update)",
    )
    q.add_argument("--quick", action="store_true", help="digits, 6 clients, 2 rounds")
    pos = positive_int
    add_setting_flags(
        q,
        model_update.UpdateSettings(),
        dataset="data set",
        data="data set location",
        max_train=(pos, "keep a stratified subsample of this many training images"),
        clients=(pos, "clients"),
        rounds=(pos, "FedAvg rounds of v1 (and of the continued training)"),
        pretrain_epochs=(pos, "epochs of the pretraining on the server split"),
        budget=(pos, "each device's budget in bytes"),
        steps=(
            pos,
            "batches each device adds between the versions (the distribution-shift protocol)",
        ),
        shift_at=(int, "first batch of the shifted labels"),
        batch=(pos, "samples per batch"),
        alpha=(float, "Dirichlet concentration of the shifted label distribution"),
        eval_samples=(pos, "images of the shifted distribution each device is scored on"),
    )
    q.add_argument("--seed", type=int, default=0, help="first seed")
    q.add_argument(
        "--seeds",
        type=pos,
        default=1,
        help="seeds --seed .. +N-1; the report pools every seed in OUT/model-update, so "
        "seeds may run as separate invocations",
    )
    q.add_argument(
        "--force",
        action="store_true",
        help="delete OUT/model-update first when it holds a report made with other flags",
    )


def _cmd_model_update(args: argparse.Namespace) -> int:
    settings = from_flags(model_update.UpdateSettings, args)
    if args.quick:
        settings = replace(
            settings,
            dataset="digits",
            data=None,
            clients=6,
            rounds=2,
            pretrain_epochs=2,
            steps=4,
            shift_at=2,
            batch=10,
            eval_samples=60,
        )
    if not 0 < settings.shift_at < settings.steps:
        raise ExperimentError(
            f"--shift-at must be in 1 .. {settings.steps - 1}, got {settings.shift_at}"
        )
    if not settings.alpha > 0:
        raise ExperimentError(f"--alpha must be positive, got {settings.alpha}")
    folder = Path(args.out) / "model-update"

    def line(first: int, count: int) -> str:
        return " ".join(
            [
                "knnper experiment model-update",
                *(["--quick"] if args.quick else []),
                f"--dataset {settings.dataset}",
                *([f"--data {settings.data}"] if settings.data else []),
                *([f"--max-train {settings.max_train}"] if settings.max_train else []),
                f"--clients {settings.clients}",
                f"--rounds {settings.rounds}",
                f"--pretrain-epochs {settings.pretrain_epochs}",
                f"--budget {settings.budget}",
                f"--steps {settings.steps} --shift-at {settings.shift_at}",
                f"--batch {settings.batch} --alpha {settings.alpha}",
                f"--eval-samples {settings.eval_samples}",
                f"--seed {first} --seeds {count}",
                f"--out {args.out}",
            ]
        )

    if args.force:
        shutil.rmtree(folder, ignore_errors=True)
    refuse_other_report(folder, asdict(settings), line(args.seed, args.seeds))
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(
        folder / SETTINGS_FILE,
        json.dumps({"settings": asdict(settings), "command": line(args.seed, args.seeds)}),
    )
    for seed in range(args.seed, args.seed + args.seeds):
        model_update.run_seed(seed_dir(folder, seed), settings, seed)
    # every finished seed in the folder (earlier invocations' too): one report
    rows, seeds = [], []
    for seed_folder in sorted(folder.glob("seed_*")):
        saved = read_json_cache(seed_folder / model_update.ROWS_FILE)
        if saved is not None and model_update.same_protocol(saved, settings):
            rows += saved["rows"]
            seeds.append(int(seed_folder.name.removeprefix("seed_")))
    seeds.sort()
    contiguous = seeds == list(range(seeds[0], seeds[0] + len(seeds)))
    command = line(seeds[0], len(seeds)) if contiguous else line(args.seed, args.seeds)
    model_update.summarise(rows, folder, command)
    print((folder / "summary.md").read_text())
    return 0


def command_line(args: argparse.Namespace) -> str:
    """The command that gives these results: the flags that differ from their defaults."""
    parts = ["knnper"] + (["--threads", str(args.threads)] if args.threads else [])
    parts += ["experiment", args.spec.name]
    for action in args.parser._actions:
        if not action.option_strings or action.dest in ("help", "spec", "parser", "func", "force"):
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
    grids = {
        g.name: getattr(args, g.name, None) or (g.quick if args.quick else g.full)
        for g in exp.grids
    }
    folder = Path(args.out) / exp.name
    seeds = range(args.seed, args.seed + args.seeds)
    started = time.perf_counter()

    def settings(*contexts: Context) -> dict[str, Any]:
        """What a report's figures depend on (not how they were shown or how fast)."""
        return {
            "configs": [c.config.to_dict() for c in contexts],
            "quick": args.quick,
            "grids": {name: sorted(values) for name, values in grids.items()},
            "knn": asdict(KNNRequest.from_args(args)),
        }

    total = exp.count(grids) * args.seeds if exp.count is not None else None
    with Progress(
        total, desc=f"experiment {exp.name}", unit="point", enabled=not args.no_progress
    ) as bar:
        contexts = [_context(args, seed, bar) for seed in seeds]
        if not args.force:
            refuse_other_report(folder, settings(*contexts), command_line(args))
        if args.seeds == 1:
            result = exp.run(contexts[0], grids)
        else:
            measured = []
            for ctx in contexts:  # each seed reported as it finishes: an interruption keeps it
                measured.append(exp.measure(ctx, grids))
                measured[-1].scale = ctx.figure_scale()
                one = argparse.Namespace(**{**vars(args), "seed": ctx.seed, "seeds": 1})
                write_report(
                    exp,
                    exp.summarise(measured[-1], seed_dir(folder, ctx.seed)),
                    seed_dir(folder, ctx.seed),
                    command=command_line(one),
                    scale_line=ctx.scale_line(),
                    started=started,
                    settings=settings(ctx),
                )
            together = combine(measured)
            together.scale = contexts[0].figure_scale(list(seeds))
            result = combined_result(exp.summarise(together, folder), list(seeds))
    summary = write_report(
        exp,
        result,
        folder,
        command=command_line(args),
        scale_line=contexts[0].scale_line(list(seeds)),
        started=started,
        settings=settings(*contexts),
    )
    print(summary.read_text())
    print(f"wrote {summary.parent}/points.csv, {result.plot.name} and {summary.name}")
    return 0


def _context(args: argparse.Namespace, seed: int, bar: Progress) -> Context:
    config = replace(QUICK, seed=seed) if args.quick else replace(config_from_args(args), seed=seed)
    return Context(
        Path(args.out),
        config,
        knn=KNNRequest.from_args(args),
        quick=args.quick,
        progress=not args.no_progress,
        points_done=lambda computed: bar.update(measured=computed),
        device=str(resolve_device(args.device)),
        client_batch=args.client_batch,
        seed_folders=args.seeds > 1,
    )
