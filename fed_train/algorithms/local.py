"""Local training: every client learns alone, with the epoch budget it would spend in FedAvg."""

from __future__ import annotations

import torch

from fed_train.algorithms.base import (
    ClientData,
    ClientState,
    PersonalModel,
    Weights,
    local_sgd,
    model_predictor,
)
from fed_train.models import ModelFactory
from fed_train.training_config import TrainingConfig


class Local:
    """Not federated: the simulation loop skips it and all the work is in `personalize`."""

    name = "local"
    title = "Local"
    federated = False
    trained_by = None
    job_cost = 1.0

    def __init__(self, model_fn: ModelFactory, training: TrainingConfig) -> None:
        self.model_fn = model_fn
        self.training = training
        self.epochs = training.participations * training.epochs

    def personalize(
        self, global_weights: Weights, client: ClientData, state: ClientState, seed: int
    ) -> PersonalModel:
        torch.manual_seed(seed)
        model = self.model_fn()
        for epoch in range(self.epochs):
            lr = self.training.lr_at(epoch, self.epochs)
            local_sgd(
                model, client.x_train, client.y_train, self.training, lr, seed + epoch, epochs=1
            )
        model.eval()
        return PersonalModel(model_predictor(model), {"epochs": self.epochs})
