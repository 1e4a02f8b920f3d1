"""Capacity: kNN-Per's accuracy when each client keeps only a fraction of its train split in its
datastore, for several alphas, the global model fixed per alpha (Fig. 3). Capacity 0 is FedAvg
(the global model alone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from experiments.context import Context
from experiments.experiment_seeds import STD
from experiments.margins import Aligned, call, interval, pp, tally
from experiments.points import GridPoint, client_fields
from experiments.report import draw, finish_axes, fit_y, pyplot, save_figure, spearman
from experiments.spec import ALPHAS, CAPACITIES, Claim, Experiment, Measured, Result, format_alpha
from experiments.views import choice_rows, fedavg_rows, summary_fields

NAME = "capacity"
SUMMARY = ("all_mean", "all_bottom_decile", "seen_mean", "unseen_mean", "unseen_clients")


def capacity_point(ctx: Context, alpha: float, capacity: float) -> dict[str, Any]:
    """kNN-Per at one capacity (0: FedAvg) on every client of run(alpha)."""
    views = ctx.views(alpha)
    if capacity == 0:
        rows = fedavg_rows(views)
    else:
        choice = ctx.knn_choice(alpha)
        rows = choice_rows(views, ctx.num_classes(alpha), choice, seed=ctx.seed, capacity=capacity)
    return {"rows": rows, **summary_fields(rows)}


def measure(ctx: Context, grids: dict[str, tuple]) -> Measured:
    grid = (
        GridPoint(
            {
                "alpha": format_alpha(alpha),
                "capacity": capacity,
                "method": "fedavg" if capacity == 0 else "knnper",
            },
            ctx.point_key(alpha, capacity=capacity),
            lambda a=alpha, c=capacity: capacity_point(ctx, a, c),
        )
        for alpha in sorted(grids["alphas"])
        for capacity in (0.0, *sorted(grids["capacities"]))
    )
    points, clients = ctx.points(NAME).collect(
        grid,
        lambda record: {k: record[k] for k in SUMMARY},
        lambda r: {**client_fields(r), **r["info"]},
    )
    return Measured(points, clients, ("alpha", "capacity", "method"), (ctx.seed,))


def summarise(m: Measured, folder: Path) -> Result:
    plot = _plot(m.points, folder / "capacity.png", m.scale)
    return Result(
        m.points,
        (*m.keys, *SUMMARY, "seconds"),
        [
            ("alpha", "alpha", ""),
            ("capacity", "capacity", ".2f"),
            ("method", "method", ""),
            ("all_mean", "mean (all)", ".2%"),
            ("all_bottom_decile", "bottom 10% (all)", ".2%"),
            ("unseen_mean", "mean (unseen)", ".2%"),
        ],
        _claims(m.points, m.clients),
        plot,
        m.clients,
        (*m.keys, *"client_id unseen n_test accuracy lambda datastore_size n_train".split()),
    )


def _curve(points: list[dict], alpha: str, key: str = "all_mean") -> dict[float, float]:
    return {p["capacity"]: p.get(key) for p in points if p["alpha"] == alpha}


def _smaller(caps: list[float]) -> float | None:
    """The largest capacity at least 3x smaller than the full datastore (the claim's factor)."""
    small = [c for c in caps if 0 < c <= 1 / 3 + 1e-9]
    return max(small) if small else None


def _claims(points: list[dict], clients: list[dict]) -> list[Claim]:
    """Each claim with its margin: 95% bootstrap intervals over clients (paired across the
    capacities of one alpha's run; alphas, drawn as separate partitions, resampled apart)."""
    alphas = list(dict.fromkeys(p["alpha"] for p in points))
    caps = {a: sorted(c for c in _curve(points, a) if c > 0) for a in alphas}
    return [*_growth_claims(points, clients, caps), _unseen_claim(clients, caps)]


def _growth_claims(
    points: list[dict], clients: list[dict], caps: dict[str, list[float]]
) -> list[Claim]:
    """Accuracy grows with capacity (per alpha), and faster for the smallest alpha than for
    the largest; `caps`: each alpha's capacities above 0, rising."""
    alphas = list(caps)
    aligned = {
        a: Aligned(clients, [{"alpha": a, "capacity": c} for c in (0.0, *caps[a])]) for a in alphas
    }

    def rise(a: str, idx: np.ndarray) -> float:
        m = aligned[a].means(idx)
        return float(m[-1] - m[1])  # largest capacity minus smallest (row 0 is FedAvg)

    calls, parts, rises = [], [], {}
    for a in alphas:
        curve = _curve(points, a)
        rho = spearman(caps[a], [curve[c] for c in caps[a]])
        iv = interval(lambda idx, a=a: rise(a, idx[0]), [aligned[a].strata])
        rises[a] = iv
        calls.append(call(iv))
        parts.append(
            f"alpha {a}: {100 * curve[caps[a][0]]:.1f}% at {caps[a][0]:g} -> "
            f"{100 * curve[caps[a][-1]]:.1f}% at {caps[a][-1]:g}, {pp(iv)}"
            + (f" (Spearman {rho:+.2f})" if rho is not None else "")
        )
    claims = [Claim("accuracy grows with capacity", "; ".join(parts), tally(calls))]
    if len(alphas) >= 2:
        first, last = alphas[0], alphas[-1]
        iv = interval(
            lambda idx: rise(first, idx[0]) - rise(last, idx[1]),
            [aligned[first].strata, aligned[last].strata],
        )
        claims.append(
            Claim(
                "it grows faster for more heterogeneous clients (smaller alpha)",
                "rise from the smallest to the largest capacity: "
                + ", ".join(f"alpha {a} {100 * rises[a]['effect']:+.1f} pp" for a in alphas)
                + f"; alpha {first} minus alpha {last}: {pp(iv)}",
                call(iv),
            )
        )
    else:
        claims.append(
            Claim(
                "it grows faster for more heterogeneous clients (smaller alpha)",
                "one alpha only",
                "not measured",
            )
        )
    return claims


def _unseen_claim(clients: list[dict], caps: dict[str, list[float]]) -> Claim:
    """Unseen clients keep most of the gain over FedAvg with a datastore 3x smaller."""
    calls, shown = [], []
    for a in caps:
        small = _smaller(caps[a])
        if small is None or 1.0 not in caps[a]:
            continue
        unseen = Aligned(
            clients,
            [{"alpha": a, "capacity": c} for c in (0.0, small, 1.0)],
            keep=lambda r: bool(r["unseen"]),
        )
        if len(unseen) < 2:
            continue

        def share(idx: list[np.ndarray], unseen: Aligned = unseen) -> float:
            m = unseen.means(idx[0])
            return float((m[1] - m[0]) / (m[2] - m[0])) if m[2] > m[0] else float("nan")

        iv = interval(share, [unseen.strata])
        calls.append(call(iv, 0.5))
        shown.append(
            f"alpha {a}: {iv['effect']:.0%} of the gain at capacity {small:g} "
            f"({1 / small:.1f}x smaller), 95% interval [{iv['low']:.0%}, "
            f"{iv['high']:.0%}] over {len(unseen)} unseen clients"
        )
    return Claim(
        "new (unseen) clients keep most (> 50%) of kNN-Per's gain over FedAvg "
        "with a datastore 3x smaller",
        "; ".join(shown) or "needs capacity 1, a capacity <= 1/3 and unseen clients",
        tally(calls),
    )


def _plot(points: list[dict], path, scale: str):
    """kNN-Per's curve over the capacities it was measured at, and FedAvg (capacity 0: no
    datastore) as a horizontal reference line in the same colour, not a point of the curve."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    shown, spread = [], []
    for a in dict.fromkeys(p["alpha"] for p in points):
        curve = _curve(points, a)
        std = _curve(points, a, "all_mean" + STD)
        caps = sorted(c for c in curve if c > 0)
        line = draw(
            ax,
            caps,
            [curve[c] for c in caps],
            "o-",
            [std[c] for c in caps],
            label=f"kNN-Per, alpha {a}",
        )
        if 0.0 in curve:
            ax.axhline(
                curve[0.0],
                color=line.get_color(),
                ls="--",
                lw=1,
                label=f"FedAvg (no datastore), alpha {a}",
            )
        shown += [curve[c] for c in curve]
        spread += [std.get(c) for c in curve]
    ax.set_xlabel("capacity (fraction of the client's train split in its datastore)", fontsize=8)
    ax.set_ylabel("mean test accuracy (%, all clients)")
    fit_y(ax, shown, spread)
    finish_axes(ax, "Claim: accuracy grows with the datastore's size, faster for smaller alpha")
    return save_figure(fig, path, scale)


EXPERIMENT = Experiment(
    NAME,
    "kNN-Per accuracy versus datastore capacity, for several alphas",
    "accuracy grows with the datastore's size, faster for more heterogeneous clients; new "
    "clients keep most of kNN-Per's benefit with a datastore reduced by a factor 3 (Sec. 6, "
    "Fig. 3).",
    (ALPHAS, CAPACITIES),
    measure,
    summarise,
    lambda g: len(g["alphas"]) * (1 + len(g["capacities"])),
)
