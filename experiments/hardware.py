"""Hardware heterogeneity (Appendix, Fig. 10): half the clients ("weak") get capacity 1/2 - dC,
the others ("strong") 1/2 + dC, so the memory of the system is fixed while its spread grows.

Two versions on the same weak/strong split (export.profiles.weak_clients, as `knnper export
--profile weak-strong` splits devices):
- fractions, the paper's setting: each client's datastore holds that fraction of its train split
  (float32 keys, server-side evaluation);
- bytes: each device's budget is the int8 encoder plus that fraction of the bytes of its own full
  float32 flat datastore; `export_run` picks each datastore to fit the budget (it may compress:
  fp16 / int8 keys hold more samples in the same bytes) and writes real bundles, whose accuracy is
  measured through the device runtime (export.evaluation.evaluate_export).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime.datastores import FlatDatastore
from edge_runtime.encoder import Encoder
from experiments.context import Context
from experiments.report import pyplot, save_figure, spearman, verdict
from experiments.spec import DELTA_C, Claim, Experiment, Grid, Result
from experiments.views import knnper_rows
from export.errors import BudgetError
from export.evaluation import evaluate_export, weighted_mean
from export.exporter import (
    EncoderFiles,
    ExportSettings,
    apply_knn_choice,
    build_encoder,
    client_embeddings,
    export_run,
)
from export.profiles import weak_clients
from export.sizing import SearchSpace, measure_nbytes

NAME = "hardware"
# ProtoNN is left out of the byte-budget search: training it per client, configuration and
# budget costs more than this whole experiment; the protonn-grid experiment measures it.
SPACE = SearchSpace(backends=("flat", "hnsw"))
QUICK_SPACE = SearchSpace(backends=("flat",))
MONOTONE = 0.8  # |Spearman| from which a curve counts as rising or falling throughout
COLUMNS = ("version", "delta_c", "all_mean", "weak_mean", "strong_mean", "clients",
           "mean_stored", "recipes", "error")


def _shares(ids: list[int], delta_c: float, seed: int) -> dict[int, float]:
    weak = weak_clients(ids, seed)
    return {cid: 0.5 - delta_c if cid in weak else 0.5 + delta_c for cid in ids}


def _group_means(rows: list[dict], weak: set[int]) -> dict[str, Any]:
    def mean(chosen: list[dict]) -> float | None:
        scored = [r for r in chosen if r["test_samples"]]
        return weighted_mean(scored) if scored else None

    return {"all_mean": mean(rows), "weak_mean": mean([r for r in rows if r["client_id"] in weak]),
            "strong_mean": mean([r for r in rows if r["client_id"] not in weak]),
            "clients": len(rows)}


def fraction_point(ctx: Context, delta_c: float) -> dict[str, Any]:
    views = ctx.views()
    ids = [v.client_id for v in views]
    rows = knnper_rows(views, ctx.num_classes(), k=ctx.k, sigma=ctx.sigma, seed=ctx.seed,
                       capacity=_shares(ids, delta_c, ctx.seed),
                       estimator=ctx.knn_choice().lambda_estimator)
    plain = [{"client_id": r["client_id"], "unseen": r["unseen"], "test_samples": r["n_test"],
              "test_accuracy": r["accuracy"], "lambda": r["info"]["lambda"],
              "stored": r["info"]["datastore_size"]} for r in rows]
    return {"rows": plain, **_group_means(plain, weak_clients(ids, ctx.seed)),
            "mean_stored": float(np.mean([r["stored"] for r in plain]))}


class ByteBudgets:
    """The encoder and each client's full float32 flat datastore bytes, measured once."""

    def __init__(self, ctx: Context, work: Path) -> None:
        self.ctx = ctx
        self.run = ctx.run()
        self.settings = apply_knn_choice(
            ExportSettings(seed=ctx.seed, space=QUICK_SPACE if ctx.quick else SPACE),
            ctx.knn_choice())
        self.work = work
        clients = self.run.clients()
        self.encoder: EncoderFiles = build_encoder(self.run, _fresh(work / "encoder"),
                                                   self.settings, clients)
        session = Encoder(self.encoder.path, intra_op_threads=1)
        num_classes = self.run.dataset.num_classes
        self.full_bytes = {}
        for c in clients:
            data = client_embeddings(session, c)
            store = FlatDatastore(num_classes, k=ctx.k, sigma=ctx.sigma).fit(data.z_train,
                                                                             data.y_train)
            self.full_bytes[c.client_id] = measure_nbytes(store)

    def point(self, delta_c: float) -> dict[str, Any]:
        ids = sorted(self.full_bytes)
        shares = _shares(ids, delta_c, self.ctx.seed)
        budgets = {cid: self.encoder.nbytes + int(math.floor(shares[cid] * self.full_bytes[cid]))
                   for cid in ids}
        bundles = _fresh(self.work / f"bundles_dc{delta_c:g}")
        try:
            export_run(self.run, bundles, budgets, self.settings, encoder=self.encoder,
                       progress=self.ctx.progress)
        except BudgetError as err:
            return {"rows": [], "error": str(err), "clients": 0}
        rows = [{k: r[k] for k in ("client_id", "unseen", "budget", "recipe", "stored",
                                   "total_bytes", "lambda", "test_accuracy", "test_samples")}
                for r in evaluate_export(self.run, bundles)]
        shutil.rmtree(bundles)
        return {"rows": rows, **_group_means(rows, weak_clients(ids, self.ctx.seed)),
                "mean_stored": float(np.mean([r["stored"] for r in rows])),
                "recipes": _recipe_counts(rows), "encoder_bytes": self.encoder.nbytes}


