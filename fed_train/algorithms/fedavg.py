"""FedAvg (McMahan et al. 2017) with the kNN-Per paper's aggregation rule; its personalization is
the global model itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fed_train.algorithms.base import (
    ClientData,
    ClientResult,
    PersonalModel,
    TrainingConfig,
    Weights,
    aggregate_weights,
    get_weights,
    local_sgd,
    model_predictor,
    set_weights,
)
from fed_train.models import EmbedHeadModel


class FedAvg:
    name = "fedavg"
    federated = True

    def __init__(self, model_fn: Callable[[], EmbedHeadModel], training: TrainingConfig) -> None:
        self.model_fn = model_fn
        self.training = training
        self._work = model_fn()  # reused across clients: one model's memory, not one per client

    def client_update(self, global_weights: Weights, client: ClientData, state: dict[str, Any],
                      lr: float, seed: int) -> ClientResult:
        set_weights(self._work, global_weights)
        loss = local_sgd(self._work, client.x_train, client.y_train, self.training, lr, seed)
        return ClientResult(get_weights(self._work), client.num_train, state, loss)

    def aggregate(self, global_weights: Weights, results: list[ClientResult],
                  total_samples: int, seed: int) -> Weights:
        return aggregate_weights(global_weights, [(r.weights, r.num_samples) for r in results],
                                 total_samples)

    def global_model(self, global_weights: Weights) -> EmbedHeadModel:
        model = self.model_fn()
        set_weights(model, global_weights)
        model.eval()
        return model

    def personalize(self, global_weights: Weights, client: ClientData, state: dict[str, Any],
                    seed: int) -> PersonalModel:
        return PersonalModel(model_predictor(self.global_model(global_weights)))
