"""Where a personalized predictor's accuracy comes from: every head on every body.

A body is the representation (`embed`) a federated method trained: FedAvg's, FedRep's, pFedGP's.
A head is what a client puts on top of it:
- "own": the method's own personalization (FedAvg's global head, FedRep's personal linear head,
  pFedGP's GP);
- "linear": a per-client linear probe, FedRep's head step on the frozen body, started from the
  body's global head, as many epochs as FedRep gives a new client;
- "gp": a per-client GP classifier, pFedGP's, on the frozen body;
- "knn": the kNN posterior alone (lambda = 1);
- "knn+own": kNN-Per on that body: the kNN interpolated with the body's own predictor, lambda per
  client on validation (on FedAvg's body this is kNN-Per itself); with the "auto" estimator each
  body gets the lambda estimator that wins cross-validation inside its validation splits.
kNN's k, sigma and normalisation are chosen for each body on validation, as for kNN-Per (see
knn_tuning); the oracle lambda is reported beside each kNN row and used for nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from edge_runtime._io import read_json_cache, to_json_types, write_json_atomic
from experiments.points import client_fields
from fed_train.algorithms import build_algorithm
from fed_train.algorithms.base import (
    ClientData,
    PersonalModel,
    TrainingConfig,
    Weights,
    set_weights,
)
from fed_train.algorithms.fedrep import FedRep
from fed_train.algorithms.pfedgp import PFedGP
from fed_train.evaluation import client_accuracies, summarize
from fed_train.knn_tuning import (
    base_probs_of,
    client_rows,
    client_views,
    compare_lambda_estimators,
    lambda_report,
    pick_estimator,
    select_config,
)
from fed_train.models import EmbedHeadModel
from fed_train.run import RunConfig
from fed_train.simulation import PERSONALIZE_STREAM, client_seed

BODIES: tuple[str, ...] = ("fedavg", "fedrep", "pfedgp")
HEADS: tuple[str, ...] = ("own", "linear", "gp", "knn", "knn+own")


class TableRunner(Protocol):
    """What attribution takes from a comparison table: its clients and settings, each method's
    trained run and per-client rows (`experiments.tables.TableRunner` is the one there is).
    Declared here so that the table, which calls attribution, is the only one importing."""

    config: RunConfig
    out: Path
    hyper: dict[str, dict[str, Any]]
    clients: list[ClientData]

    def model_fn(self) -> EmbedHeadModel: ...

    def train(self, trainer: str, training: TrainingConfig) -> Any: ...

    def rows(self, method: str, lr: float) -> list[dict[str, Any]] | None: ...


class _FixedBody:
    """A head-only algorithm on a frozen body: `personalize` is all the evaluation calls."""

    def __init__(self, name: str, personalize: Callable[..., PersonalModel]) -> None:
        self.name = name
        self.personalize = personalize


def _head_algorithm(head: str, runner: TableRunner, training: TrainingConfig) -> _FixedBody:
    if head == "linear":
        probe = FedRep(runner.model_fn, training)
        return _FixedBody("linear", lambda w, c, s, seed: probe.personalize(w, c, {}, seed))
    if head == "gp":
        gp = PFedGP(runner.model_fn, training)
        return _FixedBody("gp", lambda w, c, s, seed: gp.personalize(w, c, {}, seed))
    raise ValueError(f"unknown head {head!r}")


def _own_personalizer(
    runner: TableRunner,
    body: str,
    training: TrainingConfig,
    weights: Weights,
    states: dict[int, dict[str, Any]],
):
    """The body's own personalized model for a client, with the seed evaluation gives it, so
    the base kNN-Per interpolates with is exactly the "own" row's predictor."""
    algorithm = build_algorithm(body, runner.model_fn, training, **runner.hyper.get(body, {}))
    seed = runner.config.seed

    def personalize(client: ClientData) -> PersonalModel:
        return algorithm.personalize(
            weights,
            client,
            states.get(client.client_id, {}),
            client_seed(seed, 0, client.client_id, PERSONALIZE_STREAM),
        )

    return personalize


def body_rows(
    runner: TableRunner,
    body: str,
    lr: float,
    *,
    lambda_estimator: str = "val",
    heads: Sequence[str] = HEADS,
    progress: bool = False,
) -> dict[str, Any]:
    """Per-client rows of every head on `body` (trained at `lr`), and what kNN chose there;
    cached in OUT/attribution so a resumed or parallel table computes each body once."""
    cache = runner.out / "attribution" / f"{body}_lr_{lr:.4g}.json"
    identity = {"heads": list(heads), "lambda_estimator": lambda_estimator}
    cached = read_json_cache(cache)
    if cached is not None and cached.get("identity") == identity and "result" in cached:
        return cached["result"]
    result = _body_rows(runner, body, lr, lambda_estimator, heads, progress)
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(cache, {"identity": identity, "result": to_json_types(result)})
    return result


