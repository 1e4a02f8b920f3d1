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
    batch_schedule,
    get_weights,
    local_sgd,
    model_predictor,
    set_weights,
)
from fed_train.algorithms.stepping import (
    Lane,
    as_params,
    as_weights,
    cross_entropy_loss,
    step_together,
    stepping_blocker,
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

    def stepping_blocker(self) -> str | None:
        return stepping_blocker(self._work)

    def global_lanes(self, global_weights: Weights, clients: list[ClientData],
                     seeds: list[int]) -> list[Lane]:
        """One lane per client: the global model trained as `client_update` trains it."""
        names = [name for name, _ in self._work.named_parameters()]
        start = as_params(global_weights, names, clients[0].x_train.device)
        return [Lane(start, {}, c.x_train, c.y_train,
                     list(batch_schedule(c.num_train, self.training, seed)))
                for c, seed in zip(clients, seeds, strict=True)]

    def client_updates(self, global_weights: Weights, clients: list[ClientData],
                       states: list[dict[str, Any]], lr: float,
                       seeds: list[int]) -> list[ClientResult]:
        """`client_update` for several clients, stepped together."""
        trained, losses = step_together(cross_entropy_loss(self._work),
                                        self.global_lanes(global_weights, clients, seeds),
                                        self.training, lr)
        return [ClientResult({**global_weights, **as_weights(p)}, c.num_train, state, loss)
                for p, c, state, loss in zip(trained, clients, states, losses, strict=True)]

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
