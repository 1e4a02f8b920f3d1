"""A toy baseline in one file, for the registry's test and docs/extending.md's recipe: FedAvg's
body with each client's class means as its head (nearest class mean in embedding space)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fed_train.algorithms.base import ClientData, PersonalModel, Weights, embed_and_logits
from fed_train.algorithms.fedavg import FedAvg


class NearestCentroid(FedAvg):
    name = "centroid"
    title = "FedAvg + class means"
    trained_by = "fedavg"  # personalizes FedAvg's run instead of training its own

    def personalize(
        self, global_weights: Weights, client: ClientData, state: dict[str, Any], seed: int
    ) -> PersonalModel:
        model = self.global_model(global_weights)
        z, _ = embed_and_logits(model, client.x_train)
        y = client.y_train.cpu().numpy()
        classes = np.unique(y)
        means = np.stack([z[y == c].mean(axis=0) for c in classes])
        num_classes = model.classifier.out_features

        def predict(x: torch.Tensor) -> np.ndarray:
            distances = ((embed_and_logits(model, x)[0][:, None, :] - means) ** 2).sum(-1)
            proba = np.zeros((len(distances), num_classes))
            proba[np.arange(len(distances)), classes[distances.argmin(axis=1)]] = 1.0
            return proba

        return PersonalModel(predict, {"classes": len(classes)})
