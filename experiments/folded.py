"""The two experiments that existed as benchmark scripts before this family, run through their
own code so they measure exactly what they measured: benchmarks/distribution_shift.py (on-device
datastore updates under a label shift) and the ProtoNN grid of benchmarks/export_budget_curve.py
(projection dimension x prototype fraction). Both use the family's shared global model."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime.encoder import Encoder
from experiments.benchmark_scripts import benchmark_module
from experiments.context import Context
from experiments.spec import DIMENSION, FRACTION, Claim, Experiment, Grid, Result
from export.evaluation import reference_accuracy, weighted_mean
from export.exporter import ExportSettings, apply_knn_choice, build_encoder
from export.sizing import SearchSpace

SHIFT = "distribution-shift"
GRID = "protonn-grid"
# benchmarks/distribution_shift.py's settings: its defaults, and its --smoke sizes for --quick.
SHIFT_FULL = {"clients": 10, "seeds": 3, "steps": 30, "shift_at": 10, "batch": 20}
SHIFT_QUICK = {"clients": 2, "seeds": 1, "steps": 4, "shift_at": 2, "batch": 8}
PROTONN_STEPS_QUICK = 30


def _shift_curve(ctx: Context, settings: dict[str, int], out: Path) -> dict[str, Any]:
    script = benchmark_module("distribution_shift")
    argv = ["--run", str(ctx.run_dir()), "--out", str(out), "--threads", "1"]
    for name, value in settings.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    if script.main(argv) != 0:
        raise RuntimeError("benchmarks/distribution_shift.py failed")
    with open(out / "curve.csv", newline="") as f:
        curve = [{**r, "step": int(r["step"]), "n": int(r["n"]),
                  **{k: float(r[k]) for k in ("mean_accuracy", "sem", "mean_datastore_size")}}
                 for r in csv.DictReader(f)]
    return {"curve": curve, "argv": argv}


def run_shift(ctx: Context, grids: dict[str, tuple]) -> Result:
    settings = SHIFT_QUICK if ctx.quick else SHIFT_FULL
    out = ctx.out / SHIFT
    ctx.run()  # the shared global model, trained if this folder has none yet
    record = ctx.points(SHIFT).compute(ctx.point_key(**settings),
                                       lambda: _shift_curve(ctx, settings, out))
    points = [{k: r[k] for k in ("step", "strategy", "mean_accuracy", "sem", "n",
                                 "mean_datastore_size")} | {"seconds": record["seconds"]}
              for r in record["curve"]]
    notes = [f"benchmarks/distribution_shift.py ran as `{' '.join(record['argv'])}`; its own "
             "files (steps.csv: every client, step and strategy; curve.csv; clients.csv; "
             "shift.md) are in this folder."]
    return Result(points, ("step", "strategy", "mean_accuracy", "sem", "n",
                           "mean_datastore_size", "seconds"),
                  [("step", "step", ""), ("strategy", "strategy", ""),
                   ("mean_accuracy", "accuracy", ".3f"), ("mean_datastore_size", "stored", ".0f")],
                  _shift_claims(points, settings), out / "shift.png", notes=notes)


def _shift_claims(points: list[dict], s: dict[str, int]) -> list[Claim]:
    window = max(1, (s["steps"] - s["shift_at"]) // 3)

    def mean(strategy: str, steps: range) -> float:
        return float(np.mean([p["mean_accuracy"] for p in points
                              if p["strategy"] == strategy and p["step"] in steps]))

    before = range(0, s["shift_at"])
    first = range(s["shift_at"], s["shift_at"] + window)
    last = range(s["steps"] - window, s["steps"])
    fixed = (mean("fixed", before), mean("fixed", last))
    fifo = (mean("fifo", first), mean("fifo", last))
    concat = (mean("concatenate", before), mean("concatenate", last))
    return [
        Claim("a fixed datastore loses accuracy at the shift and does not recover",
              f"fixed: {fixed[0]:.3f} before, {fixed[1]:.3f} over the last {window} steps",
              "agree" if fixed[1] < fixed[0] else "disagree"),
        Claim("FIFO drops at the shift, then recovers as new samples replace old ones",
              f"fifo: {fifo[0]:.3f} over the first {window} steps after, {fifo[1]:.3f} over the "
              f"last {window}", "agree" if fifo[1] > fifo[0] else "disagree"),
        Claim("concatenate gains before the shift (a growing datastore)",
              f"before the shift: concatenate {concat[0]:.3f}, fixed {fixed[0]:.3f}",
              "agree" if concat[0] > fixed[0] else "disagree"),
        Claim("after the shift concatenate recovers more slowly than FIFO",
              f"last {window} steps: concatenate {concat[1]:.3f}, fifo {fifo[1]:.3f}",
              "agree" if concat[1] < fifo[1] else "disagree"),
    ]


class _ProtoNNCases:
    """The int8 encoder and every client's embeddings (the benchmark's ClientCase), built on
    first use: a rerun whose points are all cached builds nothing."""

    def __init__(self, ctx: Context) -> None:
        bench = benchmark_module("export_budget_curve")
        run = ctx.run()
        clients = [c for c in run.clients() if c.num_train > 0]
        work = ctx.out / GRID / "work"
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        settings = apply_knn_choice(ExportSettings(seed=ctx.seed), ctx.knn_choice())
        self.encoder = build_encoder(run, work, settings, run.clients())
        session = Encoder(self.encoder.path, intra_op_threads=1)
        self.cases = [bench.ClientCase(session, c, run.dataset.num_classes, ctx.k, ctx.sigma)
                      for c in clients]
        self.clients = clients
        self.num_classes = run.dataset.num_classes


def run_grid(ctx: Context, grids: dict[str, tuple]) -> Result:
    bench = benchmark_module("export_budget_curve")
    steps = PROTONN_STEPS_QUICK if ctx.quick else SearchSpace.protonn_steps
    store = ctx.points(GRID)
    cases: _ProtoNNCases | None = None

    def built() -> _ProtoNNCases:
        nonlocal cases
        cases = cases or _ProtoNNCases(ctx)
        return cases

    def reference() -> dict[str, Any]:
        c = built()
        return {"mean_accuracy": weighted_mean(reference_accuracy(
            c.encoder.path, c.clients, num_classes=c.num_classes, k=ctx.k, sigma=ctx.sigma))}

    full = store.compute(ctx.point_key(reference="flat:fp32"), reference)["mean_accuracy"]
    points = []
    for d in sorted(grids["dims"]):
        for m in sorted(grids["prototype_fractions"]):
            record = store.compute(
                ctx.point_key(projection_dim=d, prototype_fraction=m, steps=steps),
                lambda d=d, m=m: bench.protonn_grid(built().cases, [d], [m], built().num_classes,
                                                    steps, ctx.k, ctx.sigma, ctx.seed)[0])
            points.append({**{k: record[k] for k in ("projection_dim", "prototype_fraction",
                                                      "mean_accuracy", "bytes_ratio")},
                           "drop_pp": 100 * (full - record["mean_accuracy"]),
                           "seconds": record["seconds"]})
    plot = ctx.out / GRID / "protonn_grid.png"
    bench.plot_grid(points, full, plot)
    return Result(points, ("projection_dim", "prototype_fraction", "mean_accuracy", "bytes_ratio",
                           "drop_pp", "seconds"),
                  [("projection_dim", "d", ""), ("prototype_fraction", "m", "g"),
                   ("mean_accuracy", "mean acc", ".4f"), ("bytes_ratio", "bytes / full", ".3f"),
                   ("drop_pp", "drop (pp)", "+.2f")],
                  _grid_claims(points, full), plot,
                  notes=[f"Full float32 flat datastore (the reference): {full:.4f}. ProtoNN "
                         f"trained {steps} steps per client and point with the int8 encoder's "
                         "embeddings (benchmarks/export_budget_curve.py's protonn_grid)."])


def _grid_claims(points: list[dict], full: float) -> list[Claim]:
    small = [p for p in points if p["bytes_ratio"] <= 0.25]
    if not small:
        return [Claim("ProtoNN cuts the datastore's memory 4x for a limited accuracy cost "
                      "(CIFAR-10: 82.3% vs 83.0%)", "no grid point at 1/4 of the bytes or less",
                      "not measured")]
    best = max(small, key=lambda p: p["mean_accuracy"])
    return [Claim("ProtoNN cuts the datastore's memory 4x for a limited accuracy cost "
                  "(CIFAR-10: 82.3% vs 83.0%, -0.7 pp)",
                  f"best point at <= 1/4 of the bytes: d {best['projection_dim']}, m "
                  f"{best['prototype_fraction']:g}: {100 * best['mean_accuracy']:.1f}% vs "
                  f"{100 * full:.1f}% ({-best['drop_pp']:+.1f} pp) at "
                  f"{best['bytes_ratio']:.2f} of the bytes",
                  "agree" if best["drop_pp"] <= 1.0 else "disagree")]


SHIFT_EXPERIMENT = Experiment(
    SHIFT, "on-device datastore updates (fifo, concatenate, fixed) under a label shift "
    "(benchmarks/distribution_shift.py)",
    "with a fixed datastore accuracy drops at the shift; FIFO drops then recovers as new samples "
    "replace old ones; concatenate gains before the shift and recovers more slowly than FIFO "
    "after it (Sec. 6, Fig. 6; Appendix Fig. 14).",
    (), run_shift)

GRID_EXPERIMENT = Experiment(
    GRID, "ProtoNN-compressed datastores over projection dimension x prototype fraction "
    "(benchmarks/export_budget_curve.py's grid)",
    "ProtoNN reduces kNN-Per's memory footprint by a factor four for a limited accuracy cost on "
    "CIFAR-10 (82.3% versus 83.0%; on CIFAR-100 it loses 3 pp for a 20% saving) (Appendix, "
    "Fig. 11).",
    (Grid("dims", DIMENSION, (8, 16, 32, 64), (8, 16), "ProtoNN projection dimensions"),
     Grid("prototype_fractions", FRACTION, (0.05, 0.1, 0.2, 0.3, 0.5), (0.1, 0.3),
          "prototypes as fractions of each client's train split")),
    run_grid)
