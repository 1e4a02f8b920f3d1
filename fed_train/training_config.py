"""The optimisation settings every federated method shares, light on purpose (no torch, no
numpy): `fed_train.defaults` holds the values the command line shows, and `knnper --help` builds
its flags from them before any heavy import."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainingConfig:
    """Optimisation settings shared by every algorithm, so all methods get the same budget.

    Parameters
    ----------
    rounds : communication rounds.
    participation : fraction of training clients sampled per round, in (0, 1].
    epochs : local epochs per round.
    steps : when set, a fixed number of local SGD steps per round replaces `epochs`.
    batch_size : local SGD's batch size, in samples.
    lr : the initial learning rate.
    momentum, weight_decay : local SGD's.
    milestones : fractions of the rounds at which the learning rate is multiplied by `gamma`.
    gamma : the learning rate's decay at each milestone.
    precision : of the forward passes: "fp32" or "bf16" (fed_train.accelerator.autocast).
    """

    rounds: int = 20
    participation: float = 1.0  # fraction of training clients sampled per round
    epochs: int = 1
    steps: int | None = None  # when set, a fixed number of SGD steps replaces epochs
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    milestones: tuple[float, ...] = (0.5, 0.75)  # fractions of the rounds where lr decays
    gamma: float = 0.1
    precision: str = "fp32"  # of the forward passes (fed_train.accelerator.autocast)

    @property
    def participations(self) -> int:
        """The rounds a client takes part in, in expectation (at least one): what a client that
        trains alone (Local, FedRep's unseen heads) gets in place of the federated rounds."""
        return max(1, round(self.rounds * self.participation))

    def lr_at(self, round_index: int, rounds: int) -> float:
        """Multi-step decay: lr times gamma for every milestone already passed."""
        passed = sum(round_index >= m * rounds for m in self.milestones)
        return self.lr * self.gamma**passed
