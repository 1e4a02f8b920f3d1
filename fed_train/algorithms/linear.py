"""FedAvg + local linear head: FedAvg's global model, whose head each client replaces by a
multinomial logistic regression fitted on its own train embeddings (edge_runtime's numpy head,
the one a device fits). The simplest personalization of a shared body, and the baseline kNN-Per
must beat."""

from __future__ import annotations

import numpy as np
import torch

from edge_runtime.linear_head import DEFAULT_L2, LinearHead
from fed_train.algorithms.base import (
    ClientData,
    ClientState,
    PersonalModel,
    Weights,
    embed_and_logits,
)
from fed_train.algorithms.fedavg import FedAvg
from fed_train.models import ModelFactory
from fed_train.training_config import TrainingConfig


class LinearPer(FedAvg):
    name = "linear"
    title = "FedAvg + linear head"
    trained_by = "fedavg"

    def __init__(
        self, model_fn: ModelFactory, training: TrainingConfig, l2: float = DEFAULT_L2
    ) -> None:
        super().__init__(model_fn, training)
        if not l2 > 0:
            raise ValueError(f"l2 must be positive, got {l2}")
        self.l2 = l2

    def personalize(
        self, global_weights: Weights, client: ClientData, state: ClientState, seed: int
    ) -> PersonalModel:
        if client.num_train == 0:  # nothing to fit: the global model is all the client has
            personal = super().personalize(global_weights, client, state, seed)
            personal.info["l2"] = None
            return personal
        model = self.global_model(global_weights)
        z_train, _ = embed_and_logits(model, client.x_train)
        head = LinearHead(model.classifier.out_features, l2=self.l2).fit(
            z_train, client.y_train.cpu().numpy()
        )

        def predict(x: torch.Tensor) -> np.ndarray:
            return head.predict_proba(embed_and_logits(model, x)[0])

        return PersonalModel(predict, {"l2": self.l2, "head_bytes": head.nbytes})
