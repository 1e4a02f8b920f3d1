"""Capacity: kNN-Per's accuracy when each client keeps only a fraction of its train split in its
datastore, for several alphas, the global model fixed per alpha (Fig. 3). Capacity 0 is FedAvg
(the global model alone)."""

from __future__ import annotations

from typing import Any

from experiments.context import Context
from experiments.report import pyplot, save_figure, spearman, verdict
from experiments.spec import ALPHA, FRACTION, Claim, Experiment, Grid, Result, format_alpha
from experiments.views import fedavg_rows, knnper_rows, summary_fields

NAME = "capacity"
SUMMARY = ("all_mean", "all_bottom_decile", "seen_mean", "unseen_mean", "unseen_clients")


def capacity_point(ctx: Context, alpha: float, capacity: float) -> dict[str, Any]:
    """kNN-Per at one capacity (0: FedAvg) on every client of run(alpha)."""
    views = ctx.views(alpha)
    if capacity == 0:
        rows = fedavg_rows(views)
    else:
        choice = ctx.knn_choice(alpha)
        rows = knnper_rows(views, ctx.num_classes(alpha), k=choice.config.k,
                           sigma=choice.config.sigma, seed=ctx.seed, capacity=capacity,
                           estimator=choice.lambda_estimator)
    return {"rows": rows, **summary_fields(rows)}


def run(ctx: Context, grids: dict[str, tuple]) -> Result:
    store = ctx.points(NAME)
    points, clients = [], []
    for alpha in sorted(grids["alphas"]):
        for capacity in (0.0, *sorted(grids["capacities"])):
            record = store.compute(ctx.point_key(alpha, capacity=capacity),
                                   lambda a=alpha, c=capacity: capacity_point(ctx, a, c))
            label = {"alpha": format_alpha(alpha), "capacity": capacity,
                     "method": "fedavg" if capacity == 0 else "knnper"}
            points.append({**label, **{k: record[k] for k in SUMMARY},
                           "seconds": record["seconds"]})
            clients += [{**label, "client_id": r["client_id"], "unseen": r["unseen"],
                         "n_test": r["n_test"], "accuracy": r["accuracy"], **r["info"]}
                        for r in record["rows"]]
    plot = _plot(points, ctx.out / NAME / "capacity.png")
    return Result(points, ("alpha", "capacity", "method", *SUMMARY, "seconds"),
                  [("alpha", "alpha", ""), ("capacity", "capacity", ".2f"),
                   ("method", "method", ""), ("all_mean", "mean (all)", ".4f"),
                   ("all_bottom_decile", "bottom 10% (all)", ".4f"),
                   ("unseen_mean", "mean (unseen)", ".4f")],
                  _claims(points), plot, clients,
                  ("alpha", "capacity", "method", "client_id", "unseen", "n_test", "accuracy",
                   "lambda", "datastore_size", "n_train"))


def _curve(points: list[dict], alpha: str, key: str = "all_mean") -> dict[float, float]:
    return {p["capacity"]: p[key] for p in points if p["alpha"] == alpha}


def _claims(points: list[dict]) -> list[Claim]:
    alphas = list(dict.fromkeys(p["alpha"] for p in points))
    grows, rises, parts = 0, {}, []
    for a in alphas:
        curve = _curve(points, a)
        caps = sorted(c for c in curve if c > 0)
        rho = spearman(caps, [curve[c] for c in caps])
        rises[a] = curve[caps[-1]] - curve[caps[0]]
        grows += rises[a] > 0 and (rho is None or rho > 0)
        parts.append(f"alpha {a}: {100 * curve[caps[0]]:.1f}% at {caps[0]:g} -> "
                     f"{100 * curve[caps[-1]]:.1f}% at {caps[-1]:g}"
                     + (f" (Spearman {rho:+.2f})" if rho is not None else ""))
    claims = [Claim("accuracy grows with capacity", "; ".join(parts),
                    verdict(grows, len(alphas)))]
    if len(alphas) >= 2:
        ordered = [rises[a] for a in alphas]
        monotone = all(x > y for x, y in zip(ordered, ordered[1:], strict=False))
        claims.append(Claim(
            "it grows faster for more heterogeneous clients (smaller alpha)",
            "rise from the smallest to the largest capacity: " + ", ".join(
                f"alpha {a} {100 * rises[a]:+.1f} pp" for a in alphas),
            "agree" if monotone else ("partly" if ordered[0] > ordered[-1] else "disagree")))
    else:
        claims.append(Claim("it grows faster for more heterogeneous clients (smaller alpha)",
                            "one alpha only", "not measured"))
    kept, shown = 0, []
    for a in alphas:
        unseen = _curve(points, a, "unseen_mean")
        caps = [c for c in unseen if c > 0]
        if 1.0 not in unseen or unseen.get(0.0) is None or unseen[1.0] is None:
            continue
        third = min(caps, key=lambda c: (abs(c - 1 / 3), c))
        gain = unseen[1.0] - unseen[0.0]
        share = (unseen[third] - unseen[0.0]) / gain if gain > 0 else float("nan")
        kept += share >= 0.5
        shown.append(f"alpha {a}: {share:.0%} of the gain at capacity {third:g}")
    claims.append(Claim("new (unseen) clients keep most of kNN-Per's gain over FedAvg with a "
                        "datastore 3x smaller", "; ".join(shown) or "needs capacity 1 and unseen "
                        "clients", verdict(kept, len(shown))))
    return claims


def _plot(points: list[dict], path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for a in dict.fromkeys(p["alpha"] for p in points):
        curve = _curve(points, a)
        caps = sorted(curve)
        ax.plot(caps, [curve[c] for c in caps], "o-", label=f"alpha {a}")
    ax.set_xlabel("capacity (fraction of the client's train split in its datastore; "
                  "0 = FedAvg)", fontsize=8)
    ax.set_ylabel("kNN-Per mean test accuracy (all clients)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


EXPERIMENT = Experiment(
    NAME, "kNN-Per accuracy versus datastore capacity, for several alphas",
    "accuracy grows with the datastore's size, faster for more heterogeneous clients; new "
    "clients keep most of kNN-Per's benefit with a datastore reduced by a factor 3 (Sec. 6, "
    "Fig. 3).",
    (Grid("alphas", ALPHA, (0.1, 0.3, 1.0), (0.3,), "Dirichlet concentrations, or iid"),
     Grid("capacities", FRACTION, (0.1, 0.2, 0.4, 0.6, 0.8, 1.0), (0.2, 1.0),
          "datastore sizes as fractions of each client's train split")),
    run)
