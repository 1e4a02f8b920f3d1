"""APFL (Deng et al. 2020): each client mixes a personal model v with the global model w in
parameter space, v_bar = alpha v + (1 - alpha) w, with alpha chosen per client on validation.

- In a round, a participating client takes, on every mini-batch, FedAvg's SGD step on its copy
  of w and, for each alpha in `alphas`, a step on v along the gradient of the loss of v_bar
  (which is alpha times the gradient at v_bar, as in APFL's Algorithm 1; w is taken before its
  own step). Only w is sent and averaged with FedAvg's rule.
- alpha comes from the paper's grid {0.1, 0.3, 0.5, 0.7, 0.9}: one personal model per value is
  trained (v's updates depend on alpha, so this is the faithful way to choose it) and
  personalization keeps the value whose v_bar is best on the client's validation split. This
  is the grid choice, not APFL's adaptive alpha; it costs one extra SGD pass per value.
- alpha = 0 gives v no gradient and v_bar = w: exactly FedAvg (a test pins it).
- Personal models live in the client state as {"personal": {str(alpha): weights}}. A client
  without one (unseen, or never sampled) trains one per alpha against the frozen global model
  for `finetune_epochs` epochs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from fed_train.accelerator import autocast
from fed_train.algorithms.base import (
    ClientData,
    ClientResult,
    ClientState,
    Weights,
    batch_schedule,
    finite_mean_loss,
    get_weights,
    make_optimizer,
    on_device,
    set_weights,
)
from fed_train.algorithms.personal import epochs_only, float_keys
from fed_train.algorithms.personal_grid import PersonalGrid
from fed_train.algorithms.stepped import Cohort
from fed_train.algorithms.stepping import LossFn, Params
from fed_train.models import ModelFactory
from fed_train.training_config import TrainingConfig

APFL_ALPHAS: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)


def mix_weights(personal: Weights, global_weights: Weights, alpha: float) -> Weights:
    """alpha v + (1 - alpha) w for floating tensors; counters (BatchNorm's) come from w."""
    floats = set(float_keys(global_weights))
    return {
        name: (
            (
                alpha * personal[name].astype(np.float64) + (1.0 - alpha) * w.astype(np.float64)
            ).astype(w.dtype)
            if name in floats
            else w.copy()
        )
        for name, w in global_weights.items()
    }


class APFL(PersonalGrid):
    name = "apfl"
    title = "APFL"
    job_cost = 6.0
    key = "alpha"
    rule = "APFL alpha must be in [0, 1]"

    def __init__(
        self,
        model_fn: ModelFactory,
        training: TrainingConfig,
        alphas: Sequence[float] = APFL_ALPHAS,
        finetune_epochs: int = 3,
        finetune_lr: float | None = None,
    ) -> None:
        super().__init__(model_fn, training, alphas, finetune_epochs, finetune_lr)
        self._mixed = model_fn()  # holds v_bar for the personal steps
        self._personal = [model_fn() for _ in self.grid]

    def allows(self, value: float) -> bool:
        return 0.0 <= value <= 1.0

    def _joint_sgd(
        self,
        client: ClientData,
        training: TrainingConfig,
        lr: float,
        seed: int,
        *,
        update_global: bool,
        epochs: int | None = None,
    ) -> float:
        """APFL's local steps on self._work (w) and self._personal (one v per alpha).

        The gradient of the loss of v_bar with respect to v is alpha times its gradient at
        v_bar, so each v takes its step from one backward pass through a model holding v_bar."""
        w_model, mixed = self._work, self._mixed
        opt_w = make_optimizer(w_model.parameters(), training, lr) if update_global else None
        opts_v = [make_optimizer(v.parameters(), training, lr) for v in self._personal]
        for model in (w_model, mixed, *self._personal):
            model.train()
        w_params = dict(w_model.named_parameters())
        mixed_params = dict(mixed.named_parameters())
        mixed_buffers = dict(mixed.named_buffers())
        x, y = client.x_train, client.y_train
        # losses are summed where they are computed and checked once at the end, as in
        # `local_sgd`: a per-step check would wait for an accelerator on every step
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        personal_total = torch.zeros_like(total)
        count = 0
        for index in on_device(batch_schedule(int(y.shape[0]), training, seed, epochs), x.device):
            xb, yb = x[index], y[index]
            for alpha, v, opt in zip(self.grid, self._personal, opts_v, strict=True):
                with torch.no_grad():  # v_bar from w before its own step, as in Algorithm 1
                    for name, p in v.named_parameters():
                        mixed_params[name].copy_(alpha * p + (1.0 - alpha) * w_params[name])
                    for name, b in v.named_buffers():
                        mixed_buffers[name].copy_(b)
                mixed.zero_grad()
                with autocast(x.device, training.precision):
                    loss_v = nn.functional.cross_entropy(mixed(xb), yb)
                personal_total += loss_v.detach().double()
                loss_v.backward()
                opt.zero_grad()
                for name, p in v.named_parameters():
                    grad = mixed_params[name].grad
                    p.grad = None if grad is None else alpha * grad
                opt.step()
                with torch.no_grad():  # batch-norm statistics belong to v
                    for name, b in v.named_buffers():
                        b.copy_(mixed_buffers[name])
            if opt_w is not None:
                opt_w.zero_grad()
                with autocast(x.device, training.precision):
                    loss = nn.functional.cross_entropy(w_model(xb), yb)
                loss.backward()
                opt_w.step()
                total += loss.detach().double() * len(index)
                count += len(index)
        finite_mean_loss(personal_total, 1, lr)
        return finite_mean_loss(total, count, lr)

    def _load(self, global_weights: Weights, starts: list[Weights]) -> None:
        """w and every v into the working models, where `_joint_sgd` steps them."""
        set_weights(self._work, global_weights)
        for v, start in zip(self._personal, starts, strict=True):
            set_weights(v, start)

    def client_update(
        self, global_weights: Weights, client: ClientData, state: ClientState, lr: float, seed: int
    ) -> ClientResult:
        self._load(global_weights, self.starts(state, global_weights))
        loss = self._joint_sgd(client, self.training, lr, seed, update_global=True)
        return ClientResult(
            get_weights(self._work),
            client.num_train,
            self.personal_state(get_weights(v) for v in self._personal),
            loss,
        )

    def _joint_loss(self, names: list[str]) -> LossFn:
        """One lane holds w ("w.<name>") and every v ("<i>.<name>"). The objective's gradient is
        each model's APFL gradient: w's own loss, and for each v the loss of
        alpha v + (1 - alpha) w with w held still (its gradient at v is alpha times the one at
        v_bar, as `_joint_sgd` takes it). The reported loss is w's, as in `client_update`."""
        model = self._work

        def loss(
            params: Params, x: torch.Tensor, y: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            w = {n: params[f"w.{n}"] for n in names}
            own = nn.functional.cross_entropy(functional_call(model, w, (x,)), y, reduction="none")
            objective = own
            for i, alpha in enumerate(self.grid):
                mixed = {
                    n: alpha * params[f"{i}.{n}"] + (1.0 - alpha) * w[n].detach() for n in names
                }
                objective = objective + nn.functional.cross_entropy(
                    functional_call(model, mixed, (x,)), y, reduction="none"
                )
            return objective, own

        return loss

    def client_updates(
        self, global_weights: Weights, cohort: Cohort, lr: float
    ) -> list[ClientResult]:
        """`client_update` for several clients stepped together: one lane per client holding
        its w and every v, all on the same mini-batches as `_joint_sgd` draws them."""
        names = self.param_names
        device = cohort.device
        lanes = []
        for client, state, seed in cohort:
            start = {f"w.{n}": p for n, p in self.params(global_weights, device).items()}
            for i, v in enumerate(self.starts(state, global_weights)):
                start.update({f"{i}.{n}": p for n, p in self.params(v, device).items()})
            lanes.append(self.lane(start, client, seed))
        trained, losses = self.step(lanes, lr, self._joint_loss(names))
        results = []
        for plain, client, loss in zip(trained, cohort.clients, losses, strict=True):
            own = (
                {**global_weights, **{n: plain[f"{i}.{n}"] for n in names}}
                for i in range(len(self.grid))
            )
            results.append(
                ClientResult(
                    {**global_weights, **{n: plain[f"w.{n}"] for n in names}},
                    client.num_train,
                    self.personal_state(own),
                    loss,
                )
            )
        return results

    def fine_tune(
        self, global_weights: Weights, client: ClientData, state: ClientState, seed: int
    ) -> list[Weights]:
        """Every personal model (the client's own where it has one) trained against the frozen
        global model for `finetune_epochs` epochs."""
        self._load(global_weights, self.starts(state, global_weights))
        self._joint_sgd(
            client,
            epochs_only(self.training),
            self.finetune_lr,
            seed,
            update_global=False,
            epochs=self.finetune_epochs,
        )
        return [get_weights(v) for v in self._personal]

    def predictor_weights(
        self, value: float, personal: Weights, global_weights: Weights
    ) -> Weights:
        """v_bar = alpha v + (1 - alpha) w."""
        return mix_weights(personal, global_weights, value)
