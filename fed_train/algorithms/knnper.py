"""kNN-Per (Marfoq et al. 2022): FedAvg's global model, personalized by interpolating its output
with a kNN over the client's own embeddings. The kNN math is edge_runtime's, so the server reports
exactly what a device computes."""

from __future__ import annotations

import numpy as np
import torch

from edge_runtime.knn import softmax
from edge_runtime.personal_head import ClientSplits
from fed_train.algorithms.base import (
    ClientData,
    ClientState,
    PersonalModel,
    Weights,
    embed_and_logits,
)
from fed_train.algorithms.fedavg import FedAvg
from fed_train.knn_setting import KNNChoice
from fed_train.models import ModelFactory
from fed_train.training_config import TrainingConfig


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
        choice: KNNChoice | None = None,
        capacity: float = 1.0,
    ) -> None:
        """`choice`: the setting every client personalizes with (None: the paper's);
        `capacity`: the share of its train samples a client keeps (`datastore_indices`)."""
        super().__init__(model_fn, training)
        self.choice = KNNChoice() if choice is None else choice
        self.capacity = capacity

    def personalize(
        self, global_weights: Weights, client: ClientData, state: ClientState, seed: int
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
