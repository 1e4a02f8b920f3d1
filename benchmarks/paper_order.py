"""The paper's ordering of methods at a scale one GPU finishes in under an hour, in one resumable
command: CIFAR-10 split once into the server's public part and the clients' part (the fair
tables' split), MobileNet-v2-gn pretrained on the server's part with crops and flips, then every
method from that start at 100 clients and 20 rounds; and the small CNN from scratch at the
paper's 200 clients and 100 rounds on the whole training set. kNN-Per is scored with the
project's default personalization (k, sigma, normalisation and the lambda estimator chosen on
validation) and, beside it, with the paper's rule (k = 10, sigma = 1, lambda per client).

    python benchmarks/paper_order.py --device cuda --client-batch 100 --out runs/paper_order
    python benchmarks/paper_order.py --tiny --device cpu --out /tmp/paper_order   # pipeline check

Resumable: every stage that finished is skipped (the split, the pretraining), and the tables
resume from their per-round checkpoints and per-method caches, so a run cut off by a time limit
(`timeout 590 python benchmarks/paper_order.py ...` on a machine lent ten minutes at a time) goes
on where it stopped when run again. Writes OUT/summary.md (both tables under both rules, with
seconds per stage and the device) and OUT/stages.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from experiments import benchmark_support as C
from experiments.tables import TableOptions, format_markdown, run_table
from fed_train.accelerator import PRECISIONS, resolve_device
from fed_train.algorithms.base import TrainingConfig
from fed_train.knn_request import KNNRequest
from fed_train.pretrain import RECORD_FILE, PretrainConfig, pretrain
from fed_train.public_split import split_public
from fed_train.run import RunConfig

log = logging.getLogger("benchmarks.paper_order")
CIFAR10 = C.REPO.parent / "shared" / "data" / "cifar10" / "cifar10.npz"
# the fair CIFAR-10 table chose 0.1 for 7 of its 9 methods; plain SGD, the paper's decay
FAIR_TRAINING = TrainingConfig(
    rounds=20, epochs=1, batch_size=32, lr=0.1, momentum=0.0, milestones=(0.5, 0.75)
)
PAPER_RULE = KNNRequest(mode="paper")


@dataclass(frozen=True)
class Scale:
    dataset: str
    client_train: int
    client_test: int
    pretrain_epochs: int
    mobilenet_clients: int
    mobilenet_rounds: int
    cnn_clients: int
    cnn_rounds: int
    # training images kept, in both tables; None: all of them (the CNN: the whole training
    # set, as the paper; MobileNet: the clients' part of the split)
    max_train: int | None


GPU = Scale("cifar10", 15_000, 5_000, 12, 100, 20, 200, 100, None)
TINY = Scale("digits", 150, 50, 1, 5, 1, 5, 1, 150)


def tables(scale: Scale, data: str | None, init: Path, seed: int) -> dict[str, RunConfig]:
    # what both tables share: the data set, a Dirichlet(0.3) partition, the seed, checkpoints
    shared = RunConfig(
        dataset=scale.dataset,
        max_train=scale.max_train,
        partition="dirichlet",
        alpha=0.3,
        seed=seed,
        checkpoint_every=1,
    )
    mobilenet = replace(
        shared,
        data=str(init.parent / "data" / "clients.npz"),
        clients=scale.mobilenet_clients,
        model="mobilenet-v2-gn",
        init=str(init),
        training=replace(FAIR_TRAINING, rounds=scale.mobilenet_rounds),
    )
    cnn = replace(
        shared,
        data=data,
        clients=scale.cnn_clients,
        model="small-cnn",
        training=TrainingConfig(
            rounds=scale.cnn_rounds,
            epochs=1,
            batch_size=32,
            lr=0.05,
            momentum=0.9,
            milestones=(0.5, 0.75),
        ),
    )
    return {"mobilenet-v2-gn": mobilenet, "small-cnn": cnn}


def with_precision(config: RunConfig, precision: str) -> RunConfig:
    return replace(config, training=replace(config.training, precision=precision))


def paper_rule_table(config: RunConfig, tuned_out: Path, out: Path, options: TableOptions) -> dict:
    """kNN-Per under the paper's rule on the same global model: the tuned table's FedAvg run
    (same configuration and seed) is copied in, so only the personalization is computed."""
    fedavg = out / "runs" / "fedavg"
    if not fedavg.exists():
        shutil.copytree(tuned_out / "runs" / "fedavg", fedavg)
    return run_table(config, ["knnper"], out, replace(options, knn=PAPER_RULE))


def _mean(result: dict, group: str) -> str:
    summary = result[group].get("knnper")
    return "-" if summary is None else f"{100 * summary['mean']:.2f}%"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", type=Path, default=C.REPO / "runs" / "paper_order")
    p.add_argument("--data", default=str(CIFAR10), help="CIFAR-10 npz or folder")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="150 digits images, a few clients, one round: checks the pipeline on a CPU",
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument(
        "--client-batch",
        type=C.positive_int,
        default=1,
        help="clients stepped together (100 on a GPU; 1 on a CPU is faster)",
    )
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument(
        "--mobilenet-rounds",
        type=C.positive_int,
        default=None,
        help=f"rounds of the MobileNet table (default {GPU.mobilenet_rounds})",
    )
    p.add_argument(
        "--cnn-rounds",
        type=C.positive_int,
        default=None,
        help=f"rounds of the small-CNN table (default {GPU.cnn_rounds})",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


class Stages:
    """Each stage's seconds in this call, or that it was done before (stages.json)."""

    def __init__(self) -> None:
        self.record: dict[str, dict] = {}

    def run(self, name: str, done: bool, work: Callable[[], object]) -> None:
        start = time.perf_counter()
        if not done:
            work()
        self.record[name] = {"seconds": round(time.perf_counter() - start, 1), "skipped": done}
        log.info("%s: %s", name, "done before" if done else f"{self.record[name]['seconds']} s")


