"""Copy a finished `knnper bench table` folder's results into benchmarks/results/fair/NAME, with
the validation-accuracy curve of every training run (pooled over the seen clients' validation
splits, one point per round when the table ran with --checkpoint-every 1) as CSV and as a plot
of FedAvg's curve at each learning rate, to show whether the rounds reached a plateau.

    python benchmarks/collect_fair_table.py runs/fair/cifar10/table --name cifar10 \
        --pretrain runs/fair/cifar10/pretrain

A `knnper train` run directory works too (its metrics.jsonl is FedAvg's curve); its `evaluate`
JSON files (eval_*.json) are copied beside the curve.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FILES = ("table.md", "table1.csv", "table2.csv", "clients.csv", "results.json",
         "attribution.csv")


def _run_of(metrics: Path, table: Path) -> tuple[str, float]:
    """(method, initial learning rate) of a table's run folder or of a `knnper train` run."""
    if metrics.parent == table:
        config = json.loads((table / "config.json").read_text())
        return "fedavg", float(config["training"]["lr"])
    return metrics.parent.parent.name, float(metrics.parent.name[3:])


def curves(table: Path) -> list[dict]:
    rows = []
    found = sorted(table.glob("runs/*/lr_*/metrics.jsonl")) or sorted(table.glob("metrics.jsonl"))
    for metrics in found:
        method, lr = _run_of(metrics, table)
        for line in metrics.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                rows.append({"method": method, "lr": lr, "round": r["round"],
                             "val_accuracy": r.get("val_accuracy"),
                             "train_loss": r.get("train_loss")})
    return rows


def plot_fedavg(rows: list[dict], initial: float | None, path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for lr in sorted({r["lr"] for r in rows if r["method"] == "fedavg"}):
        pts = [(r["round"], r["val_accuracy"]) for r in rows
               if r["method"] == "fedavg" and r["lr"] == lr and r["val_accuracy"] is not None]
        if not pts:
            continue
        xs, ys = zip(*sorted(pts), strict=True)
        if initial is not None:
            xs, ys = (0, *xs), (initial, *ys)
        ax.plot(xs, ys, marker="o", label=f"lr {lr:.3g}")
    ax.set_xlabel("round")
    ax.set_ylabel("FedAvg pooled validation accuracy")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("table", type=Path)
    p.add_argument("--name", required=True)
    p.add_argument("--pretrain", type=Path, default=None, help="its pretrain.json is copied too")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "fair")
    args = p.parse_args()
    dest = args.out / args.name
    dest.mkdir(parents=True, exist_ok=True)
    for path in [*(args.table / n for n in FILES), *args.table.glob("eval_*.json")]:
        if path.exists():
            shutil.copy(path, dest / path.name)
    rows = curves(args.table)
    with open(dest / "curves.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["method", "lr", "round", "val_accuracy",
                                               "train_loss"])
        writer.writeheader()
        writer.writerows(rows)
    if args.pretrain is not None:
        shutil.copy(args.pretrain / "pretrain.json", dest / "pretrain.json")
    plot_fedavg(rows, None, dest / "fedavg_curve.png", args.name)
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
