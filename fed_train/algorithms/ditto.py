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
from typing import Any

import numpy as np
import torch

from fed_train.algorithms.base import (
    ClientData,
    ClientResult,
    PersonalModel,
    TrainingConfig,
    Weights,
    batch_schedule,
    get_weights,
    local_sgd,
    model_predictor,
    set_weights,
    sub_seed,
)
from fed_train.algorithms.fedavg import FedAvg
from fed_train.algorithms.personal import best_on_validation, epochs_only, finetune_settings
from fed_train.algorithms.stepping import (
    Lane,
    Params,
    as_params,
    as_weights,
    cross_entropy_loss,
    step_together,
)
from fed_train.models import EmbedHeadModel

DITTO_LAMBDAS: tuple[float, ...] = (10.0, 1.0, 0.1, 0.01)


def check_lambdas(lambdas: Sequence[float]) -> tuple[float, ...]:
    values = tuple(float(v) for v in lambdas)
    if not values:
        raise ValueError("lambdas must hold at least one value")
    for v in values:
        if not (v >= 0 and not math.isnan(v)):
            raise ValueError(f"Ditto lambda must be >= 0, got {v}")
    return values


class Ditto(FedAvg):
    name = "ditto"

    def __init__(self, model_fn: Callable[[], EmbedHeadModel], training: TrainingConfig,
                 lambdas: Sequence[float] = DITTO_LAMBDAS, finetune_epochs: int = 3,
                 finetune_lr: float | None = None) -> None:
        super().__init__(model_fn, training)
        self.lambdas = check_lambdas(lambdas)
        # FedAvg+'s budget, for new clients
        self.finetune_epochs, self.finetune_lr = finetune_settings(finetune_epochs, finetune_lr,
                                                                   training)
        self._personal = model_fn()

    def _prox_step(self, model: torch.nn.Module, anchor: Weights, lam: float,
                   lr: float) -> Callable[[], None]:
        """v <- argmin_u ||u - v||^2 / (2 lr) + lam/2 ||u - w||^2 = v + t (w - v) with
        t = lr lam / (1 + lr lam), applied in place."""
        shrink = lr * lam
        t = 1.0 if math.isinf(shrink) else shrink / (1.0 + shrink)
        targets = {name: torch.from_numpy(np.asarray(anchor[name])).to(p.device)
                   for name, p in model.named_parameters()}

        @torch.no_grad()
        def step() -> None:
            if t == 0.0:
                return
            for name, p in model.named_parameters():
                p.lerp_(targets[name], t)

        return step

    def _train_personal(self, start: Weights, anchor: Weights, client: ClientData, lam: float,
                        training: TrainingConfig, lr: float, seed: int,
                        epochs: int | None = None) -> tuple[Weights, float]:
        set_weights(self._personal, start)
        loss = local_sgd(self._personal, client.x_train, client.y_train, training, lr, seed,
                         epochs=epochs,
                         after_step=self._prox_step(self._personal, anchor, lam, lr))
        return get_weights(self._personal), loss

    def client_update(self, global_weights: Weights, client: ClientData, state: dict[str, Any],
                      lr: float, seed: int) -> ClientResult:
        result = super().client_update(global_weights, client, state, lr, seed)
        previous = state.get("personal", {})
        personal = {}
        for i, lam in enumerate(self.lambdas):
            start = previous.get(str(lam), global_weights)
            personal[str(lam)], _ = self._train_personal(start, global_weights, client, lam,
                                                         self.training, lr, sub_seed(seed, i))
        return replace(result, state={"personal": personal})

    def client_updates(self, global_weights: Weights, clients: list[ClientData],
                       states: list[dict[str, Any]], lr: float,
                       seeds: list[int]) -> list[ClientResult]:
        """`client_update` for several clients: their global models and every personal model
        (one per client and lambda) step together, the personal ones pulled towards w by the
        same proximal step after each SGD step."""
        names = [name for name, _ in self._work.named_parameters()]
        device = clients[0].x_train.device
        lanes = self.global_lanes(global_weights, clients, seeds)
        pulls = [0.0] * len(lanes)  # lerp by 0 leaves the global lanes exactly as they are
        for client, state, seed in zip(clients, states, seeds, strict=True):
            previous = state.get("personal", {})
            for i, lam in enumerate(self.lambdas):
                start = as_params(previous.get(str(lam), global_weights), names, device)
                schedule = batch_schedule(client.num_train, self.training, sub_seed(seed, i))
                lanes.append(Lane(start, {}, client.x_train, client.y_train, list(schedule)))
                shrink = lr * lam
                pulls.append(1.0 if math.isinf(shrink) else shrink / (1.0 + shrink))
        anchor = as_params(global_weights, names, device)
        pull = torch.tensor(pulls, device=device)

        def proximal(params: Params, which: slice) -> Params:
            weight = pull[which]
            return {name: torch.lerp(p, anchor[name], weight.view(-1, *([1] * anchor[name].dim())))
                    for name, p in params.items()}

        trained, losses = step_together(cross_entropy_loss(self._work), lanes, self.training, lr,
                                        after_step=proximal)
        results, k = [], len(clients)
        for j, client in enumerate(clients):
            own = trained[k + j * len(self.lambdas):k + (j + 1) * len(self.lambdas)]
            personal = {str(lam): {**global_weights, **as_weights(p)}
                        for lam, p in zip(self.lambdas, own, strict=True)}
            results.append(ClientResult({**global_weights, **as_weights(trained[j])},
                                        client.num_train, {"personal": personal}, losses[j]))
        return results

    def personalize(self, global_weights: Weights, client: ClientData, state: dict[str, Any],
                    seed: int) -> PersonalModel:
        personal = dict(state.get("personal", {}))
        fresh = [lam for lam in self.lambdas if str(lam) not in personal]
        for i, lam in enumerate(self.lambdas):
            if lam in fresh:
                personal[str(lam)], _ = self._train_personal(
                    global_weights, global_weights, client, lam, epochs_only(self.training),
                    self.finetune_lr, sub_seed(seed, i), epochs=self.finetune_epochs)
        # ties keep the first, i.e. the largest lambda (closest to w)
        best_lam, best_model = best_on_validation(
            self.model_with, ((lam, personal[str(lam)]) for lam in self.lambdas), client)
        return PersonalModel(model_predictor(best_model),
                             {"lambda": best_lam, "fine_tuned": bool(fresh)})