def _recipe_counts(rows: list[dict]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        shape = ":".join(t for t in r["recipe"].split(":") if not (t[:1] == "n" and
                                                                  t[1:].isdigit()))
        counts[shape] = counts.get(shape, 0) + 1
    return "; ".join(f"{name} x{n}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def run(ctx: Context, grids: dict[str, tuple]) -> Result:
    store = ctx.points(NAME)
    space = QUICK_SPACE if ctx.quick else SPACE
    budgets: ByteBudgets | None = None

    def bytes_point(delta_c: float) -> dict[str, Any]:
        nonlocal budgets
        budgets = budgets or ByteBudgets(ctx, ctx.out / NAME / "work")
        return budgets.point(delta_c)

    points, clients = [], []
    for version in ("fractions", "bytes"):
        for dc in sorted(grids["delta_cs"]):
            extra = {"space": space.__dict__} if version == "bytes" else {}
            record = store.compute(ctx.point_key(version=version, delta_c=dc, **extra),
                                   (lambda d=dc: fraction_point(ctx, d)) if version == "fractions"
                                   else (lambda d=dc: bytes_point(d)))
            points.append({"version": version, "delta_c": dc,
                           **{k: record.get(k) for k in COLUMNS[2:]},
                           "seconds": record["seconds"]})
            clients += [{"version": version, "delta_c": dc, **r} for r in record["rows"]]
    plot = _plot(points, ctx.out / NAME / "hardware.png")
    notes = ["Weak and strong clients: a seeded half of all clients (seen and unseen), the same "
             "half in both versions. Byte budgets: the int8 encoder plus (1/2 -+ dC) x the bytes "
             "of the client's own full float32 flat datastore; the exporter searched "
             f"{', '.join(space.backends)} datastores (ProtoNN left out for time)."]
    return Result(points, (*COLUMNS, "seconds"),
                  [("version", "version", ""), ("delta_c", "dC", ".2f"),
                   ("all_mean", "mean (all)", ".4f"), ("weak_mean", "weak", ".4f"),
                   ("strong_mean", "strong", ".4f"), ("mean_stored", "mean stored", ".1f"),
                   ("recipes", "datastores chosen", "")],
                  _claims(points), plot, clients,
                  ("version", "delta_c", "client_id", "unseen", "budget", "recipe", "stored",
                   "total_bytes", "lambda", "test_accuracy", "test_samples"), notes)


def _claims(points: list[dict]) -> list[Claim]:
    claims = []
    for version in ("fractions", "bytes"):
        curve = {p["delta_c"]: p for p in points if p["version"] == version
                 and p["all_mean"] is not None}
        dcs = sorted(curve)
        if len(dcs) < 2:
            claims.append(Claim(f"average accuracy falls as dC grows ({version})",
                                "fewer than two dC values measured", "not measured"))
            continue
        lo, hi = curve[dcs[0]], curve[dcs[-1]]
        rho = spearman(dcs, [curve[d]["all_mean"] for d in dcs])
        lower = hi["all_mean"] < lo["all_mean"]
        steady = rho is None or rho <= -MONOTONE  # a falling curve, not just a lower end
        claims.append(Claim(
            f"average accuracy falls as dC grows ({version})",
            f"{100 * lo['all_mean']:.1f}% at dC {dcs[0]:g} -> {100 * hi['all_mean']:.1f}% at "
            f"dC {dcs[-1]:g}" + (f" (Spearman {rho:+.2f})" if rho is not None else ""),
            ("agree" if steady else "partly") if lower else "disagree"))
        if None not in (lo["weak_mean"], hi["weak_mean"], lo["strong_mean"], hi["strong_mean"]):
            loss = lo["weak_mean"] - hi["weak_mean"]
            gain = hi["strong_mean"] - lo["strong_mean"]
            claims.append(Claim(
                f"strong clients gain less than weak ones lose ({version})",
                f"weak {100 * -loss:+.1f} pp, strong {100 * gain:+.1f} pp from dC {dcs[0]:g} "
                f"to {dcs[-1]:g}", verdict(int(gain < loss), 1)))
    return claims


def _plot(points: list[dict], path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for version, color in (("fractions", "tab:blue"), ("bytes", "tab:orange")):
        pts = sorted((p["delta_c"], p) for p in points if p["version"] == version
                     and p["all_mean"] is not None)
        if not pts:
            continue
        x = [d for d, _ in pts]
        ax.plot(x, [p["all_mean"] for _, p in pts], "o-", color=color, label=f"{version}: all")
        ax.plot(x, [p["weak_mean"] for _, p in pts], "v:", color=color, alpha=0.6,
                label=f"{version}: weak")
        ax.plot(x, [p["strong_mean"] for _, p in pts], "^:", color=color, alpha=0.6,
                label=f"{version}: strong")
    ax.set_xlabel("dC (weak clients hold 1/2 - dC, strong 1/2 + dC)")
    ax.set_ylabel("kNN-Per mean test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


EXPERIMENT = Experiment(
    NAME, "average accuracy versus hardware heterogeneity dC (datastore fractions and real "
    "byte budgets through export and the device runtime)",
    "with the system's memory fixed, spreading it unevenly (weak clients 1/2 - dC, strong "
    "1/2 + dC) lowers the average accuracy: the marginal gain of memory decreases, so strong "
    "clients gain less than weak ones lose (Appendix, Fig. 10).",
    (Grid("delta_cs", DELTA_C, (0.0, 0.1, 0.2, 0.3, 0.4), (0.0, 0.3),
          "capacity spreads dC in [0, 0.5)"),),
    run)
