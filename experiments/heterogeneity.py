"""Data heterogeneity: kNN-Per, FedAvg and Local for each Dirichlet alpha, the global model
retrained for each (the paper's Fig. 3 / Fig. 8 setting). Every method is scored by
evaluation.client_accuracies, exactly as `knnper evaluate` scores it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from experiments.context import Context
from experiments.experiment_seeds import STD
from experiments.margins import (
    AGREE,
    DISAGREE,
    INCONCLUSIVE,
    Aligned,
    call,
    interval,
    paired,
    pp,
    tally,
)
from experiments.points import GridPoint, client_fields
from experiments.report import draw, finish_axes, fit_y, pyplot, save_figure, spearman
from experiments.spec import ALPHAS, IID_ALPHA, Claim, Experiment, Measured, Result, format_alpha
from experiments.views import summary_fields
from fed_train.algorithms import ALGORITHMS, build_algorithm
from fed_train.algorithms.base import get_weights
from fed_train.evaluation import client_accuracies

NAME = "heterogeneity"
METHODS = ("local", "fedavg", "knnper")
SUMMARY_COLUMNS = (
    "all_mean all_bottom_decile all_clients seen_mean seen_bottom_decile unseen_mean "
    "unseen_bottom_decile"
).split()


def _evaluate(ctx: Context, alpha: float, method: str) -> dict[str, Any]:
    run = ctx.run(alpha)
    hyper = {"choice": ctx.knn_choice(alpha)} if method == "knnper" else {}
    algorithm = build_algorithm(method, run.model_factory(), run.config.training, **hyper)
    rows = client_accuracies(
        algorithm,
        get_weights(run.model),
        {},
        run.clients(),
        seed=run.config.seed,
        progress=ctx.progress,
    )
    return {"rows": rows, **summary_fields(rows)}


def measure(ctx: Context, grids: dict[str, tuple]) -> Measured:
    grid = (
        GridPoint(
            {"alpha": format_alpha(alpha), "method": method},
            ctx.point_key(alpha, method=method),
            lambda a=alpha, m=method: _evaluate(ctx, a, m),
        )
        for alpha in sorted(grids["alphas"])
        for method in METHODS
    )
    points, clients = ctx.points(NAME).collect(
        grid,
        lambda record: {k: record[k] for k in SUMMARY_COLUMNS},
        lambda r: client_fields(r, "lambda"),
    )
    return Measured(points, clients, ("alpha", "method"), (ctx.seed,))


def summarise(m: Measured, folder: Path) -> Result:
    plot = _plot(m.points, folder / "heterogeneity.png", m.scale)
    return Result(
        m.points,
        (*m.keys, *SUMMARY_COLUMNS, "seconds"),
        [
            ("alpha", "alpha", ""),
            ("method", "method", ""),
            ("all_mean", "mean (all)", ".2%"),
            ("all_bottom_decile", "bottom 10% (all)", ".2%"),
            ("seen_mean", "mean (seen)", ".2%"),
            ("unseen_mean", "mean (unseen)", ".2%"),
        ],
        _claims(m.points, m.clients),
        plot,
        m.clients,
        (*m.keys, "client_id", "unseen", "n_test", "accuracy", "lambda"),
    )


def _by(points: list[dict], method: str, key: str = "all_mean") -> dict[str, float]:
    return {p["alpha"]: p.get(key) for p in points if p["method"] == method}


def _claims(points: list[dict], clients: list[dict]) -> list[Claim]:
    """Each claim with its margin: 95% bootstrap intervals over clients (paired between methods
    on one partition; each alpha's partition resampled on its own)."""
    alphas = list(dict.fromkeys(p["alpha"] for p in points))
    aligned = {a: Aligned(clients, [{"alpha": a, "method": m} for m in METHODS]) for a in alphas}
    knn, fed, loc = (METHODS.index(m) for m in ("knnper", "fedavg", "local"))

    def gain(a: str, idx: np.ndarray) -> float:
        m = aligned[a].means(idx)
        return float(m[knn] - m[fed])

    gains = {a: gain(a, np.arange(len(aligned[a]))) for a in alphas}
    values = [IID_ALPHA if a == "iid" else float(a) for a in alphas]
    rho = spearman(values, [gains[a] for a in alphas])
    shown = ", ".join(f"alpha {a}: {100 * gains[a]:+.1f} pp" for a in alphas)
    title = "kNN-Per's gain over FedAvg grows with heterogeneity (smaller alpha)"
    claims = [Claim(title, shown, "not measured")]
    if len(alphas) >= 2:
        first, last = alphas[0], alphas[-1]
        iv = interval(
            lambda idx: gain(first, idx[0]) - gain(last, idx[1]),
            [aligned[first].strata, aligned[last].strata],
        )
        spearman_text = f"; Spearman(alpha, gain) = {rho:+.2f}" if rho is not None else ""
        margin = f"; gain at alpha {first} minus at {last}: {pp(iv)}"
        claims = [Claim(title, shown + spearman_text + margin, call(iv))]
    calls, parts = [], []
    for a in alphas:
        over_fed, over_loc = paired(aligned[a], knn, fed), paired(aligned[a], knn, loc)
        both = (call(over_fed), call(over_loc))
        calls.append(
            AGREE if both == (AGREE, AGREE) else DISAGREE if DISAGREE in both else INCONCLUSIVE
        )
        parts.append(f"{a}: {pp(over_fed)} / {pp(over_loc)}")
    claims.append(
        Claim(
            "kNN-Per is more accurate than FedAvg and Local (Table 1)",
            "kNN-Per minus FedAvg / minus Local, mean over all clients: " + "; ".join(parts),
            tally(calls),
        )
    )
    calls, parts = [], []
    for a in alphas:
        iv = paired(aligned[a], knn, fed, "bottom_deciles")
        calls.append(call(iv))
        parts.append(f"{a}: {pp(iv)}")
    claims.append(
        Claim(
            "the worst-off clients are better off with kNN-Per (bottom decile)",
            "bottom decile, kNN-Per minus FedAvg: " + "; ".join(parts),
            tally(calls),
        )
    )
    return claims


def _plot(points: list[dict], path, scale: str):
    plt = pyplot()
    alphas = list(dict.fromkeys(p["alpha"] for p in points))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    fig.suptitle(
        "Claim: kNN-Per's gain over FedAvg grows as the data get more heterogeneous", fontsize=10
    )
    for ax, key, title in (
        (axes[0], "all_mean", "mean test accuracy (%, weighted by test size)"),
        (axes[1], "all_bottom_decile", "bottom-decile test accuracy (%)"),
    ):
        shown, spread = [], []
        for method in METHODS:
            by = _by(points, method, key)
            std = _by(points, method, key + STD)
            draw(
                ax,
                range(len(alphas)),
                [by[a] for a in alphas],
                "o-",
                [std.get(a) for a in alphas],
                label=ALGORITHMS[method].title,
            )
            shown += [by[a] for a in alphas]
            spread += [std.get(a) for a in alphas]
        ax.set_xticks(range(len(alphas)), alphas)
        ax.set_xlabel("Dirichlet alpha (smaller = more heterogeneous)")
        ax.set_ylabel(title)
        fit_y(ax, shown, spread)
        finish_axes(ax, legend=ax is axes[1])
    return save_figure(fig, path, scale)


EXPERIMENT = Experiment(
    NAME,
    "kNN-Per, FedAvg and Local versus data heterogeneity (alpha; one global model each)",
    "the benefit of memorization is larger when data are more heterogeneous (smaller alpha), "
    "and kNN-Per addresses heterogeneity better than the other methods (Sec. 6, Fig. 3, Fig. 8; "
    "Theorem 4.1).",
    (replace(ALPHAS, full=(0.1, 0.3, 0.5, 1.0, IID_ALPHA), quick=(0.3, IID_ALPHA)),),
    measure,
    summarise,
    lambda g: len(g["alphas"]) * len(METHODS),
)
