"""What Ditto and APFL share: FedAvg for the global model plus, for each client, one personal
model per value of a grid (Ditto's lambdas, APFL's alphas), and the value whose model the
client's validation split prefers. A method says how its personal models train and what
predicts with one; this class owns the checked grid, the fine-tuning budget of clients without
personal models, where those live in a client's state ({"personal": {str(value): weights}})
and the choice."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from fed_train.algorithms.base import (
    ClientData,
    ClientState,
    PersonalModel,
    Weights,
    model_predictor,
)
from fed_train.algorithms.fedavg import FedAvg
from fed_train.algorithms.personal import best_on_validation, finetune_settings
from fed_train.models import ModelFactory
from fed_train.training_config import TrainingConfig


class PersonalGrid(FedAvg):
    """FedAvg with a personal model per grid value; subclasses set `key` (the value's name in a
    client's results), `rule` (the grid's condition, for its error) and `allows`."""

    key: str
    rule: str

    def __init__(
        self,
        model_fn: ModelFactory,
        training: TrainingConfig,
        grid: Sequence[float],
        finetune_epochs: int,
        finetune_lr: float | None,
    ) -> None:
        super().__init__(model_fn, training)
        self.grid = self._checked(grid)
        # FedAvg+'s budget, for clients without personal models
        self.finetune_epochs, self.finetune_lr = finetune_settings(
            finetune_epochs, finetune_lr, training
        )

    def allows(self, value: float) -> bool:
        """Whether `value` may be in the grid (NaN never is)."""
        raise NotImplementedError

    def _checked(self, values: Sequence[float]) -> tuple[float, ...]:
        grid = tuple(float(v) for v in values)
        if not grid:
            raise ValueError(f"{self.key}s must hold at least one value")
        for value in grid:
            if not self.allows(value):
                raise ValueError(f"{self.rule}, got {value}")
        return grid

    def starts(self, state: ClientState, global_weights: Weights) -> list[Weights]:
        """Where each value's personal model starts: the client's own from its last round, or
        the global model for a client that has none."""
        previous = state.get("personal", {})
        return [previous.get(str(value), global_weights) for value in self.grid]

    def fresh(self, state: ClientState) -> list[bool]:
        """Which values' personal models the client's state lacks."""
        previous = state.get("personal", {})
        return [str(value) not in previous for value in self.grid]

    def personal_state(self, models: Iterable[Weights]) -> dict[str, Any]:
        """The client state that keeps one personal model per value, in the grid's order."""
        return {
            "personal": {
                str(value): weights for value, weights in zip(self.grid, models, strict=True)
            }
        }

    def fine_tune(
        self, global_weights: Weights, client: ClientData, state: ClientState, seed: int
    ) -> list[Weights]:
        """Personal models for a client whose `state` lacks some (`fresh`: which), from its
        `starts`."""
        raise NotImplementedError

    def predictor_weights(
        self, value: float, personal: Weights, global_weights: Weights
    ) -> Weights:
        """The weights a client predicts with for `value` and its personal model."""
        return personal

    def personalize(
        self, global_weights: Weights, client: ClientData, state: ClientState, seed: int
    ) -> PersonalModel:
        """The value whose model is most accurate on the client's validation split (ties: the
        first in the grid, which the papers' grids start closest to the global model)."""
        fresh = self.fresh(state)
        models = self.starts(state, global_weights)
        if any(fresh):
            models = self.fine_tune(global_weights, client, state, seed)
        best, model = best_on_validation(
            self.model_with,
            (
                (value, self.predictor_weights(value, personal, global_weights))
                for value, personal in zip(self.grid, models, strict=True)
            ),
            client,
        )
        return PersonalModel(model_predictor(model), {self.key: best, "fine_tuned": any(fresh)})
