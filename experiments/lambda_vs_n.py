"""lambda_opt versus the datastore size n_m (Appendix, Fig. 9): every client at every capacity
gives one (n_m, lambda) pair, lambda chosen on the client's validation split (the paper takes it
on test; we never do). The points are the capacity experiment's, shared through its store.

Theorem 4.1's bound is linear in lambda, so for each client it is minimised at lambda = 0 or 1,
switching to 1 once n_m passes a threshold: the bound predicts that lambda_opt grows with n_m,
in a step. We fit that step (the threshold n* that best separates small from large lambdas)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from experiments.capacity import NAME as CAPACITY
from experiments.capacity import capacity_point
from experiments.context import Context
from experiments.margins import call, interval, strata, unit
from experiments.report import finish_axes, pyplot, save_figure, spearman
from experiments.spec import CAPACITIES, Claim, Experiment, Measured, Result

NAME = "lambda-vs-n"


def step_fit(n: np.ndarray, lam: np.ndarray) -> tuple[float, float, float, float]:
    """(threshold, level below, level above, share of variance explained) of the best upward
    step, the bound's shape; without one that fits better than a constant, the constant."""
    best = (float(n.max()), float(lam.mean()), float(lam.mean()), 0.0)
    total = float(((lam - lam.mean()) ** 2).sum())
    if total == 0:
        return best
    best_err = total
    for t in np.unique(n)[:-1]:
        lo, hi = lam[n <= t], lam[n > t]
        err = float(((lo - lo.mean()) ** 2).sum() + ((hi - hi.mean()) ** 2).sum())
        if hi.mean() > lo.mean() and err < best_err:
            best_err, best = err, (float(t), float(lo.mean()), float(hi.mean()), 0.0)
    return (*best[:3], 1 - best_err / total)


def measure(ctx: Context, grids: dict[str, tuple]) -> Measured:
    store = ctx.points(CAPACITY)  # the same points as the capacity experiment at this alpha
    alpha = ctx.config.alpha
    points, pairs = [], []
    for capacity in sorted(grids["capacities"]):
        record = store.compute(
            ctx.point_key(alpha, capacity=capacity),
            lambda c=capacity: capacity_point(ctx, alpha, c),
        )
        rows = [r for r in record["rows"] if r["n_test"]]
        lams = [r["info"]["lambda"] for r in rows]
        sizes = [r["info"]["datastore_size"] for r in rows]
        points.append(
            {
                "capacity": capacity,
                "mean_datastore_size": float(np.mean(sizes)),
                "mean_lambda": float(np.mean(lams)),
                "share_lambda_above_half": float(np.mean(np.array(lams) > 0.5)),
                "mean_accuracy": record["all_mean"],
                "seconds": record["seconds"],
            }
        )
        pairs += [
            {
                "capacity": capacity,
                "client_id": r["client_id"],
                "unseen": r["unseen"],
                "datastore_size": r["info"]["datastore_size"],
                "lambda": r["info"]["lambda"],
                "accuracy": r["accuracy"],
            }
            for r in rows
        ]
    return Measured(points, pairs, ("capacity",), (ctx.seed,))


def summarise(m: Measured, folder: Path) -> Result:
    pairs = m.clients
    n = np.array([p["datastore_size"] for p in pairs], dtype=float)
    lam = np.array([p["lambda"] for p in pairs], dtype=float)
    fit = step_fit(n, lam)
    plot = _plot(n, lam, fit, folder / "lambda_vs_n.png", m.scale)
    return Result(
        m.points,
        (
            "capacity mean_datastore_size mean_lambda share_lambda_above_half mean_accuracy seconds"
        ).split(),
        [
            ("capacity", "capacity", ".2f"),
            ("mean_datastore_size", "mean n_m", ".1f"),
            ("mean_lambda", "mean lambda", ".3f"),
            ("share_lambda_above_half", "share lambda > 1/2", ".2f"),
            ("mean_accuracy", "kNN-Per mean", ".2%"),
        ],
        _claims(pairs, fit),
        plot,
        pairs,
        ("capacity", "client_id", "unseen", "datastore_size", "lambda", "accuracy"),
        [
            f"Upward step fit (the bound's shape): lambda {fit[1]:.2f} for n_m <= "
            f"{fit[0]:g}, {fit[2]:.2f} above; it explains {fit[3]:.0%} of the variance "
            f"of lambda over {len(pairs)} (client, capacity) pairs (0% and one level: "
            "no upward step fits better than a constant)."
        ],
    )


