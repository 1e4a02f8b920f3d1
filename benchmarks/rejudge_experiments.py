"""Judge the committed experiment results again with the current claim rules and plots, from
their own files (points.csv, clients.csv, steps.csv), without retraining anything: rewrites each
summary.md's claim table (and the distribution shift's compute time, once per record) and
redraws each plot.

    python benchmarks/rejudge_experiments.py benchmarks/results/experiments/fashion-mnist

A multi-seed folder (`knnper experiment NAME --seeds N`) is judged as the command judged it: the
combined rows (a `seed` column) in NAME/, and each seed's own in NAME/seed_S/.

An experiment whose files lack what a rule needs (the ProtoNN grid's validation accuracy, the
base-model's per-client FedAvg accuracy, both recorded only by runs after this script) gets
"not measured" claims until it is rerun with `knnper experiment`.
"""

from __future__ import annotations

import argparse
import re
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments import (  # noqa: E402
    base_model,
    capacity,
    device_experiments,
    distribution_shift,
    hardware,
    heterogeneity,
    k_sigma,
    lambda_vs_n,
    protonn_grid,
)
from experiments.benchmark_support import read_csv  # noqa: E402
from experiments.report import claims_table  # noqa: E402
from experiments.spec import Claim  # noqa: E402

# columns that are labels, kept as written (alpha "0.1", "iid"; version "bytes")
LABELS = {"alpha", "method", "version", "strategy", "recipe", "recipes"}
# the scale every committed experiment ran with (BENCHMARKS.md): k = 10, sigma = 1, seed 0
K, SIGMA, SEED = 10, 1.0, 0


def read(path: Path) -> list[dict[str, Any]]:
    return read_csv(path, LABELS) if path.exists() else []


def seed_folders(folder: Path) -> list[Path]:
    return sorted(d for d in folder.glob("seed_*") if (d / "summary.md").exists())


def shift_steps(folder: Path) -> tuple[list[dict[str, Any]], int]:
    """The streams behind a shift summary, and how many seeds ran them: a combined folder's
    come from its seed_S/ folders, a stream being (seed, stream seed, client)."""
    if (folder / "steps.csv").exists():
        return device_experiments.read_steps(folder), 1
    seeds = seed_folders(folder)
    return [
        {**r, "seed": (d.name, r["seed"])} for d in seeds for r in device_experiments.read_steps(d)
    ], len(seeds)


def figure_scale(folder: Path) -> str:
    """The data set and scale for a redrawn figure's title: the report's "Scale:" line up to
    its first ';', less its parentheses (the folder's data set when there is none)."""
    summary = folder / "summary.md"
    lines = summary.read_text().splitlines() if summary.exists() else []
    line = next((x for x in lines if x.startswith("Scale: ")), None)
    if line is None:
        return folder.parent.name
    return re.sub(r" \([^()]*\)", "", line.removeprefix("Scale: ").split(";")[0])


def judge(name: str, folder: Path) -> list[Claim]:
    """The experiment's claims from its files, and its plot redrawn."""
    points, clients = read(folder / "points.csv"), read(folder / "clients.csv")
    seeds = sorted({c["seed"] for c in clients}) if clients and "seed" in clients[0] else [SEED]
    scale = figure_scale(folder)
    if name == "heterogeneity":
        heterogeneity._plot(points, folder / "heterogeneity.png", scale)
        return heterogeneity._claims(points, clients)
    if name == "capacity":
        capacity._plot(points, folder / "capacity.png", scale)
        return capacity._claims(points, clients)
    if name == "k-sigma":
        k_sigma._plot(points, folder / "k_sigma.png", scale)
        return k_sigma._claims(points, clients, K, SIGMA)
    if name == "lambda-vs-n":
        n = np.array([c["datastore_size"] for c in clients], dtype=float)
        lam = np.array([c["lambda"] for c in clients], dtype=float)
        fit = lambda_vs_n.step_fit(n, lam)
        lambda_vs_n._plot(n, lam, fit, folder / "lambda_vs_n.png", scale)
        return lambda_vs_n._claims(clients, fit)
    if name == "hardware":
        hardware._plot(points, folder / "hardware.png", scale)
        return hardware._claims(points, clients, hardware.weak_of(clients, seeds))
    if name == "base-model":
        base_model._plot(points, folder / "base_model.png", scale)
        return base_model._claims(points, clients)
    if name == device_experiments.SHIFT:
        shift = distribution_shift
        settings = device_experiments.SHIFT_FULL
        steps, runs = shift_steps(folder)
        args = Namespace(shift="dirichlet", **{**settings, "seeds": settings["seeds"] * runs})
        dataset = "cifar10" if "cifar10" in str(folder) else "fashion-mnist"
        if runs > 1:
            weights = f"means over {runs} seeds, each on its own global model"
        else:
            run = re.search(r"--run (\S+)", (folder / "shift.md").read_text())
            weights = f"global model: run {run.group(1) if run else '(see shift.md)'}"
        shift.plot(points, args, folder / "shift.png", weights, dataset)
        return device_experiments.shift_claims(steps, settings)
    if name == device_experiments.GRID:
        full = float(np.mean([p["mean_accuracy"] + p["drop_pp"] / 100 for p in points]))
        protonn_grid.plot_grid(
            points,
            full,
            folder / "protonn_grid.png",
            scale=scale,
            cost_pp=device_experiments.COST_PP,
        )
        if not points or points[0].get("val_accuracy") is None:
            return [
                Claim(
                    "ProtoNN cuts the datastore's memory 4x for a limited accuracy cost "
                    f"(<= {device_experiments.COST_PP:g} pp)",
                    "this run recorded no validation accuracy per point, so no point can "
                    "be chosen without test data; rerun `knnper experiment protonn-grid`",
                    "not measured",
                )
            ]
        return device_experiments.grid_claims(points, clients, full)
    raise SystemExit(f"{folder}: unknown experiment {name!r}")


def rewrite(summary: Path, claims: list[Claim], compute_seconds: float | None) -> None:
    text = summary.read_text()
    start = text.index("| the paper | we measured | verdict |")
    end = text.index("\n\n", start)
    text = text[:start] + "\n".join(claims_table(claims)) + text[end:]
    if compute_seconds is not None:
        text = re.sub(
            r"(model trained by another experiment is not counted\): )\d+ s\.",
            rf"\g<1>{compute_seconds:.0f} s.",
            text,
        )
    summary.write_text(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "folders", type=Path, nargs="+", help="experiment result folders, or a folder holding them"
    )
    args = p.parse_args()
    folders = []
    for f in args.folders:
        folders += (
            [f]
            if (f / "summary.md").exists()
            else sorted(d for d in f.iterdir() if (d / "summary.md").exists())
        )
    folders = [g for f in folders for g in (f, *seed_folders(f))]
    for folder in folders:
        name = folder.parent.name if folder.name.startswith("seed_") else folder.name
        claims = judge(name, folder)
        seconds = None
        if name == device_experiments.SHIFT:  # one record behind every point: counted once
            seconds = read(folder / "points.csv")[0].get("seconds")
        rewrite(folder / "summary.md", claims, seconds)
        print(f"{folder}: " + ", ".join(c.verdict for c in claims))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
