"""Tiny synthetic federations for the training tests: Gaussian blobs in 8 dimensions, four
classes, an MLP of 16 hidden units; seconds per run."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fed_train.algorithms.base import ClientData, TrainingConfig, get_weights
from fed_train.models import EmbedHeadModel
from fed_train.simulation import simulate

DIM, CLASSES = 8, 4
TRAINING = TrainingConfig(rounds=3, epochs=1, batch_size=16, lr=0.1, milestones=())


class TinyNet(EmbedHeadModel):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(DIM, hidden), nn.ReLU())
        self.classifier = nn.Linear(hidden, CLASSES)
        self.embedding_dim = hidden

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _blobs(n: int, rng: np.random.Generator, label_map: np.ndarray) -> tuple[torch.Tensor, ...]:
    centres = np.random.default_rng(123).normal(0.0, 2.0, size=(CLASSES, DIM))
    y = rng.integers(0, CLASSES, size=n)
    x = centres[y] + 0.6 * rng.normal(size=(n, DIM))
    return torch.tensor(x, dtype=torch.float32), torch.tensor(label_map[y], dtype=torch.int64)


def make_clients(
    count: int = 6,
    swapped: tuple[int, ...] = (),
    unseen: tuple[int, ...] = (),
    n_train: int = 96,
    seed: int = 0,
) -> list[ClientData]:
    """Clients sharing one input distribution; those in `swapped` see classes 0<->1, 2<->3."""
    rng = np.random.default_rng(seed)
    clients = []
    for cid in range(count):
        label_map = np.array([1, 0, 3, 2]) if cid in swapped else np.arange(CLASSES)
        parts = [_blobs(n, rng, label_map) for n in (n_train, 32, 64)]
        clients.append(ClientData(cid, *parts[0], *parts[1], *parts[2], unseen=cid in unseen))
    return clients


def model_fn() -> TinyNet:
    return TinyNet()


def initial_weights(seed: int = 0) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    return get_weights(model_fn())


def train(algorithm, clients, training=TRAINING):
    return simulate(algorithm, clients, training, initial_weights(), seed=0, progress=False)
