"""Base-model quality (Sec. 6, Fig. 5 and Appendix Figs. 12-13): FedAvg and kNN-Per for global
models checkpointed along training. The paper trains its global model centrally; here it is the
same FedAvg run as the other experiments, replayed with every Nth checkpoint kept (the replay is
seeded like the run, so its last checkpoint is the run's final model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from experiments.context import Context
from experiments.margins import Aligned, call, interval, pp, tally
from experiments.points import GridPoint
from experiments.report import finish_axes, fit_y, pyplot, save_figure
from experiments.spec import ALPHAS, Claim, Experiment, Measured, Result, format_alpha
from experiments.views import (
    accuracy_on_test,
    fedavg_rows,
    knn_head,
    pooled_heads,
    row,
    summary_fields,
)
from fed_train.algorithms import build_algorithm
from fed_train.algorithms.base import get_weights, set_weights
from fed_train.knn_tuning import client_views
from fed_train.simulation import checkpoint_round, load_checkpoint, simulate

NAME = "base-model"
COLUMNS = ("alpha", "round", "fedavg_mean", "knn_only_mean", "knnper_mean", "gain_pp")


def trajectory(ctx: Context, alpha: float) -> list[Path]:
    """The run's training replayed into RUN/trajectory, keeping every Nth checkpoint; resumes."""
    run = ctx.run(alpha)
    model_fn = run.model_factory()
    torch.manual_seed(run.config.seed)
    initial = get_weights(model_fn())  # the run's own initialisation (same seed)
    every = run.config.checkpoint_every
    directory = ctx.run_dir(alpha) / "trajectory"
    directory.mkdir(parents=True, exist_ok=True)
    simulate(
        build_algorithm("fedavg", model_fn, run.config.training),
        run.clients(),
        run.config.training,
        initial,
        seed=run.config.seed,
        run_dir=directory,
        checkpoint_every=every,
        keep_every=every,
        progress=ctx.progress,
    )
    return sorted((directory / "checkpoints").glob("round_*.pt"), key=checkpoint_round)


def checkpoint_point(ctx: Context, alpha: float, path: Path) -> dict[str, Any]:
    run = ctx.run(alpha)
    model = run.model_factory()()
    set_weights(model, load_checkpoint(path).weights)
    # the final model's configuration at every checkpoint: the experiment asks how the base
    # model's quality moves kNN-Per with the kNN part held fixed
    choice = ctx.knn_choice(alpha)
    views = client_views(model, run.clients(), normalize=choice.config.normalize)
    heads = pooled_heads(
        views,
        [
            knn_head(view, run.dataset.num_classes, choice, capacity=1.0, seed=ctx.seed)
            for view in views
        ],
        choice.lambda_rule.name,
    )
    knn_only = [
        row(view, accuracy_on_test(head.with_lambda(1.0), view))
        for view, head in zip(views, heads, strict=True)
    ]
    tuned = [
        row(view, accuracy_on_test(head, view), **{"lambda": head.lambda_})
        for view, head in zip(views, heads, strict=True)
    ]
    means = {
        name: summary_fields(rows)["all_mean"]
        for name, rows in (
            ("fedavg", fedavg_rows(views)),
            ("knn_only", knn_only),
            ("knnper", tuned),
        )
    }
    return {
        "fedavg_mean": means["fedavg"],
        "knn_only_mean": means["knn_only"],
        "knnper_mean": means["knnper"],
        "rows": [
            {
                "client_id": t["client_id"],
                "unseen": t["unseen"],
                "n_test": t["n_test"],
                "fedavg": f["accuracy"],
                "knn_only": k["accuracy"],
                "knnper": t["accuracy"],
                "lambda": t["info"]["lambda"],
            }
            for f, k, t in zip(fedavg_rows(views), knn_only, tuned, strict=True)
        ],
    }


def measure(ctx: Context, grids: dict[str, tuple]) -> Measured:
    grid = (
        GridPoint(
            {"alpha": format_alpha(alpha), "round": checkpoint_round(path)},
            ctx.point_key(alpha, round=checkpoint_round(path)),
            lambda a=alpha, p=path: checkpoint_point(ctx, a, p),
        )
        for alpha in sorted(grids["alphas"])
        for path in trajectory(ctx, alpha)
    )
    points, clients = ctx.points(NAME).collect(
        grid,
        lambda record: {
            **{k: record[k] for k in COLUMNS[2:5]},
            "gain_pp": 100 * (record["knnper_mean"] - record["fedavg_mean"]),
        },
    )
    return Measured(points, clients, ("alpha", "round"), (ctx.seed,))


def summarise(m: Measured, folder: Path) -> Result:
    plot = _plot(m.points, folder / "base_model.png", m.scale)
    return Result(
        m.points,
        (*COLUMNS, "seconds"),
        [
            ("alpha", "alpha", ""),
            ("round", "round", ""),
            ("fedavg_mean", "FedAvg", ".2%"),
            ("knn_only_mean", "kNN (lambda=1)", ".2%"),
            ("knnper_mean", "kNN-Per (lambda on val)", ".2%"),
            ("gain_pp", "gain (pp)", "+.1f"),
        ],
        _claims(m.points, m.clients),
        plot,
        m.clients,
        (*m.keys, "client_id", "unseen", "n_test", "fedavg", "knn_only", "knnper", "lambda"),
    )


LINEAR_R = 0.9  # Pearson r from which "almost linear" is called


