"""Ditto (Li et al. 2021): FedAvg for the global model w, plus a personal model v per client that
minimises its local loss + (lambda/2) ||v - w||^2, with lambda chosen per client on validation.

- The global half is FedAvg's client step and aggregation, unchanged (same seed, same weights).
- In each round a participating client also trains one personal model per lambda in `lambdas`
  (the paper's grid {10, 1, 0.1, 0.01}) for the same epochs, pulled towards the w it received;
  personalization keeps the lambda whose model is best on the client's validation split. This is
  the faithful choice and costs one extra SGD pass per lambda; a shorter `lambdas` is cheaper.
- The proximal term is applied as an exact proximal step after each SGD step,
  v <- (v + lr * lambda * w) / (1 + lr * lambda), instead of adding lambda (v - w) to the
  gradient: the same first-order update, but stable for every lr * lambda (lr = 10^-0.5 with
  lambda = 10 diverges with the gradient form) and exactly v = w as lambda -> infinity.
- Personal models live in the client state as {"personal": {str(lambda): weights}}.
- A client without a personal model (unseen, or never sampled) fine-tunes one per lambda from
  the global model with the same proximal step for `finetune_epochs` epochs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch

from fed_train.algorithms.base import (
    ClientData,
    ClientResult,
    ClientState,
    Weights,
    get_weights,
    local_sgd,
    set_weights,
    sub_seed,
)
from fed_train.algorithms.personal import epochs_only
from fed_train.algorithms.personal_grid import PersonalGrid
from fed_train.algorithms.stepped import Cohort
from fed_train.algorithms.stepping import Params
from fed_train.models import ModelFactory
from fed_train.training_config import TrainingConfig

DITTO_LAMBDAS: tuple[float, ...] = (10.0, 1.0, 0.1, 0.01)


def pull(lr: float, lam: float) -> float:
    """How far the proximal step moves v towards w: t = lr lam / (1 + lr lam), 1 at infinity."""
    shrink = lr * lam
    return 1.0 if math.isinf(shrink) else shrink / (1.0 + shrink)


class Ditto(PersonalGrid):
    name = "ditto"
    title = "Ditto"
    job_cost = 5.0
    key = "lambda"
    rule = "Ditto lambda must be >= 0"

    def __init__(
        self,
        model_fn: ModelFactory,
        training: TrainingConfig,
        lambdas: Sequence[float] = DITTO_LAMBDAS,
        finetune_epochs: int = 3,
        finetune_lr: float | None = None,
    ) -> None:
        super().__init__(model_fn, training, lambdas, finetune_epochs, finetune_lr)
        self._personal = model_fn()

    def allows(self, value: float) -> bool:
        return value >= 0

    def _prox_step(
        self, model: torch.nn.Module, anchor: Weights, lam: float, lr: float
    ) -> Callable[[], None]:
        """v <- argmin_u ||u - v||^2 / (2 lr) + lam/2 ||u - w||^2 = v + t (w - v) with
        t = lr lam / (1 + lr lam), applied in place."""
        t = pull(lr, lam)
        targets = {
            name: torch.from_numpy(np.asarray(anchor[name])).to(p.device)
            for name, p in model.named_parameters()
        }

        @torch.no_grad()
        def step() -> None:
            if t == 0.0:
                return
            for name, p in model.named_parameters():
                p.lerp_(targets[name], t)

        return step

    def _train_personal(
        self,
        start: Weights,
        anchor: Weights,
        client: ClientData,
        lam: float,
        training: TrainingConfig,
        lr: float,
        seed: int,
        epochs: int | None = None,
    ) -> Weights:
        set_weights(self._personal, start)
        local_sgd(
            self._personal,
            client.x_train,
            client.y_train,
            training,
            lr,
            seed,
            epochs=epochs,
            after_step=self._prox_step(self._personal, anchor, lam, lr),
        )
        return get_weights(self._personal)

    def client_update(
        self, global_weights: Weights, client: ClientData, state: ClientState, lr: float, seed: int
    ) -> ClientResult:
        result = super().client_update(global_weights, client, state, lr, seed)
        starts = self.starts(state, global_weights)
        personal = [
            self._train_personal(
                start, global_weights, client, lam, self.training, lr, sub_seed(seed, i)
            )
            for i, (lam, start) in enumerate(zip(self.grid, starts, strict=True))
        ]
        return replace(result, state=self.personal_state(personal))

    def client_updates(
        self, global_weights: Weights, cohort: Cohort, lr: float
    ) -> list[ClientResult]:
        """`client_update` for several clients: their global models and every personal model
        (one per client and lambda) step together, the personal ones pulled towards w by the
        same proximal step after each SGD step."""
        device = cohort.device
        anchor = self.params(global_weights, device)
        lanes = [
            self.lane(anchor, client, seed)
            for client, seed in zip(cohort.clients, cohort.seeds, strict=True)
        ]
        pulls = [0.0] * len(lanes)  # lerp by 0 leaves the global lanes exactly as they are
        for client, state, seed in cohort:
            for i, (lam, start) in enumerate(
                zip(self.grid, self.starts(state, global_weights), strict=True)
            ):
                lanes.append(self.lane(self.params(start, device), client, sub_seed(seed, i)))
                pulls.append(pull(lr, lam))
        toward = torch.tensor(pulls, device=device)

        def proximal(params: Params, which: slice) -> Params:
            weight = toward[which]
            return {
                name: torch.lerp(p, anchor[name], weight.view(-1, *([1] * anchor[name].dim())))
                for name, p in params.items()
            }

        trained, losses = self.step(lanes, lr, after_step=proximal)
        results, k, per = [], len(cohort.clients), len(self.grid)
        for j, client in enumerate(cohort.clients):
            own = trained[k + j * per : k + (j + 1) * per]
            personal = self.personal_state({**global_weights, **w} for w in own)
            results.append(
                ClientResult(
                    {**global_weights, **trained[j]}, client.num_train, personal, losses[j]
                )
            )
        return results

    def fine_tune(
        self, global_weights: Weights, client: ClientData, state: ClientState, seed: int
    ) -> list[Weights]:
        """The missing personal models, each fine-tuned from the global model with the same
        proximal step for `finetune_epochs` epochs."""
        return [
            self._train_personal(
                start,
                global_weights,
                client,
                lam,
                epochs_only(self.training),
                self.finetune_lr,
                sub_seed(seed, i),
                epochs=self.finetune_epochs,
            )
            if new
            else start
            for i, (lam, start, new) in enumerate(
                zip(self.grid, self.starts(state, global_weights), self.fresh(state), strict=True)
            )
        ]
