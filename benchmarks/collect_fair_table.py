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
import math
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FILES = ("table.md", "table1.csv", "table2.csv", "clients.csv", "results.json", "attribution.csv")


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
                rows.append(
                    {
                        "method": method,
                        "lr": lr,
                        "round": r["round"],
                        "val_accuracy": r.get("val_accuracy"),
                        "train_loss": r.get("train_loss"),
                    }
                )
    return rows


def diverged_lrs(folder: Path) -> set[str]:
    """FedAvg's learning rates whose training diverged (results.json records them as None)."""
    path = folder / "results.json"
    if not path.exists():
        return set()
    scores = json.loads(path.read_text()).get("validation", {}).get("fedavg", {})
    return {lr for lr, score in scores.items() if score is None}


def plot_fedavg(
    rows: list[dict],
    initial: float | None,
    path: Path,
    title: str,
    diverged: set[str] = frozenset(),
) -> None:
    """One curve per learning rate, rounds as integers; a diverged rate is named in the legend
    but not drawn (its few points before the loss became nan would squash the others)."""
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    skipped = []
    for lr in sorted({r["lr"] for r in rows if r["method"] == "fedavg"}):
        if any(math.isclose(lr, float(d), rel_tol=1e-3) for d in diverged):
            skipped.append(f"{lr:.3g}")
            continue
        pts = [
            (r["round"], r["val_accuracy"])
            for r in rows
            if r["method"] == "fedavg" and r["lr"] == lr and r["val_accuracy"] is not None
        ]
        if not pts:
            continue
        xs, ys = zip(*sorted(pts), strict=True)
        if initial is not None:
            xs, ys = (0, *xs), (initial, *ys)
        ax.plot(xs, ys, marker="o", label=f"lr {lr:.3g}")
    if skipped:
        ax.plot([], [], " ", label=f"lr {', '.join(skipped)}: diverged, not drawn")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=1))
    ax.set_xlabel("round")
    ax.set_ylabel("pooled validation accuracy (%)")
    ax.set_title(f"{title}: does FedAvg's validation accuracy plateau over the rounds?", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def read_curves(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [
            {
                "method": r["method"],
                "lr": float(r["lr"]),
                "round": int(r["round"]),
                "val_accuracy": float(r["val_accuracy"]) if r["val_accuracy"] else None,
            }
            for r in csv.DictReader(f)
        ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("table", type=Path)
    p.add_argument("--name", required=True)
    p.add_argument("--pretrain", type=Path, default=None, help="its pretrain.json is copied too")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "fair")
    p.add_argument(
        "--replot",
        action="store_true",
        help="only redraw OUT/NAME/fedavg_curve.png from its committed curves.csv",
    )
    args = p.parse_args()
    dest = args.out / args.name
    if not args.replot:
        dest.mkdir(parents=True, exist_ok=True)
        for path in [*(args.table / n for n in FILES), *args.table.glob("eval_*.json")]:
            if path.exists():
                shutil.copy(path, dest / path.name)
        with open(dest / "curves.csv", "w", newline="") as f:
            writer = csv.DictWriter(
                f, fieldnames=["method", "lr", "round", "val_accuracy", "train_loss"]
            )
            writer.writeheader()
            writer.writerows(curves(args.table))
        if args.pretrain is not None:
            shutil.copy(args.pretrain / "pretrain.json", dest / "pretrain.json")
    plot_fedavg(
        read_curves(dest / "curves.csv"),
        None,
        dest / "fedavg_curve.png",
        args.name,
        diverged_lrs(dest),
    )
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
