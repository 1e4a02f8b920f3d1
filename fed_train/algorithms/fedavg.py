"""FedAvg (McMahan et al. 2017) with the kNN-Per paper's aggregation rule; its personalization is
the global model itself."""

from __future__ import annotations

from fed_train.algorithms.base import (
    ClientData,
    ClientState,
    PersonalModel,
    Weights,
    model_predictor,
)
from fed_train.algorithms.stepped import SteppedAlgorithm
from fed_train.models import EmbedHeadModel


class FedAvg(SteppedAlgorithm):
    name = "fedavg"
    title = "FedAvg"
    job_cost = 1.5

    def global_model(self, global_weights: Weights) -> EmbedHeadModel:
        """The global model, in eval mode. The simulation reports the pooled validation accuracy
        of the methods that have one at each checkpoint (not of ClusteredFL's clusters, FedRep's
        personal heads or pFedGP's GPs, which have none)."""
        return self.model_with(global_weights)

    def personalize(
        self, global_weights: Weights, client: ClientData, state: ClientState, seed: int
    ) -> PersonalModel:
        return PersonalModel(model_predictor(self.global_model(global_weights)))