def _claims(points: list[dict], clients: list[dict]) -> list[Claim]:
    """Each claim with its margin: 95% bootstrap intervals over clients (paired across one
    run's checkpoints; alphas, drawn as separate partitions, resampled apart). Needs the
    per-client FedAvg accuracy (the "fedavg" column)."""
    alphas = list(dict.fromkeys(p["alpha"] for p in points))
    if not clients or clients[0].get("fedavg") is None:
        return [
            Claim(
                "every claim of this experiment",
                "the per-client rows hold no FedAvg accuracy, so no margin can be computed",
                "not measured",
            )
        ]
    rounds = {a: sorted(p["round"] for p in points if p["alpha"] == a) for a in alphas}
    series = {
        a: {
            m: Aligned(clients, [{"alpha": a, "round": r} for r in rounds[a]], m)
            for m in ("fedavg", "knn_only", "knnper")
        }
        for a in alphas
    }

    def pearson(a: str, idx: np.ndarray) -> float:
        x, y = series[a]["fedavg"].means(idx), series[a]["knn_only"].means(idx)
        return float(np.corrcoef(x, y)[0, 1]) if x.std() and y.std() else float("nan")

    def gains(a: str, idx: np.ndarray) -> np.ndarray:
        return series[a]["knnper"].means(idx) - series[a]["fedavg"].means(idx)

    linear, shown, weak_first, shown_gain = [], [], [], []
    for a in alphas:
        n = [series[a]["fedavg"].strata]
        if len(rounds[a]) >= 3:
            iv = interval(lambda idx, a=a: pearson(a, idx[0]), n)
            linear.append(call(iv, LINEAR_R))
            shown.append(
                f"alpha {a}: Pearson r = {iv['effect']:.3f} over {len(rounds[a])} "
                f"checkpoints, 95% interval [{iv['low']:.3f}, {iv['high']:.3f}]"
            )
        iv = interval(lambda idx, a=a: float(gains(a, idx[0])[0] - gains(a, idx[0])[-1]), n)
        weak_first.append(call(iv))
        g = gains(a, np.arange(len(series[a]["fedavg"])))
        shown_gain.append(
            f"alpha {a}: {100 * g[0]:+.1f} pp at round {rounds[a][0]}, "
            f"{100 * g[-1]:+.1f} pp at round {rounds[a][-1]}; first minus last "
            f"{pp(iv)}"
        )
    claims = [
        Claim(
            f"kNN accuracy (lambda = 1) is almost linear (Pearson r >= {LINEAR_R}) in the "
            "global model's accuracy",
            "; ".join(shown) or "fewer than 3 checkpoints",
            tally(linear),
        ),
        Claim(
            "kNN-Per helps most when the global model is weak (our reading of Fig. 5)",
            "; ".join(shown_gain),
            tally(weak_first),
        ),
    ]
    if len(alphas) >= 2:
        first, last = alphas[0], alphas[-1]
        iv = interval(
            lambda idx: float(gains(first, idx[0])[-1] - gains(last, idx[1])[-1]),
            [series[first]["fedavg"].strata, series[last]["fedavg"].strata],
        )
        claims.append(
            Claim(
                "kNN-Per's gain is larger for more heterogeneous data (smaller alpha)",
                ", ".join(
                    f"alpha {a}: {100 * gains(a, np.arange(len(series[a]['fedavg'])))[-1]:+.1f} pp"
                    for a in alphas
                )
                + f" (final model); alpha {first} minus alpha {last}: {pp(iv)}",
                call(iv),
            )
        )
    return claims


def _plot(points: list[dict], path, scale: str):
    """Each alpha's checkpoints joined in round order (first and last round labelled), kNN
    accuracy against the global model's."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for a in dict.fromkeys(p["alpha"] for p in points):
        pts = sorted((p for p in points if p["alpha"] == a), key=lambda p: p["round"])
        x = [p["fedavg_mean"] for p in pts]
        (line,) = ax.plot(
            x, [p["knn_only_mean"] for p in pts], "o-", label=f"alpha {a}: kNN (lambda=1)"
        )
        ax.plot(
            x,
            [p["knnper_mean"] for p in pts],
            "s--",
            color=line.get_color(),
            alpha=0.7,
            label=f"alpha {a}: kNN-Per (lambda on val)",
        )
        for p in (pts[0], pts[-1]):
            ax.annotate(
                f"r{p['round']}",
                (p["fedavg_mean"], p["knn_only_mean"]),
                fontsize=6,
                xytext=(3, -9),
                textcoords="offset points",
                color=line.get_color(),
            )
    xs = [p["fedavg_mean"] for p in points]
    ys = [p[k] for p in points for k in ("knn_only_mean", "knnper_mean")]
    lo, hi = min(xs + ys), max(xs + ys)
    ax.plot(
        [lo, hi],
        [lo, hi],
        color="grey",
        lw=0.8,
        ls=":",
        label="y = x (as accurate as FedAvg's model)",
    )
    ax.set_xlabel("global model (FedAvg) mean test accuracy (%), checkpoints in round order")
    ax.set_ylabel("kNN / kNN-Per mean test accuracy (%)")
    fit_y(ax, ys)
    pad = max((max(xs) - min(xs)) * 0.1, 0.005)
    ax.set_xlim(max(min(xs) - pad, 0.0), min(max(xs) + pad, 1.0))  # fitted, as the y axis
    finish_axes(ax, "Claim: kNN accuracy is almost linear in the global model's accuracy")
    from matplotlib.ticker import PercentFormatter  # matplotlib loads only when plotting

    ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    return save_figure(fig, path, scale)


EXPERIMENT = Experiment(
    NAME,
    "FedAvg and kNN-Per accuracy for global models checkpointed along training",
    "kNN accuracy (lambda = 1) is almost linear in the global model's test accuracy, and "
    "better for more heterogeneous data (Sec. 6, Fig. 5; Appendix Figs. 12-13).",
    (ALPHAS,),
    measure,
    summarise,
)
