"""kNN-Per (Marfoq et al. 2022): FedAvg's global model, personalized by interpolating its output
with a kNN over the client's own embeddings. The kNN math is edge_runtime's, so the server reports
exactly what a device computes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from edge_runtime.knn import (
    DEFAULT_K,
    DEFAULT_NORMALIZE,
    DEFAULT_SIGMA,
    LAMBDA_ESTIMATORS,
    NORMALIZATIONS,
    KNNHead,
    LambdaRule,
    estimate_lambda,
    interpolate,
    leave_one_out_posteriors,
    normalize_embeddings,
    softmax,
)
from edge_runtime.linear_head import LinearHead
from fed_train.algorithms.base import (
    ClientData,
    PersonalModel,
    TrainingConfig,
    Weights,
    embed_and_logits,
)
from fed_train.algorithms.fedavg import FedAvg
from fed_train.models import EmbedHeadModel


def datastore_indices(n: int, capacity: float, seed: int) -> np.ndarray:
    """The training samples a client keeps: a seeded random `capacity` fraction (at least one)."""
    if not 0.0 < capacity <= 1.0:
        raise ValueError(f"capacity must be in (0, 1], got {capacity}")
    keep = max(1, int(round(capacity * n)))
    if keep >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=keep, replace=False))


class KNNPer(FedAvg):
    name = "knnper"

    def __init__(self, model_fn: Callable[[], EmbedHeadModel], training: TrainingConfig,
                 k: int = DEFAULT_K, sigma: float = DEFAULT_SIGMA, capacity: float = 1.0,
                 normalize: str = DEFAULT_NORMALIZE, lambda_estimator: str = "val",
                 lambda_rule: dict[str, Any] | None = None, base: str = "global",
                 l2: float | None = None) -> None:
        """`lambda_rule` is `LambdaRule.to_dict()`'s plain data (what a Flower message
        carries); None is each client's own lambda, the paper's rule. `base` is what the kNN
        is interpolated with: the global model, or ("linear") a linear head fitted with `l2`
        on the client's train embeddings, normalised as the kNN's are."""
        super().__init__(model_fn, training)
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if sigma <= 0:
            raise ValueError(f"sigma must be positive, got {sigma}")
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {', '.join(NORMALIZATIONS)}, "
                             f"got {normalize!r}")
        if lambda_estimator not in LAMBDA_ESTIMATORS:
            raise ValueError(f"lambda_estimator must be one of {', '.join(LAMBDA_ESTIMATORS)}, "
                             f"got {lambda_estimator!r}")
        self.k, self.sigma, self.capacity = k, sigma, capacity
        self.normalize, self.lambda_estimator = normalize, lambda_estimator
        self.lambda_rule = LambdaRule() if lambda_rule is None else \
            LambdaRule.from_dict(lambda_rule)
        if base not in ("global", "linear") or (base == "linear") != (l2 is not None and l2 > 0):
            raise ValueError(f"base must be 'global', or 'linear' with l2 > 0; got {base!r}, "
                             f"l2={l2}")
        self.base, self.l2 = base, l2

    def _choose_lambda(self, head: KNNHead, p_base_train: np.ndarray, z_val: np.ndarray,
                       p_base_val: np.ndarray, y_val: np.ndarray) -> float:
        loo = None
        if self.lambda_estimator == "loo+val":
            loo = (leave_one_out_posteriors(head.keys_, head.labels_, head.num_classes, self.k,
                                            self.sigma), p_base_train, head.labels_)
        return estimate_lambda(self.lambda_estimator, head.predict_proba(z_val), p_base_val,
                               y_val, loo, rule=self.lambda_rule)

    def _base(self, num_classes: int, z_train: np.ndarray,
              y_train: np.ndarray) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        """The client's base predictor from (raw embeddings, logits): the global model's softmax,
        or its own linear head on the embeddings normalised as the kNN's are (what the exported
        encoder's "embedding" output gives it on the device)."""
        if self.base == "global" or len(y_train) == 0:
            return lambda z, logits: softmax(logits.astype(np.float64))
        linear = LinearHead(num_classes, l2=self.l2).fit(
            normalize_embeddings(z_train, self.normalize), y_train)
        return lambda z, logits: linear.predict_proba(normalize_embeddings(z, self.normalize))

    def personalize(self, global_weights: Weights, client: ClientData, state: dict[str, Any],
                    seed: int) -> PersonalModel:
        model = self.global_model(global_weights)
        num_classes = model.classifier.out_features
        y_all = client.y_train.cpu().numpy()
        keep = datastore_indices(client.num_train, self.capacity, seed)
        z_all, logits_all = embed_and_logits(model, client.x_train)
        base = self._base(num_classes, z_all, y_all)
        z_train, logits_train = z_all[keep], logits_all[keep]
        head = KNNHead(num_classes, self.k, self.sigma).fit(
            normalize_embeddings(z_train, self.normalize), y_all[keep])
        z_val, logits_val = embed_and_logits(model, client.x_val)
        lam = self._choose_lambda(head, base(z_train, logits_train),
                                  normalize_embeddings(z_val, self.normalize),
                                  base(z_val, logits_val), client.y_val.cpu().numpy())

        def predict(x: torch.Tensor) -> np.ndarray:
            z, logits = embed_and_logits(model, x)
            return interpolate(head.predict_proba(normalize_embeddings(z, self.normalize)),
                               base(z, logits), lam)

        return PersonalModel(predict, {"lambda": lam, "datastore_size": int(len(keep))})
