"""Each client's embeddings and global-model logits under one global model, computed once and
swept many times: capacity, k, sigma and lambda change only the kNN part. The personal head
and the datastore sample are those of `knnper evaluate` (edge_runtime.personal_head and KNNPer's
seeded datastore_indices), so a point at capacity 1 with the run's chosen configuration is
exactly the kNN-Per of `knnper evaluate`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from edge_runtime.knn import CLIENT_RULE
from edge_runtime.personal_head import ClientSplits, PersonalHead
from fed_train.algorithms.knnper import datastore_indices
from fed_train.evaluation import summarize
from fed_train.knn_setting import KNNChoice
from fed_train.knn_tuning import choosing_views, fit_rule
from fed_train.simulation import PERSONALIZE_STREAM, client_seed


def knn_head(
    view: ClientSplits, num_classes: int, choice: KNNChoice, *, capacity: float, seed: int
) -> PersonalHead:
    """kNN-Per for one client under `choice` (its k, sigma, estimator and base) on a view
    normalised as it says (`client_views`), datastore = the seeded `capacity` fraction of its
    train split (KNNPer's own sample), lambda chosen on its validation split by its own
    evidence: the choice's rule is fitted over every client's after (`pooled_heads`)."""
    keep = datastore_indices(
        view.n_train, capacity, client_seed(seed, 0, view.client_id, PERSONALIZE_STREAM)
    )
    return choice.head(num_classes, normalized=True, rule=CLIENT_RULE).fit(view, keep=keep)


def pooled_heads(
    views: Sequence[ClientSplits], heads: Sequence[PersonalHead], rule: str
) -> list[PersonalHead]:
    """The heads with lambda chosen by `rule`, its pooled evidence summed over the seen
    clients' own (each head's `evidence_`, which no rule changes) at this very point: a pooled
    rule is fitted wherever k, sigma or the capacity differ, as the server fits it once for the
    chosen configuration."""
    if rule == "client":
        return list(heads)
    seen = {v.client_id for v in choosing_views(views)}
    fitted = fit_rule(
        rule,
        [
            h.evidence_
            for v, h in sorted(zip(views, heads, strict=True), key=lambda vh: vh[0].client_id)
            if v.client_id in seen
        ],
    )
    return [h.with_lambda(fitted.choose_from_counts(h.evidence_)) for h in heads]


def accuracy_on_test(head: PersonalHead, view: ClientSplits) -> float | None:
    return head.accuracy(view.z_test, view.p_test, view.y_test)


def global_accuracy(view: ClientSplits) -> float | None:
    if not len(view.y_test):
        return None
    return float(np.mean(view.p_test.argmax(axis=1) == view.y_test))


def row(view: ClientSplits, accuracy: float | None, **info: Any) -> dict[str, Any]:
    """A per-client row in evaluation.client_accuracies' form, so its summaries apply."""
    return {
        "client_id": view.client_id,
        "unseen": view.unseen,
        "n_test": len(view.y_test),
        "accuracy": accuracy,
        "info": info,
    }


def summary_fields(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean (weighted by test size) and bottom decile for seen, unseen and all clients."""
    out: dict[str, Any] = {}
    pooled = summarize([{**r, "unseen": False} for r in rows])["seen"]
    for group, s in (*summarize(rows).items(), ("all", pooled)):
        out[f"{group}_mean"] = None if s is None else s["mean"]
        out[f"{group}_bottom_decile"] = None if s is None else s["bottom_decile"]
        out[f"{group}_clients"] = 0 if s is None else s["clients"]
    return out


def choice_rows(
    views: Sequence[ClientSplits],
    num_classes: int,
    choice: KNNChoice,
    *,
    seed: int,
    capacity: float | dict[int, float] = 1.0,
    k: int | None = None,
    sigma: float | None = None,
) -> list[dict[str, Any]]:
    """kNN-Per on every client under a run's kNN choice (lambda chosen on validation by its
    rule, base the global model or each client's linear head); `capacity` may differ per
    client (a dict by id); `k` / `sigma` override the choice's (the k-sigma sweep)."""
    config = replace(
        choice.config,
        k=choice.config.k if k is None else k,
        sigma=choice.config.sigma if sigma is None else sigma,
    )
    choice = replace(choice, config=config)
    heads = [
        knn_head(
            view,
            num_classes,
            choice,
            seed=seed,
            capacity=capacity[view.client_id] if isinstance(capacity, dict) else capacity,
        )
        for view in views
    ]
    return [
        row(
            view,
            accuracy_on_test(head, view),
            **{"lambda": head.lambda_, "datastore_size": head.stored_, "n_train": view.n_train},
        )
        for view, head in zip(
            views, pooled_heads(views, heads, choice.lambda_rule.name), strict=True
        )
    ]


def fedavg_rows(views: Sequence[ClientSplits]) -> list[dict[str, Any]]:
    return [row(view, global_accuracy(view)) for view in views]
