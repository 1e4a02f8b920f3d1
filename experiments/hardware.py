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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime.datastores import BACKENDS, EXACT_BACKEND, FlatDatastore
from edge_runtime.encoder import Encoder
from experiments.benchmark_support import fresh_dir, recipe_counts
from experiments.context import Context
from experiments.experiment_seeds import STD
from experiments.margins import Aligned, call, interval, paired, pp, unit
from experiments.points import GridPoint
from experiments.report import draw, finish_axes, fit_y, pyplot, save_figure, spearman
from experiments.spec import DELTA_C, Claim, Experiment, Grid, Measured, Result
from experiments.views import choice_rows
from export.errors import BudgetInvalid
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
SPACE = SearchSpace(backends=tuple(name for name, cls in BACKENDS.items() if not cls.TRAINED))
QUICK_SPACE = SearchSpace(backends=(EXACT_BACKEND,))
MONOTONE = 0.8  # |Spearman| from which a curve counts as rising or falling throughout
COLUMNS = "version delta_c all_mean weak_mean strong_mean clients mean_stored recipes error".split()
# each client's columns in clients.csv, after its version and delta_c
CLIENT_COLUMNS = (
    "client_id unseen budget recipe stored total_bytes lambda test_accuracy test_samples".split()
)


def _shares(ids: list[int], delta_c: float, seed: int) -> dict[int, float]:
    weak = weak_clients(ids, seed)
    return {cid: 0.5 - delta_c if cid in weak else 0.5 + delta_c for cid in ids}


def _group_means(rows: list[dict], weak: set[int]) -> dict[str, Any]:
    def mean(chosen: list[dict]) -> float | None:
        scored = [r for r in chosen if r["test_samples"]]
        return weighted_mean(scored) if scored else None

    return {
        "all_mean": mean(rows),
        "weak_mean": mean([r for r in rows if r["client_id"] in weak]),
        "strong_mean": mean([r for r in rows if r["client_id"] not in weak]),
        "clients": len(rows),
    }


def fraction_point(ctx: Context, delta_c: float) -> dict[str, Any]:
    views = ctx.views()
    ids = [v.client_id for v in views]
    rows = choice_rows(
        views,
        ctx.num_classes(),
        ctx.knn_choice(),
        seed=ctx.seed,
        capacity=_shares(ids, delta_c, ctx.seed),
    )
    plain = [
        {
            "client_id": r["client_id"],
            "unseen": r["unseen"],
            "test_samples": r["n_test"],
            "test_accuracy": r["accuracy"],
            "lambda": r["info"]["lambda"],
            "stored": r["info"]["datastore_size"],
        }
        for r in rows
    ]
    return {
        "rows": plain,
        **_group_means(plain, weak_clients(ids, ctx.seed)),
        "mean_stored": float(np.mean([r["stored"] for r in plain])),
    }


class ByteBudgets:
    """The encoder and each client's full float32 flat datastore bytes, measured once."""

    def __init__(self, ctx: Context, work: Path) -> None:
        self.ctx = ctx
        self.run = ctx.run()
        self.settings = apply_knn_choice(
            ExportSettings(seed=ctx.seed, space=QUICK_SPACE if ctx.quick else SPACE),
            ctx.knn_choice(),
        )
        self.work = work
        clients = self.run.clients()
        self.encoder: EncoderFiles = build_encoder(
            self.run, fresh_dir(work / "encoder"), self.settings, clients
        )
        session = Encoder(self.encoder.path, intra_op_threads=1)
        num_classes = self.run.dataset.num_classes
        self.full_bytes = {}
        for c in clients:
            data = client_embeddings(session, c)
            store = FlatDatastore(num_classes, k=ctx.k, sigma=ctx.sigma).fit(
                data.z_train, data.y_train
            )
            self.full_bytes[c.client_id] = measure_nbytes(store)

    def point(self, delta_c: float) -> dict[str, Any]:
        ids = sorted(self.full_bytes)
        shares = _shares(ids, delta_c, self.ctx.seed)
        budgets = {
            cid: self.encoder.nbytes + int(math.floor(shares[cid] * self.full_bytes[cid]))
            for cid in ids
        }
        bundles = fresh_dir(self.work / f"bundles_dc{delta_c:g}")
        try:
            export_run(
                self.run,
                bundles,
                budgets,
                self.settings,
                encoder=self.encoder,
                progress=self.ctx.progress,
            )
        except BudgetInvalid as err:
            return {"rows": [], "error": str(err), "clients": 0}
        rows = [{k: r[k] for k in CLIENT_COLUMNS} for r in evaluate_export(self.run, bundles)]
        shutil.rmtree(bundles)
        return {
            "rows": rows,
            **_group_means(rows, weak_clients(ids, self.ctx.seed)),
            "mean_stored": float(np.mean([r["stored"] for r in rows])),
            "recipes": recipe_counts(rows),
            "encoder_bytes": self.encoder.nbytes,
        }


