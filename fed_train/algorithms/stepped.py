"""The federated methods whose clients can also train stepped together (`--client-batch`):
FedAvg, the methods built on it, and FedRep. This class says once whether the working model can
step (`stepping_blocker`), how plain weights become lanes and trained lanes weights again, and
the stepped twin of `FederatedAlgorithm.client_update`; a method writes only what its lanes
hold (fed_train.algorithms.stepping steps them)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fed_train.algorithms.base import (
    ClientData,
    ClientResult,
    ClientState,
    FederatedAlgorithm,
    Weights,
    batch_schedule,
)
from fed_train.algorithms.stepping import (
    AfterStep,
    Lane,
    LossFn,
    Params,
    as_params,
    as_weights,
    cross_entropy_loss,
    step_together,
    stepping_blocker,
)
from fed_train.training_config import TrainingConfig


@dataclass(frozen=True)
class Cohort:
    """Clients stepped together: each one's data, its state from earlier rounds and its seed."""

    clients: list[ClientData]
    states: list[ClientState]
    seeds: list[int]

    def __iter__(self) -> Iterator[tuple[ClientData, ClientState, int]]:
        return zip(self.clients, self.states, self.seeds, strict=True)

    @property
    def device(self) -> torch.device:
        return self.clients[0].x_train.device


class SteppedAlgorithm(FederatedAlgorithm):
    """A federated method with `client_updates`, several clients' `client_update` stepped
    together; this one's is FederatedAlgorithm's (each client's copy of the global model
    trained with cross-entropy), and a method that changes `client_update` changes both."""

    def stepping_blocker(self) -> str | None:
        """Why this method's clients cannot step together (its model), or None: the
        simulation asks before it steps them."""
        return stepping_blocker(self._work)

    def params(
        self, weights: Weights, device: torch.device, names: list[str] | None = None
    ) -> Params:
        """The working model's parameters (or the `names` entries) of `weights`, on `device`."""
        return as_params(weights, self.param_names if names is None else names, device)

    def lane(
        self, start: Params, client: ClientData, seed: int, fixed: Params | None = None
    ) -> Lane:
        """`start` trained on the client's train split in the batch order `client_update` draws
        for `seed`, with `fixed` held still."""
        return Lane(
            start,
            {} if fixed is None else fixed,
            client.x_train,
            client.y_train,
            list(batch_schedule(client.num_train, self.training, seed)),
        )

    def step(
        self,
        lanes: list[Lane],
        lr: float,
        loss_fn: LossFn | None = None,
        after_step: AfterStep | None = None,
        training: TrainingConfig | None = None,
    ) -> tuple[list[Weights], list[float]]:
        """The lanes stepped together (`step_together`; default: the working model's
        cross-entropy with this method's training settings): each one's trained parameters as
        plain weights, and its mean loss."""
        trained, losses = step_together(
            cross_entropy_loss(self._work) if loss_fn is None else loss_fn,
            lanes,
            self.training if training is None else training,
            lr,
            after_step,
        )
        return [as_weights(p) for p in trained], losses

    def client_updates(
        self, global_weights: Weights, cohort: Cohort, lr: float
    ) -> list[ClientResult]:
        """`client_update` for several clients, stepped together."""
        start = self.params(global_weights, cohort.device)
        trained, losses = self.step(
            [
                self.lane(start, c, seed)
                for c, seed in zip(cohort.clients, cohort.seeds, strict=True)
            ],
            lr,
        )
        return [
            ClientResult({**global_weights, **w}, c.num_train, state, loss)
            for w, c, state, loss in zip(
                trained, cohort.clients, cohort.states, losses, strict=True
            )
        ]
