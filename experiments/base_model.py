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
from experiments.report import pyplot, save_figure, verdict
from experiments.spec import ALPHA, Claim, Experiment, Grid, Result, format_alpha
from experiments.views import client_views, fedavg_rows, knn_outcome, row, summary_fields
from fed_train.algorithms import build_algorithm
from fed_train.algorithms.base import get_weights, set_weights
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
    simulate(build_algorithm("fedavg", model_fn, run.config.training), run.clients(),
             run.config.training, initial, seed=run.config.seed, run_dir=directory,
             checkpoint_every=every, keep_every=every, progress=ctx.progress)
    return sorted((directory / "checkpoints").glob("round_*.pt"), key=checkpoint_round)


def checkpoint_point(ctx: Context, alpha: float, path: Path) -> dict[str, Any]:
    run = ctx.run(alpha)
    model = run.model_factory()()
    set_weights(model, load_checkpoint(path).weights)
    # the final model's configuration at every checkpoint: the experiment asks how the base
    # model's quality moves kNN-Per with the kNN part held fixed
    choice = ctx.knn_choice(alpha)
    views = client_views(model, run.clients(), normalize=choice.config.normalize)
    knn_only, tuned = [], []
    for view in views:
        outcome = knn_outcome(view, run.dataset.num_classes, k=choice.config.k,
                              sigma=choice.config.sigma, capacity=1.0, seed=ctx.seed,
                              estimator=choice.lambda_estimator)
        knn_only.append(row(view, outcome.accuracy(view, lam=1.0)))
        tuned.append(row(view, outcome.accuracy(view), **{"lambda": outcome.lam}))
    means = {name: summary_fields(rows)["all_mean"]
             for name, rows in (("fedavg", fedavg_rows(views)), ("knn_only", knn_only),
                                ("knnper", tuned))}
    return {"fedavg_mean": means["fedavg"], "knn_only_mean": means["knn_only"],
            "knnper_mean": means["knnper"],
            "rows": [{"client_id": t["client_id"], "unseen": t["unseen"], "n_test": t["n_test"],
                      "knn_only": k["accuracy"], "knnper": t["accuracy"],
                      "lambda": t["info"]["lambda"]} for k, t in zip(knn_only, tuned,
                                                                     strict=True)]}


def run(ctx: Context, grids: dict[str, tuple]) -> Result:
    store = ctx.points(NAME)
    points, clients = [], []
    for alpha in sorted(grids["alphas"]):
        for path in trajectory(ctx, alpha):
            rnd = checkpoint_round(path)
            record = store.compute(ctx.point_key(alpha, round=rnd),
                                   lambda a=alpha, p=path: checkpoint_point(ctx, a, p))
            label = {"alpha": format_alpha(alpha), "round": rnd}
            points.append({**label, **{k: record[k] for k in COLUMNS[2:5]},
                           "gain_pp": 100 * (record["knnper_mean"] - record["fedavg_mean"]),
                           "seconds": record["seconds"]})
            clients += [{**label, **r} for r in record["rows"]]
    plot = _plot(points, ctx.out / NAME / "base_model.png")
    return Result(points, (*COLUMNS, "seconds"),
                  [("alpha", "alpha", ""), ("round", "round", ""),
                   ("fedavg_mean", "FedAvg", ".4f"), ("knn_only_mean", "kNN (lambda=1)", ".4f"),
                   ("knnper_mean", "kNN-Per (lambda on val)", ".4f"),
                   ("gain_pp", "gain (pp)", "+.1f")],
                  _claims(points), plot, clients,
                  ("alpha", "round", "client_id", "unseen", "n_test", "knn_only", "knnper",
                   "lambda"))


def _claims(points: list[dict]) -> list[Claim]:
    alphas = list(dict.fromkeys(p["alpha"] for p in points))
    linear, shown, weak_first, shown_gain = 0, [], 0, []
    for a in alphas:
        pts = sorted((p for p in points if p["alpha"] == a), key=lambda p: p["round"])
        x = np.array([p["fedavg_mean"] for p in pts])
        y = np.array([p["knn_only_mean"] for p in pts])
        r = float(np.corrcoef(x, y)[0, 1]) if len(pts) >= 3 and x.std() and y.std() else None
        if r is not None:
            linear += r >= 0.9
            shown.append(f"alpha {a}: Pearson r = {r:.3f} over {len(pts)} checkpoints")
        first, last = pts[0], pts[-1]
        weak_first += first["gain_pp"] > last["gain_pp"]
        shown_gain.append(f"alpha {a}: {first['gain_pp']:+.1f} pp at round {first['round']} "
                          f"(FedAvg {100 * first['fedavg_mean']:.1f}%), {last['gain_pp']:+.1f} "
                          f"pp at round {last['round']} (FedAvg {100 * last['fedavg_mean']:.1f}%)")
    claims = [
        Claim("kNN accuracy (lambda = 1) is almost linear in the global model's accuracy",
              "; ".join(shown) or "fewer than 3 checkpoints", verdict(linear, len(shown))),
        Claim("kNN-Per helps most when the global model is weak (issue 9's reading of Fig. 5)",
              "; ".join(shown_gain), verdict(weak_first, len(alphas))),
    ]
    if len(alphas) >= 2:
        final = {a: max((p for p in points if p["alpha"] == a), key=lambda p: p["round"])
                 for a in alphas}
        claims.append(Claim(
            "kNN-Per's gain is larger for more heterogeneous data (smaller alpha)",
            ", ".join(f"alpha {a}: {final[a]['gain_pp']:+.1f} pp" for a in alphas)
            + " (final model)",
            "agree" if final[alphas[0]]["gain_pp"] > final[alphas[-1]]["gain_pp"] else
            "disagree"))
    return claims


def _plot(points: list[dict], path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for a in dict.fromkeys(p["alpha"] for p in points):
        pts = sorted((p for p in points if p["alpha"] == a), key=lambda p: p["fedavg_mean"])
        x = [p["fedavg_mean"] for p in pts]
        line, = ax.plot(x, [p["knn_only_mean"] for p in pts], "o-",
                        label=f"alpha {a}: kNN (lambda=1)")
        ax.plot(x, [p["knnper_mean"] for p in pts], "s--", color=line.get_color(), alpha=0.7,
                label=f"alpha {a}: kNN-Per (lambda on val)")
    lims = [min(ax.get_xlim()[0], ax.get_ylim()[0]), max(ax.get_xlim()[1], ax.get_ylim()[1])]
    ax.plot(lims, lims, color="grey", lw=0.8, ls=":", label="y = x")
    ax.set_xlabel("global model (FedAvg) mean test accuracy")
    ax.set_ylabel("kNN / kNN-Per mean test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


EXPERIMENT = Experiment(
    NAME, "FedAvg and kNN-Per accuracy for global models checkpointed along training",
    "kNN accuracy (lambda = 1) is almost linear in the global model's test accuracy, and "
    "better for more heterogeneous data (Sec. 6, Fig. 5; Appendix Figs. 12-13).",
    (Grid("alphas", ALPHA, (0.1, 0.3, 1.0), (0.3,), "Dirichlet concentrations, or iid"),),
    run)