def _body_rows(
    runner: TableRunner,
    body: str,
    lr: float,
    lambda_estimator: str,
    heads: Sequence[str],
    progress: bool,
) -> dict[str, Any]:
    training = replace(runner.config.training, lr=lr)
    sim = runner.train(body, training)
    weights, states = sim.weights, sim.states
    out: dict[str, Any] = {"rows": {}, "knn": {}}
    for head in heads:
        if head == "own":
            out["rows"][head] = runner.rows(body, lr)
        elif head in ("linear", "gp"):
            algorithm = _head_algorithm(head, runner, training)
            out["rows"][head] = client_accuracies(
                algorithm,
                weights,
                states,
                runner.clients,
                seed=runner.config.seed,
                progress=progress,
            )
    knn_heads = [h for h in heads if h in ("knn", "knn+own")]
    if knn_heads:
        model = runner.model_fn()
        set_weights(model, weights)
        own = _own_personalizer(runner, body, training, weights, states)
        views = client_views(model, runner.clients, base_probs_of(own))
        for head in knn_heads:
            grid = {"lambdas": (1.0,)} if head == "knn" else {}  # "knn": the kNN alone
            config, scores = select_config(views, **grid)
            info: dict[str, Any] = {
                "config": config.to_dict(),
                "best_val_accuracy": max(s["val_accuracy"] for s in scores),
            }
            estimator = "val"
            if head == "knn+own":
                cv = compare_lambda_estimators(views, config, seed=runner.config.seed)
                info["lambda_cv"] = cv
                estimator = pick_estimator(cv) if lambda_estimator == "auto" else lambda_estimator
            info["estimator"] = estimator
            rows = client_rows(views, config, estimator=estimator, **grid)
            if head == "knn+own":
                info["lambda_report"] = lambda_report(rows)
            out["rows"][head] = rows
            out["knn"][head] = info
    return out


def attribution_table(
    runner: TableRunner,
    lrs: dict[str, float],
    *,
    lambda_estimator: str = "val",
    bodies: Sequence[str] = BODIES,
    progress: bool = False,
) -> dict[str, Any]:
    """Every head on every body: per-client rows, summaries (seen / unseen mean and bottom
    decile) and the kNN choices, keyed "BODY/HEAD"."""
    result: dict[str, Any] = {"summary": {}, "clients": [], "knn": {}, "lr": {}}
    for body in bodies:
        lr = lrs[body]
        result["lr"][body] = lr
        part = body_rows(runner, body, lr, lambda_estimator=lambda_estimator, progress=progress)
        for head, rows in part["rows"].items():
            key = f"{body}/{head}"
            result["summary"][key] = summarize(rows)
            for r in rows:
                # the kNN heads' honest lambda: a choice, kept so the leak test can compare it
                chosen = {"lambda": r["info"]["lambda"]} if "lambda" in r["info"] else {}
                result["clients"].append(
                    {
                        "body": body,
                        "head": head,
                        **client_fields(r),
                        **chosen,
                    }
                )
        for head, info in part["knn"].items():
            result["knn"][f"{body}/{head}"] = info
    return result


def format_attribution(result: dict[str, Any]) -> str:
    """Markdown: one row per head, one column group per body (seen mean / bottom decile and
    unseen mean / bottom decile, %)."""
    bodies = list(result["lr"])
    lines = [
        "## Attribution: every head on every body",
        "",
        "Cells: seen mean / seen bottom 10% / unseen mean / unseen bottom 10% (%). "
        "Bodies at their validation-chosen learning rate "
        f"({', '.join(f'{b} {lr:g}' for b, lr in result['lr'].items())}).",
        "",
        "| head | " + " | ".join(bodies) + " |",
        "|---|" + "---|" * len(bodies),
    ]

    def cell(key: str) -> str:
        s = result["summary"].get(key)
        if s is None:
            return "-"
        parts = []
        for group in ("seen", "unseen"):
            g = s.get(group)
            parts += (
                ["-", "-"]
                if g is None
                else [f"{100 * g['mean']:.1f}", f"{100 * g['bottom_decile']:.1f}"]
            )
        return " / ".join(parts)

    for head in HEADS:
        if not any(f"{b}/{head}" in result["summary"] for b in bodies):
            continue
        lines.append(f"| {head} | " + " | ".join(cell(f"{b}/{head}") for b in bodies) + " |")
    lines += [
        "",
        "kNN chosen on validation per body (k, sigma, normalisation; lambda "
        "estimator; honest vs test-oracle lambda):",
        "",
    ]
    for key, info in result["knn"].items():
        c = info["config"]
        line = (
            f"- {key}: k={c['k']}, sigma={c['sigma']:.3g}, {c['normalize']}, "
            f"lambda by {info['estimator']}"
        )
        report = info.get("lambda_report")
        if report and report.get("clients"):
            line += (
                f"; lambda differs from the oracle's for {report['differs']} of "
                f"{report['clients']} clients, costing {report['cost_pp']:.2f} pp "
                f"({100 * report['honest_mean']:.1f} vs {100 * report['oracle_mean']:.1f})"
            )
        if "lambda_cv" in info:
            line += "; 2-fold CV on validation: " + ", ".join(
                f"{k} {100 * v:.1f}" for k, v in info["lambda_cv"].items()
            )
        lines.append(line)
    return "\n".join(lines) + "\n"