def measure(ctx: Context, grids: dict[str, tuple]) -> Measured:
    space = QUICK_SPACE if ctx.quick else SPACE
    budgets: ByteBudgets | None = None

    def bytes_point(delta_c: float) -> dict[str, Any]:
        nonlocal budgets
        budgets = budgets or ByteBudgets(ctx, ctx.out / NAME / "work")
        return budgets.point(delta_c)

    grid = (
        GridPoint(
            {"version": version, "delta_c": dc},
            ctx.point_key(
                version=version,
                delta_c=dc,
                **({"space": space.__dict__} if version == "bytes" else {}),
            ),
            (lambda d=dc: fraction_point(ctx, d))
            if version == "fractions"
            else (lambda d=dc: bytes_point(d)),
        )
        for version in ("fractions", "bytes")
        for dc in sorted(grids["delta_cs"])
    )
    points, clients = ctx.points(NAME).collect(
        grid, lambda record: {k: record.get(k) for k in COLUMNS[2:]}
    )
    return Measured(
        points, clients, ("version", "delta_c"), (ctx.seed,), [{"backends": list(space.backends)}]
    )


def summarise(m: Measured, folder: Path) -> Result:
    plot = _plot(m.points, folder / "hardware.png", m.scale)
    notes = [
        "Weak and strong clients: a seeded half of all clients (seen and unseen), the same "
        "half in both versions. Byte budgets: the int8 encoder plus (1/2 -+ dC) x the bytes "
        "of the client's own full float32 flat datastore; the exporter searched "
        f"{', '.join(m.facts[0]['backends'])} datastores (ProtoNN left out for time)."
    ]
    return Result(
        m.points,
        (*COLUMNS, "seconds"),
        [
            ("version", "version", ""),
            ("delta_c", "dC", ".2f"),
            ("all_mean", "mean (all)", ".2%"),
            ("weak_mean", "weak", ".2%"),
            ("strong_mean", "strong", ".2%"),
            ("mean_stored", "mean stored", ".1f"),
            ("recipes", "datastores chosen", ""),
        ],
        _claims(m.points, m.clients, weak_of(m.clients, m.seeds)),
        plot,
        m.clients,
        ("version", "delta_c", *CLIENT_COLUMNS),
        notes,
    )


def _ids(clients: list[dict]) -> list[int]:
    """Every client id, in the order the points split them into weak and strong."""
    return sorted({int(c["client_id"]) for c in clients})


def weak_of(clients: list[dict], seeds: Sequence[int]) -> set:
    """The weak half, as each seed split its own clients: client ids for one seed's rows,
    (seed, client id) pairs for rows of several seeds combined."""
    if not clients or "seed" not in clients[0]:
        return weak_clients(_ids(clients), seeds[0])
    return {
        (s, cid)
        for s in seeds
        for cid in weak_clients(_ids([c for c in clients if c["seed"] == s]), s)
    }


def _weak(row: dict, weak: set) -> bool:
    return (unit(row) if "seed" in row else int(row["client_id"])) in weak


