"""Data heterogeneity: kNN-Per, FedAvg and Local for each Dirichlet alpha, the global model
retrained for each (the paper's Fig. 3 / Fig. 8 setting). Every method is scored by
evaluation.client_accuracies, exactly as `knnper evaluate` scores it."""

from __future__ import annotations

from typing import Any

from experiments.context import Context
from experiments.report import percent, pyplot, save_figure, spearman, verdict
from experiments.spec import ALPHA, IID_ALPHA, Claim, Experiment, Grid, Result, format_alpha
from experiments.views import summary_fields
from fed_train.algorithms import build_algorithm
from fed_train.algorithms.base import get_weights
from fed_train.evaluation import client_accuracies

NAME = "heterogeneity"
METHODS = ("local", "fedavg", "knnper")
TITLES = {"local": "Local", "fedavg": "FedAvg", "knnper": "kNN-Per"}
SUMMARY_COLUMNS = ("all_mean", "all_bottom_decile", "all_clients", "seen_mean",
                   "seen_bottom_decile", "unseen_mean", "unseen_bottom_decile")


def _evaluate(ctx: Context, alpha: float, method: str) -> dict[str, Any]:
    run = ctx.run(alpha)
    hyper = ctx.knn_choice(alpha).hyper() if method == "knnper" else {}
    algorithm = build_algorithm(method, run.model_factory(), run.config.training, **hyper)
    rows = client_accuracies(algorithm, get_weights(run.model), {}, run.clients(),
                             seed=run.config.seed, progress=ctx.progress)
    return {"rows": rows, **summary_fields(rows)}


def run(ctx: Context, grids: dict[str, tuple]) -> Result:
    store = ctx.points(NAME)
    points, clients = [], []
    for alpha in sorted(grids["alphas"]):
        for method in METHODS:
            record = store.compute(ctx.point_key(alpha, method=method),
                                   lambda a=alpha, m=method: _evaluate(ctx, a, m))
            label = {"alpha": format_alpha(alpha), "method": method}
            points.append({**label, **{k: record[k] for k in SUMMARY_COLUMNS},
                           "seconds": record["seconds"]})
            clients += [{**label, "client_id": r["client_id"], "unseen": r["unseen"],
                         "n_test": r["n_test"], "accuracy": r["accuracy"],
                         "lambda": r["info"].get("lambda")} for r in record["rows"]]
    plot = _plot(points, ctx.out / NAME / "heterogeneity.png")
    return Result(points, ("alpha", "method", *SUMMARY_COLUMNS, "seconds"),
                  [("alpha", "alpha", ""), ("method", "method", ""),
                   ("all_mean", "mean (all)", ".4f"),
                   ("all_bottom_decile", "bottom 10% (all)", ".4f"),
                   ("seen_mean", "mean (seen)", ".4f"), ("unseen_mean", "mean (unseen)", ".4f")],
                  _claims(points), plot, clients,
                  ("alpha", "method", "client_id", "unseen", "n_test", "accuracy", "lambda"))


def _by(points: list[dict], method: str, key: str = "all_mean") -> dict[str, float]:
    return {p["alpha"]: p[key] for p in points if p["method"] == method}


def _claims(points: list[dict]) -> list[Claim]:
    alphas = list(dict.fromkeys(p["alpha"] for p in points))
    knn, fed, loc = _by(points, "knnper"), _by(points, "fedavg"), _by(points, "local")
    gain = {a: knn[a] - fed[a] for a in alphas}
    values = [IID_ALPHA if a == "iid" else float(a) for a in alphas]
    rho = spearman(values, [gain[a] for a in alphas])
    shown = ", ".join(f"alpha {a}: {100 * gain[a]:+.1f} pp" for a in alphas)
    grows = len(alphas) >= 2 and gain[alphas[0]] > gain[alphas[-1]] and (rho is None or rho < 0)
    claims = [Claim("kNN-Per's gain over FedAvg grows with heterogeneity (smaller alpha)",
                    f"{shown}" + (f"; Spearman(alpha, gain) = {rho:+.2f}" if rho is not None
                                  else ""),
                    ("agree" if grows else "disagree") if len(alphas) >= 2 else "not measured")]
    best = [a for a in alphas if knn[a] > fed[a] and knn[a] > loc[a]]
    claims.append(Claim("kNN-Per is more accurate than FedAvg and Local (Table 1)",
                        f"best of the three at {len(best)} of {len(alphas)} alphas (mean over "
                        "all clients)", verdict(len(best), len(alphas))))
    knn_b, fed_b = _by(points, "knnper", "all_bottom_decile"), _by(points, "fedavg",
                                                                      "all_bottom_decile")
    fair = [a for a in alphas if knn_b[a] >= fed_b[a]]
    claims.append(Claim("the worst-off clients are better off with kNN-Per (bottom decile)",
                        "bottom decile kNN-Per / FedAvg: " + ", ".join(
                            f"{a}: {percent(knn_b[a])} / {percent(fed_b[a])}" for a in alphas),
                        verdict(len(fair), len(alphas))))
    return claims


def _plot(points: list[dict], path):
    plt = pyplot()
    alphas = list(dict.fromkeys(p["alpha"] for p in points))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "all_mean", "mean accuracy (weighted by test size)"),
                           (axes[1], "all_bottom_decile", "bottom decile")):
        for method in METHODS:
            by = _by(points, method, key)
            ax.plot(range(len(alphas)), [by[a] for a in alphas], "o-", label=TITLES[method])
        ax.set_xticks(range(len(alphas)), alphas)
        ax.set_xlabel("Dirichlet alpha (smaller = more heterogeneous)")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


EXPERIMENT = Experiment(
    NAME, "kNN-Per, FedAvg and Local versus data heterogeneity (alpha; one global model each)",
    "the benefit of memorization is larger when data are more heterogeneous (smaller alpha), "
    "and kNN-Per addresses heterogeneity better than the other methods (Sec. 6, Fig. 3, Fig. 8; "
    "Theorem 4.1).",
    (Grid("alphas", ALPHA, (0.1, 0.3, 0.5, 1.0, IID_ALPHA), (0.3, IID_ALPHA),
          "Dirichlet concentrations, or iid"),),
    run)