def _by_client(pairs: list[dict]) -> tuple[list[np.ndarray], tuple[int, ...]]:
    """Row indices of each client's pairs, clients in (seed, id) order, and each seed's number
    of clients: one client's capacities are not independent, so the bootstrap resamples whole
    clients (within their seed)."""
    units = sorted({unit(p) for p in pairs})
    of = [unit(p) for p in pairs]
    return ([np.array([i for i, u in enumerate(of) if u == c]) for c in units], strata(units))


def _claims(pairs: list[dict], fit: tuple) -> list[Claim]:
    n = np.array([p["datastore_size"] for p in pairs], dtype=float)
    lam = np.array([p["lambda"] for p in pairs], dtype=float)
    groups, seeds = _by_client(pairs)

    def rows(idx: np.ndarray) -> np.ndarray:
        return np.concatenate([groups[i] for i in idx])

    def rho_of(idx: list[np.ndarray]) -> float:
        r = rows(idx[0])
        value = spearman(n[r].tolist(), lam[r].tolist())
        return float("nan") if value is None else value

    rho = spearman(n.tolist(), lam.tolist())
    title = "lambda_opt grows with the local dataset size n_m (Fig. 9, Theorem 4.1)"
    if rho is None:
        claims = [Claim(title, "lambda or n_m constant", "not measured")]
    else:
        iv = interval(rho_of, [seeds])
        claims = [
            Claim(
                title,
                f"Spearman(n_m, lambda) = {rho:+.2f} over {len(n)} pairs of "
                f"{len(groups)} clients, 95% interval (clients resampled) "
                f"[{iv['low']:+.2f}, {iv['high']:+.2f}]; step fit: {fit[1]:.2f} below "
                f"n_m = {fit[0]:g}, {fit[2]:.2f} above",
                call(iv),
            )
        ]
    title = (
        "clients with about a hundred samples weigh the kNN more than the global model "
        "(lambda > 1/2, Sec. 6)"
    )
    around = (n >= 50) & (n <= 200)
    if around.any():

        def mean_of(idx: list[np.ndarray]) -> float:
            r = rows(idx[0])
            r = r[around[r]]
            return float(lam[r].mean()) if len(r) else float("nan")

        iv = interval(mean_of, [seeds])
        claims.append(
            Claim(
                title,
                f"mean lambda {iv['effect']:.2f} over {int(around.sum())} "
                f"pairs with 50 <= n_m <= 200, 95% interval [{iv['low']:.2f}, "
                f"{iv['high']:.2f}]",
                call(iv, 0.5),
            )
        )
    else:
        claims.append(
            Claim(title, "no client datastore between 50 and 200 samples", "not measured")
        )
    return claims


def _plot(n: np.ndarray, lam: np.ndarray, fit: tuple, path, scale: str) -> Any:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    # identical (n_m, lambda) pairs drawn once, their marker area growing with their count
    pairs, counts = np.unique(np.stack([n, lam], axis=1), axis=0, return_counts=True)
    ax.scatter(
        pairs[:, 0],
        pairs[:, 1],
        s=6 * counts,
        alpha=0.35,
        label="(client, capacity) pairs; area = how many",
    )
    if len(n):
        edges = np.unique(np.geomspace(max(n.min(), 1), n.max() + 1, 9).round())
        which = np.digitize(n, edges)
        centres = [float(np.exp(np.log(n[which == b]).mean())) for b in np.unique(which)]
        means = [float(lam[which == b].mean()) for b in np.unique(which)]
        ax.plot(centres, means, "o-", color="black", label="mean per size bin")
        xs = [n.min(), fit[0], fit[0], n.max()]
        ax.plot(
            xs,
            [fit[1], fit[1], fit[2], fit[2]],
            "--",
            color="tab:red",
            label="step fit (the bound's shape)",
        )
    ax.axhline(0.5, color="grey", lw=0.8, ls=":", label="lambda = 1/2")
    ax.set_xscale("log")
    ax.set_ylim(-0.05, 1.05)  # lambda's whole range {0, ..., 1}: the claim is about its level
    ax.set_xlabel("datastore size n_m (samples, log scale)")
    ax.set_ylabel("lambda chosen on validation (weight of the kNN; axis 0 to 1)")
    finish_axes(ax, "Claim: lambda grows with the datastore size n_m", percent_y=False)
    return save_figure(fig, path, scale)


EXPERIMENT = Experiment(
    NAME,
    "lambda chosen on validation versus the datastore size n_m",
    "the larger the local dataset, the more a client relies on its kNN model (lambda_opt grows "
    "with n_m, as Theorem 4.1's bound predicts); clients with about a hundred samples already "
    "give lambda > 1/2 (Sec. 6, Appendix Fig. 9).",
    (CAPACITIES,),
    measure,
    summarise,
    lambda g: len(g["capacities"]),
)