def _claims(points: list[dict], clients: list[dict], weak: set) -> list[Claim]:
    """Each claim with its margin: 95% bootstrap intervals over clients, paired between the
    smallest and largest dC (the same clients, the same weak half; `weak` as weak_of gives it)."""
    claims = []
    for version in ("fractions", "bytes"):
        curve = {
            p["delta_c"]: p for p in points if p["version"] == version and p["all_mean"] is not None
        }
        dcs = sorted(curve)
        if len(dcs) < 2:
            claims.append(
                Claim(
                    f"average accuracy falls as dC grows ({version})",
                    "fewer than two dC values measured",
                    "not measured",
                )
            )
            continue
        ends = [{"version": version, "delta_c": dcs[0]}, {"version": version, "delta_c": dcs[-1]}]
        rows = {
            name: Aligned(clients, ends, "test_accuracy", "test_samples", keep=keep)
            for name, keep in (
                ("all", lambda r: True),
                ("weak", lambda r: _weak(r, weak)),
                ("strong", lambda r: not _weak(r, weak)),
            )
        }
        rho = spearman(dcs, [curve[d]["all_mean"] for d in dcs])
        drop = paired(rows["all"], 0, 1)
        falls = call(drop)
        if falls == "agree" and rho is not None and rho > -MONOTONE:
            falls = "partly"  # lower at the end, but not a falling curve
        claims.append(
            Claim(
                f"average accuracy falls as dC grows ({version})",
                f"{100 * curve[dcs[0]]['all_mean']:.1f}% at dC {dcs[0]:g} -> "
                f"{100 * curve[dcs[-1]]['all_mean']:.1f}% at dC {dcs[-1]:g}, drop {pp(drop)}"
                + (f" (Spearman {rho:+.2f})" if rho is not None else ""),
                falls,
            )
        )
        if len(rows["weak"]) < 2 or len(rows["strong"]) < 2:
            continue
        loss, gain = paired(rows["weak"], 0, 1), paired(rows["strong"], 1, 0)

        def excess_of(
            idx: list[np.ndarray], w: Aligned = rows["weak"], s: Aligned = rows["strong"]
        ) -> float:
            wm, sm = w.means(idx[0]), s.means(idx[1])
            return float((wm[0] - wm[1]) - (sm[1] - sm[0]))

        excess = interval(excess_of, [rows["weak"].strata, rows["strong"].strata])
        # the claim is diminishing returns: weak clients lose, strong ones gain, and less
        if call(gain) == "disagree" or call(excess) == "disagree":
            verdict = "disagree"
        elif call(loss) == call(gain) == call(excess) == "agree":
            verdict = "agree"
        else:
            verdict = "inconclusive"
        claims.append(
            Claim(
                f"strong clients gain less than weak ones lose ({version})",
                f"from dC {dcs[0]:g} to {dcs[-1]:g}: weak clients lose {pp(loss)}, strong ones "
                f"gain {pp(gain)}; loss minus gain {pp(excess)}",
                verdict,
            )
        )
    return claims


VERSION_WORDS = {
    "fractions": "memory as datastore fractions",
    "bytes": "memory as byte budgets (bundles written)",
}


def _plot(points: list[dict], path, scale: str):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.4))  # room for the axes beside a legend of six
    shown, spread = [], []
    for version, color in (("fractions", "tab:blue"), ("bytes", "tab:orange")):
        pts = sorted(
            (p["delta_c"], p)
            for p in points
            if p["version"] == version and p["all_mean"] is not None
        )
        if not pts:
            continue
        x = [d for d, _ in pts]
        draw(
            ax,
            x,
            [p["all_mean"] for _, p in pts],
            "o-",
            [p.get("all_mean" + STD) for _, p in pts],
            color=color,
            label=f"{VERSION_WORDS[version]}: all clients",
        )
        for group, style in (("weak", "v:"), ("strong", "^:")):
            ax.plot(
                x,
                [p[f"{group}_mean"] for _, p in pts],
                style,
                color=color,
                alpha=0.6,
                label=f"{VERSION_WORDS[version]}: {group} clients",
            )
        for _, p in pts:
            shown += [p["all_mean"], p["weak_mean"], p["strong_mean"]]
            spread += [p.get("all_mean" + STD), None, None]
    ax.set_xlabel("dC (weak clients hold 1/2 - dC, strong 1/2 + dC)")
    ax.set_ylabel("kNN-Per mean test accuracy (%)")
    fit_y(ax, shown, spread)
    finish_axes(
        ax, "Claim: with total memory fixed, spreading it unevenly (larger dC) lowers accuracy"
    )
    return save_figure(fig, path, scale)


EXPERIMENT = Experiment(
    NAME,
    "average accuracy versus hardware heterogeneity dC (datastore fractions and real "
    "byte budgets through export and the device runtime)",
    "with the system's memory fixed, spreading it unevenly (weak clients 1/2 - dC, strong "
    "1/2 + dC) lowers the average accuracy: the marginal gain of memory decreases, so strong "
    "clients gain less than weak ones lose (Appendix, Fig. 10).",
    (
        Grid(
            "delta_cs",
            DELTA_C,
            (0.0, 0.1, 0.2, 0.3, 0.4),
            (0.0, 0.3),
            "capacity spreads dC in [0, 0.5)",
        ),
    ),
    measure,
    summarise,
    lambda g: 2 * len(g["delta_cs"]),
)  # fractions and bytes
