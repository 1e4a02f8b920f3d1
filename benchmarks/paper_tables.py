"""The paper's Tables 1 and 2 (seen and unseen clients) at CPU scale: every method on
Fashion-MNIST (Dirichlet alpha = 0.3), CIFAR-10 (Dirichlet alpha = 0.3) and CIFAR-10 with two
classes per client (the paper's pathological "v2" split), with `knnper bench table`.

The scale is chosen so one table takes about 15 minutes of one CPU core (estimated from measured
per-sample costs, ~0.6 ms per training sample and epoch for the small CNN): 50 clients (10 of them
unseen), a stratified 8,000-image subsample of the training set, the small CNN, 15 rounds of one
local epoch. The whole table costs about 17 FedAvg runs: Ditto (4 personal models) and APFL (5)
take 5-6 each; all methods share the rounds, epochs, batch size and learning-rate schedule.

    python benchmarks/paper_tables.py                 # all three tables into runs/paper_tables
    python benchmarks/paper_tables.py --only cifar10 --tune-lr
    python benchmarks/paper_tables.py --smoke         # tiny settings: checks the pipeline
    python benchmarks/paper_tables.py --smoke --only fashion-mnist --methods fedavg,knnper

Each table lands in OUT/NAME/ (table.md, table1.csv, table2.csv, clients.csv, results.json) and
all of them in OUT/tables.md. Re-running resumes from the checkpoints and cached results.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.tables import TableOptions, format_markdown, run_table  # noqa: E402
from fed_train.algorithms.base import TrainingConfig  # noqa: E402
from fed_train.run import RunConfig  # noqa: E402

CIFAR10 = REPO.parent / "shared" / "data" / "cifar10" / "cifar10.npz"
TRAINING = TrainingConfig(
    rounds=15, epochs=1, batch_size=32, lr=0.05, momentum=0.9, milestones=(0.5, 0.75)
)
SCALE = {"clients": 50, "max_train": 8_000, "unseen_fraction": 0.2, "val_fraction": 0.2}


def tables(cifar10: Path) -> dict[str, RunConfig]:
    dirichlet = {"partition": "dirichlet", "alpha": 0.3, "training": TRAINING, **SCALE}
    cifar = {"dataset": "cifar10", "data": str(cifar10), "training": TRAINING, **SCALE}
    return {
        "fashion-mnist": RunConfig(dataset="fashion-mnist", **dirichlet),
        "cifar10": RunConfig(dataset="cifar10", data=str(cifar10), **dirichlet),
        "cifar10-v2": RunConfig(partition="pathological", classes_per_client=2, **cifar),
    }


def smoke(config: RunConfig) -> RunConfig:
    """The same table at a size that runs in seconds: for checking the pipeline, not numbers."""
    return replace(config, clients=10, max_train=500, training=replace(config.training, rounds=1))


def command(name: str, config: RunConfig, out: Path, tune_lr: bool, methods: str) -> str:
    t = config.training
    parts = ["knnper bench table", f"--dataset {config.dataset}"]
    if config.data:
        parts.append(f"--data {config.data}")
    parts.append(f"--partition {config.partition}")
    parts.append(
        f"--classes-per-client {config.classes_per_client}"
        if config.partition == "pathological"
        else f"--alpha {config.alpha:g}"
    )
    parts += [
        f"--clients {config.clients}",
        f"--max-train {config.max_train}",
        f"--rounds {t.rounds}",
        f"--local-epochs {t.epochs}",
        f"--batch-size {t.batch_size}",
        f"--lr {t.lr:g}",
        f"--momentum {t.momentum:g}",
        "--milestones " + " ".join(f"{m:g}" for m in t.milestones),
        f"--methods {methods}",
        f"--out {out}",
    ]
    if tune_lr:
        parts.append("--tune-lr")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "paper_tables")
    parser.add_argument(
        "--only", default=None, help="comma-separated: fashion-mnist, cifar10, cifar10-v2"
    )
    parser.add_argument("--cifar10", type=Path, default=CIFAR10, help="CIFAR-10 npz or folder")
    parser.add_argument(
        "--tune-lr",
        action="store_true",
        help="tune each method's learning rate on validation (5x the cost)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny settings, to check the script")
    parser.add_argument(
        "--methods",
        default="all",
        help="all, or a comma-separated list of the methods `knnper bench table` "
        "knows (the paper's tables are all of them)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared machine a second "
        "thread that has to wait for a busy core slows training many times)",
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    chosen = tables(args.cifar10)
    if args.only:
        names = [n.strip() for n in args.only.split(",")]
        unknown = [n for n in names if n not in chosen]
        if unknown:
            parser.error(f"unknown table(s) {', '.join(unknown)}; known: {', '.join(chosen)}")
        chosen = {n: chosen[n] for n in names}
    out_root = args.out / "smoke" if args.smoke else args.out
    sections = []
    for name, config in chosen.items():
        config = smoke(config) if args.smoke else config
        out = out_root / name
        start = time.perf_counter()
        result = run_table(
            config,
            args.methods,
            out,
            TableOptions(tune_lr=args.tune_lr, progress=not args.no_progress),
            command=command(name, config, out, args.tune_lr, args.methods),
        )
        minutes = (time.perf_counter() - start) / 60
        print(format_markdown(result))
        sections += [
            format_markdown(result),
            f"Command: `{command(name, config, out, args.tune_lr, args.methods)}` "
            f"({minutes:.1f} min this run; cached parts are not re-run)",
            "",
        ]
    out_root.mkdir(parents=True, exist_ok=True)
    (out_root / "tables.md").write_text("\n".join(sections))
    print(f"wrote {out_root / 'tables.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