def prepare(
    args: argparse.Namespace, scale: Scale, data: str | None, device: torch.device, stages: Stages
) -> Path:
    """The split of the data into the server's and the clients' parts, and MobileNet's
    pretraining on the server's part (each skipped where done before); the pretrained folder."""
    out = args.out
    stages.run(
        "split",
        (out / "data" / "clients.npz").is_file(),
        lambda: split_public(
            scale.dataset, data, scale.client_train, scale.client_test, args.seed, out / "data"
        ),
    )
    init = out / "pretrain"
    stages.run(
        "pretrain",
        (init / RECORD_FILE).is_file(),
        lambda: pretrain(
            PretrainConfig(
                dataset=scale.dataset,
                data=str(out / "data" / "clients.npz"),
                public_data=str(out / "data" / "server.npz"),
                model="mobilenet-v2-gn",
                epochs=scale.pretrain_epochs,
                patience=3,
                augment=True,
                precision=args.precision,
                seed=args.seed,
            ),
            init,
            progress=not args.no_progress,
            device=device,
        ),
    )
    return init


def table_section(
    name: str, config: RunConfig, out: Path, options: TableOptions, stages: Stages
) -> list[str]:
    """One model's table (every method, the project's default personalization) and kNN-Per
    under the paper's rule beside it: summary.md's lines."""
    results = {}

    def tuned() -> None:
        results["tuned"] = run_table(config, "all", out / name, options)

    def paper() -> None:
        results["paper"] = paper_rule_table(config, out / name, out / f"{name}-paper-rule", options)

    stages.run(f"{name} table", False, tuned)
    stages.run(f"{name} kNN-Per, paper's rule", False, paper)
    return [
        format_markdown(results["tuned"]),
        "",
        "| kNN-Per's personalization | seen mean | unseen mean |",
        "|---|---|---|",
        *(
            f"| {rule} | {_mean(results[key], 'seen')} | {_mean(results[key], 'unseen')} |"
            for rule, key in (
                ("project default (chosen on validation)", "tuned"),
                ("paper's rule (k 10, sigma 1, lambda per client)", "paper"),
            )
        ),
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    C.setup_logging()
    scale = TINY if args.tiny else GPU
    scale = replace(
        scale,
        mobilenet_rounds=args.mobilenet_rounds or scale.mobilenet_rounds,
        cnn_rounds=args.cnn_rounds or scale.cnn_rounds,
    )
    data = None if args.tiny else args.data
    device = resolve_device(args.device)
    options = TableOptions(
        device=str(device), client_batch=args.client_batch, progress=not args.no_progress
    )
    out = args.out
    stages = Stages()
    init = prepare(args, scale, data, device, stages)
    sections = [
        f"Command: `{C.command_line()}`",
        "",
        f"Device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
        f"; precision {args.precision}; clients stepped together: {args.client_batch}",
        "",
    ]
    for name, config in tables(scale, data, init, args.seed).items():
        sections += table_section(
            name, with_precision(config, args.precision), out, options, stages
        )
    sections += [
        "| stage | seconds this call | skipped (done before) |",
        "|---|---|---|",
        *(f"| {k} | {v['seconds']} | {v['skipped']} |" for k, v in stages.record.items()),
    ]
    (out / "summary.md").write_text("\n".join(sections) + "\n")
    (out / "stages.json").write_text(
        json.dumps(
            {"command": C.command_line(), "machine": C.machine_info(), "stages": stages.record},
            indent=2,
        )
    )
    print(f"wrote {out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
