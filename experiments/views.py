"""Each client's embeddings and global-model logits under one global model, computed once and
swept many times: capacity, k, sigma and lambda change only the kNN part. The kNN head, the
lambda estimator and the datastore sample are those of `knnper evaluate` (edge_runtime.knn and
KNNPer's seeded datastore_indices), so a point at capacity 1 with the run's chosen configuration
is exactly the kNN-Per of `knnper evaluate`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_runtime.knn import (
    DEFAULT_NORMALIZE,
    KNNHead,
    estimate_lambda,
    interpolate,
    leave_one_out_posteriors,
    normalize_embeddings,
    softmax,
)
from fed_train.algorithms.base import ClientData, embed_and_logits
from fed_train.algorithms.knnper import datastore_indices
from fed_train.evaluation import summarize
from fed_train.models import EmbedHeadModel
from fed_train.simulation import PERSONALIZE_STREAM, client_seed


@dataclass
class ClientView:
    client_id: int
    unseen: bool
    z_train: np.ndarray
    y_train: np.ndarray
    z_val: np.ndarray
    p_global_val: np.ndarray
    y_val: np.ndarray
    z_test: np.ndarray
    p_global_test: np.ndarray
    y_test: np.ndarray
    p_global_train: np.ndarray  # for the "loo+val" lambda estimator

    @property
    def n_train(self) -> int:
        return len(self.y_train)


def client_views(model: EmbedHeadModel, clients: Sequence[ClientData], *,
                 normalize: str = DEFAULT_NORMALIZE) -> list[ClientView]:
    """Embeddings normalised as kNN-Per's configuration says (keys and queries alike)."""
    views = []
    for c in clients:
        z_train, logits_train = embed_and_logits(model, c.x_train)
        z_val, logits_val = embed_and_logits(model, c.x_val)
        z_test, logits_test = embed_and_logits(model, c.x_test)
        views.append(ClientView(c.client_id, c.unseen, normalize_embeddings(z_train, normalize),
                                c.y_train.cpu().numpy(), normalize_embeddings(z_val, normalize),
                                _probabilities(logits_val), c.y_val.cpu().numpy(),
                                normalize_embeddings(z_test, normalize),
                                _probabilities(logits_test), c.y_test.cpu().numpy(),
                                _probabilities(logits_train)))
    return views


def _probabilities(logits: np.ndarray) -> np.ndarray:
    return softmax(logits.astype(np.float64)) if logits.size else logits.astype(np.float64)


@dataclass
class KnnOutcome:
    """One client's kNN posterior on its test split and the lambda its validation split chose."""

    lam: float
    stored: int
    p_knn_test: np.ndarray

    def accuracy(self, view: ClientView, lam: float | None = None) -> float | None:
        if not len(view.y_test):
            return None
        p = interpolate(self.p_knn_test, view.p_global_test, self.lam if lam is None else lam)
        return float(np.mean(p.argmax(axis=1) == view.y_test))


def knn_outcome(view: ClientView, num_classes: int, *, k: int, sigma: float, capacity: float,
                seed: int, estimator: str = "val") -> KnnOutcome:
    """kNN-Per for one client, datastore = the seeded `capacity` fraction of its train split."""
    keep = datastore_indices(view.n_train, capacity,
                             client_seed(seed, 0, view.client_id, PERSONALIZE_STREAM))
    head = KNNHead(num_classes, k, sigma).fit(view.z_train[keep], view.y_train[keep])
    lam = 0.5
    if len(view.y_val):
        loo = None
        if estimator == "loo+val":
            loo = (leave_one_out_posteriors(head.keys_, head.labels_, num_classes, k, sigma),
                   view.p_global_train[keep], head.labels_)
        lam = estimate_lambda(estimator, head.predict_proba(view.z_val), view.p_global_val,
                              view.y_val, loo)
    p_test = head.predict_proba(view.z_test) if len(view.y_test) else view.p_global_test
    return KnnOutcome(lam, len(keep), p_test)


def global_accuracy(view: ClientView) -> float | None:
    if not len(view.y_test):
        return None
    return float(np.mean(view.p_global_test.argmax(axis=1) == view.y_test))


def row(view: ClientView, accuracy: float | None, **info: Any) -> dict[str, Any]:
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


def knnper_rows(views: Sequence[ClientView], num_classes: int, *, k: int, sigma: float,
                seed: int, capacity: float | dict[int, float] = 1.0,
                estimator: str = "val") -> list[dict[str, Any]]:
    """kNN-Per on every client (lambda chosen on validation); `capacity` may differ per client
    (a dict by client id)."""
    rows = []
    for view in views:
        cap = capacity[view.client_id] if isinstance(capacity, dict) else capacity
        outcome = knn_outcome(view, num_classes, k=k, sigma=sigma, capacity=cap, seed=seed,
                              estimator=estimator)
        rows.append(row(view, outcome.accuracy(view), **{"lambda": outcome.lam,
                                                         "datastore_size": outcome.stored,
                                                         "n_train": view.n_train}))
    return rows


def fedavg_rows(views: Sequence[ClientView]) -> list[dict[str, Any]]:
    return [row(view, global_accuracy(view)) for view in views]
