"""Each client's embeddings and global-model logits under one global model, computed once and
swept many times: capacity, k, sigma and lambda change only the kNN part. The personal head
and the datastore sample are those of `knnper evaluate` (edge_runtime.personal_head and KNNPer's
seeded datastore_indices), so a point at capacity 1 with the run's chosen configuration is
exactly the kNN-Per of `knnper evaluate`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from edge_runtime.knn import DEFAULT_NORMALIZE
from edge_runtime.personal_head import ClientSplits, PersonalHead
from fed_train.algorithms.base import ClientData
from fed_train.algorithms.knnper import datastore_indices
from fed_train.evaluation import summarize
from fed_train.knn_tuning import client_views as embedded_views
from fed_train.knn_tuning import normalized_views
from fed_train.models import EmbedHeadModel
from fed_train.simulation import PERSONALIZE_STREAM, client_seed


def client_views(model: EmbedHeadModel, clients: Sequence[ClientData], *,
                 normalize: str = DEFAULT_NORMALIZE) -> list[ClientSplits]:
    """Embeddings normalised as kNN-Per's configuration says (keys and queries alike), once
    for every sweep over them."""
    return normalized_views(embedded_views(model, clients), normalize)


def knn_head(view: ClientSplits, num_classes: int, *, k: int, sigma: float, capacity: float,
             seed: int, estimator: str = "val") -> PersonalHead:
    """kNN-Per for one client, datastore = the seeded `capacity` fraction of its train split
    (KNNPer's own sample), lambda chosen on its validation split."""
    keep = datastore_indices(view.n_train, capacity,
                             client_seed(seed, 0, view.client_id, PERSONALIZE_STREAM))
    return PersonalHead(num_classes, k=k, sigma=sigma, estimator=estimator).fit(view, keep=keep)


def accuracy_on_test(head: PersonalHead, view: ClientSplits) -> float | None:
    return head.accuracy(view.z_test, view.p_test, view.y_test)


def global_accuracy(view: ClientSplits) -> float | None:
    if not len(view.y_test):
        return None
    return float(np.mean(view.p_test.argmax(axis=1) == view.y_test))


def row(view: ClientSplits, accuracy: float | None, **info: Any) -> dict[str, Any]:
    """A per-client row in evaluation.client_accuracies' form, so its summaries apply."""
    return {"client_id": view.client_id, "unseen": view.unseen, "n_test": len(view.y_test),
            "accuracy": accuracy, "info": info}


def summary_fields(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean (weighted by test size) and bottom decile for seen, unseen and all clients."""
    out: dict[str, Any] = {}
    pooled = summarize([{**r, "unseen": False} for r in rows])["seen"]
    for group, s in (*summarize(rows).items(), ("all", pooled)):
        out[f"{group}_mean"] = None if s is None else s["mean"]
        out[f"{group}_bottom_decile"] = None if s is None else s["bottom_decile"]
        out[f"{group}_clients"] = 0 if s is None else s["clients"]
    return out


def knnper_rows(views: Sequence[ClientSplits], num_classes: int, *, k: int, sigma: float,
                seed: int, capacity: float | dict[int, float] = 1.0,
                estimator: str = "val") -> list[dict[str, Any]]:
    """kNN-Per on every client (lambda chosen on validation); `capacity` may differ per client
    (a dict by client id)."""
    rows = []
    for view in views:
        cap = capacity[view.client_id] if isinstance(capacity, dict) else capacity
        head = knn_head(view, num_classes, k=k, sigma=sigma, capacity=cap, seed=seed,
                        estimator=estimator)
        rows.append(row(view, accuracy_on_test(head, view), **{"lambda": head.lambda_,
                                                            "datastore_size": head.stored_,
                                                            "n_train": view.n_train}))
    return rows


def fedavg_rows(views: Sequence[ClientSplits]) -> list[dict[str, Any]]:
    return [row(view, global_accuracy(view)) for view in views]
