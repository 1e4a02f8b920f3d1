"""FedAvg+ (FedAvg with local tuning, Jiang et al. 2019): FedAvg's global model, fine-tuned by
each client with a few epochs of local SGD when it personalizes, seen and unseen clients alike.

Training is FedAvg's, unchanged, so a benchmark can personalize one FedAvg run three ways
(FedAvg, FedAvg+, kNN-Per). The fine-tuning budget is an upper bound: each client keeps the
number of epochs (0 .. finetune_epochs) its validation split prefers, the same kind of
per-client choice kNN-Per makes for its lambda; `select_on_validation=False` always runs them all.
"""

from __future__ import annotations

from fed_train.algorithms.base import (
    ClientData,
    ClientState,
    PersonalModel,
    Weights,
    model_predictor,
)
from fed_train.algorithms.fedavg import FedAvg
from fed_train.algorithms.personal import finetune, finetune_settings
from fed_train.models import ModelFactory
from fed_train.training_config import TrainingConfig


class FedAvgPlus(FedAvg):
    name = "fedavg+"
    title = "FedAvg+"
    trained_by = "fedavg"

    def __init__(
        self,
        model_fn: ModelFactory,
        training: TrainingConfig,
        finetune_epochs: int = 3,
        finetune_lr: float | None = None,
        select_on_validation: bool = True,
    ) -> None:
        super().__init__(model_fn, training)
        self.finetune_epochs, self.finetune_lr = finetune_settings(
            finetune_epochs, finetune_lr, training
        )
        self.select_on_validation = select_on_validation

    def personalize(
        self, global_weights: Weights, client: ClientData, state: ClientState, seed: int
    ) -> PersonalModel:
        model = self.global_model(global_weights)
        epochs, _ = finetune(
            model,
            client,
            self.training,
            self.finetune_lr,
            self.finetune_epochs,
            seed,
            select_on_validation=self.select_on_validation,
        )
        return PersonalModel(model_predictor(model), {"finetune_epochs": epochs})
