"""FedAvg (McMahan et al. 2017) with the kNN-Per paper's aggregation rule; its personalization is
the global model itself."""

from __future__ import annotations

from typing import Any

from fed_train.algorithms.base import (
    ClientData,
    ClientResult,
    FederatedAlgorithm,
    PersonalModel,
    Weights,
    batch_schedule,
    model_predictor,
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


class FedAvg(FederatedAlgorithm):
    name = "fedavg"

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

    def global_model(self, global_weights: Weights) -> EmbedHeadModel:
        """The global model, in eval mode. The simulation reports the pooled validation accuracy
        of the methods that have one at each checkpoint (not of ClusteredFL's clusters, FedRep's
        personal heads or pFedGP's GPs, which have none)."""
        return self.model_with(global_weights)

    def personalize(self, global_weights: Weights, client: ClientData, state: dict[str, Any],
                    seed: int) -> PersonalModel:
        return PersonalModel(model_predictor(self.global_model(global_weights)))
