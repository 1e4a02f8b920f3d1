"""Which digits partition the demo uses: for each candidate, train FedAvg with the shared
defaults and measure FedAvg's and kNN-Per's accuracy on the seen clients' validation splits
(never test). The demo takes the partition with the largest validation gain of kNN-Per over
FedAvg, the setting where local memorization visibly matters.

    python benchmarks/demo_partition.py --out benchmarks/results/demo
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from experiments import benchmark_support as C
from experiments.lr_tuning import validation_score
from export.demo import DemoSize, demo_config
from fed_train.algorithms import build_algorithm
from fed_train.algorithms.base import get_weights
from fed_train.evaluation import client_accuracies
from fed_train.run import load_run, train

CANDIDATES = {
    "dirichlet-0.3": {"partition": "dirichlet", "alpha": 0.3},
    "dirichlet-0.1": {"partition": "dirichlet", "alpha": 0.1},
    "pathological-2": {"partition": "pathological", "classes_per_client": 2},
}


def main() -> None:
    p = C.script_parser(__doc__)
    p.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/results/demo"),
        help="folder for partitions.csv and partitions.md",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=Path("runs/bench/demo_partition"),
        help="folder for the training runs",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of partitions and training")
    p.add_argument("--rounds", type=int, default=DemoSize.rounds, help="federated rounds")
    p.add_argument(
        "--local-epochs", type=int, default=DemoSize.local_epochs, help="local epochs per round"
    )
    args = p.parse_args()
    C.setup_logging()
    C.limit_threads(1)
    rows = []
    for name, partition in CANDIDATES.items():
        size = DemoSize(rounds=args.rounds, local_epochs=args.local_epochs)
        config = replace(demo_config(size, args.seed), **partition)
        run_dir = args.work / f"{name}-r{args.rounds}-e{args.local_epochs}"
        train(config, run_dir, progress=False)
        run = load_run(run_dir)
        clients, weights = run.clients(), get_weights(run.model)
        row = {"partition": name}
        for method in ("fedavg", "knnper"):
            algorithm = build_algorithm(method, run.model_factory(), run.config.training)
            scores = client_accuracies(
                algorithm, weights, {}, clients, seed=args.seed, validation=True
            )
            row[f"{method}_val"] = validation_score(scores)
        row["gain_pp"] = 100 * (row["knnper_val"] - row["fedavg_val"])
        rows.append(row)
    best = max(rows, key=lambda r: r["gain_pp"])
    for row in rows:
        row["chosen"] = "yes" if row is best else ""
    columns = [
        ("partition", "partition", ""),
        ("fedavg_val", "FedAvg val acc", ".4f"),
        ("knnper_val", "kNN-Per val acc", ".4f"),
        ("gain_pp", "gain (pp)", ".1f"),
        ("chosen", "chosen", ""),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    C.write_csv(args.out / "partitions.csv", rows, columns)
    table = C.markdown_table(rows, columns)
    info = C.machine_info()
    (args.out / "partitions.md").write_text(
        f"`{C.command_line()}`\n\n{C.machine_line(info)}\n\n{table}\n"
    )
    print(table)


if __name__ == "__main__":
    main()
