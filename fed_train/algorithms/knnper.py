"""kNN-Per (Marfoq et al. 2022): FedAvg's global model, personalized by interpolating its output
with a kNN over the client's own embeddings. The kNN math is edge_runtime's, so the server reports
exactly what a device computes."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from edge_runtime.knn import (
    CLIENT_RULE,
    DEFAULT_K,
    DEFAULT_NORMALIZE,
    DEFAULT_SIGMA,
    LambdaRule,
    softmax,
)
from edge_runtime.personal_head import ClientSplits
from fed_train.algorithms.base import (
    ClientData,
    PersonalModel,
    TrainingConfig,
    Weights,
    embed_and_logits,
)
from fed_train.algorithms.fedavg import FedAvg
from fed_train.knn_setting import KNNChoice, KNNConfig
from fed_train.models import ModelFactory


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
    title = "kNN-Per"
    trained_by = "fedavg"

    def __init__(
        self,
        model_fn: ModelFactory,
        training: TrainingConfig,
        k: int = DEFAULT_K,
        sigma: float = DEFAULT_SIGMA,
        capacity: float = 1.0,
        normalize: str = DEFAULT_NORMALIZE,
        lambda_estimator: str = "val",
        lambda_rule: dict[str, Any] | None = None,
        base: str = "global",
        l2: float | None = None,
    ) -> None:
        """`lambda_rule` is `LambdaRule.to_dict()`'s plain data (what a Flower message
        carries); None is each client's own lambda, the paper's rule. `base` is what the kNN
        is interpolated with: the global model, or ("linear") a linear head fitted with `l2`
        on the client's train embeddings, normalised as the kNN's are."""
        super().__init__(model_fn, training)
        self.choice = KNNChoice(
            KNNConfig(k, sigma, normalize),
            lambda_estimator,
            lambda_rule=CLIENT_RULE if lambda_rule is None else LambdaRule.from_dict(lambda_rule),
            base=base,
            l2=l2,
        )
        self.capacity = capacity

    def personalize(
        self, global_weights: Weights, client: ClientData, state: dict[str, Any], seed: int
    ) -> PersonalModel:
        model = self.global_model(global_weights)
        num_classes = model.classifier.out_features
        z_train, logits_train = embed_and_logits(model, client.x_train)
        z_val, logits_val = embed_and_logits(model, client.x_val)
        splits = ClientSplits.from_logits(
            client.client_id,
            client.unseen,
            (z_train, logits_train, client.y_train.cpu().numpy()),
            (z_val, logits_val, client.y_val.cpu().numpy()),
        )
        head = self.choice.head(num_classes)
        head.fit(splits, keep=datastore_indices(client.num_train, self.capacity, seed))

        def predict(x: torch.Tensor) -> np.ndarray:
            z, logits = embed_and_logits(model, x)
            return head.predict_proba(z, softmax(logits.astype(np.float64)))

        return PersonalModel(predict, {"lambda": head.lambda_, "datastore_size": head.stored_})
