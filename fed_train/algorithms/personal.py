"""Helpers the personalized baselines share: sub-seeds, the SGD loop with hooks (proximal steps,
custom losses), and fine-tuning that keeps the epoch count a client's validation split prefers."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from fed_train.accelerator import autocast
from fed_train.algorithms.base import (
    ClientData,
    TrainingConfig,
    Weights,
    batches,
    finite_mean_loss,
    get_weights,
    on_device,
    predict_proba,
    set_weights,
)

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def sub_seed(seed: int, *keys: int) -> int:
    """An independent stream for one part of a client's step (a personal model, an epoch)."""
    return int(np.random.SeedSequence([seed, *keys]).generate_state(1)[0])


def epochs_only(training: TrainingConfig) -> TrainingConfig:
    """The same optimiser settings counted in epochs: fine-tuning budgets are epochs even when
    federated rounds use a fixed number of steps."""
    return replace(training, steps=None)


def batch_schedule(n: int, training: TrainingConfig, seed: int,
                   epochs: int | None = None) -> Iterator[np.ndarray]:
    """Mini-batch indices in exactly the order `local_sgd` draws them for the same seed, so a
    method that reduces to FedAvg (APFL with alpha = 0) reproduces it bit for bit."""
    if n == 0:
        return
    rng = np.random.default_rng(seed)
    if training.steps is not None:
        epochs_needed = math.ceil(training.steps / math.ceil(n / training.batch_size))
        budget: int | None = training.steps
    else:
        epochs_needed = epochs if epochs is not None else training.epochs
        budget = None
    steps = 0
    for _ in range(epochs_needed):
        for idx in batches(n, training.batch_size, rng):
            if budget is not None and steps >= budget:
                return
            yield idx
            steps += 1


def cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def make_optimizer(params: Iterable[nn.Parameter], training: TrainingConfig,
                   lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(list(params), lr=lr, momentum=training.momentum,
                           weight_decay=training.weight_decay)


def sgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, training: TrainingConfig, lr: float,
        seed: int, *, epochs: int | None = None, params: Iterable[nn.Parameter] | None = None,
        loss_fn: LossFn = cross_entropy, after_step: Callable[[], None] | None = None) -> float:
    """`local_sgd` with two hooks: a loss other than cross-entropy (pFedGP) and a step run after
    each optimiser step (Ditto's proximal step). Returns the mean loss."""
    trainable = list(params) if params is not None else list(model.parameters())
    opt = make_optimizer(trainable, training, lr)
    model.train()
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    count = 0
    for index in on_device(batch_schedule(int(y.shape[0]), training, seed, epochs), x.device):
        opt.zero_grad()
        with autocast(x.device, training.precision):
            loss = loss_fn(model, x[index], y[index])
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step()
        total += loss.detach().double() * len(index)
        count += len(index)
    return finite_mean_loss(total, count, lr) if count else float("nan")


def accuracy(proba: np.ndarray, y: torch.Tensor | np.ndarray) -> float:
    labels = y.cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
    return float(np.mean(np.asarray(proba).argmax(1) == labels))


def model_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return accuracy(predict_proba(model, x), y)


def finetune(model: nn.Module, client: ClientData, training: TrainingConfig, lr: float,
             epochs: int, seed: int, *, select_on_validation: bool = True,
             after_step: Callable[[], None] | None = None,
             params: Iterable[nn.Parameter] | None = None) -> tuple[int, float | None]:
    """Train `model` on the client's train split one epoch at a time and keep the epoch count
    (0 .. epochs) that scores best on its validation split (ties: fewer epochs, the safer
    choice on few samples). Without validation data, or with selection off, all epochs are
    kept. Returns (epochs kept, validation accuracy or None)."""
    trainable = list(params) if params is not None else None
    training = epochs_only(training)
    has_val = len(client.y_val) > 0
    select = select_on_validation and has_val
    best_epochs = 0
    best_acc = model_accuracy(model, client.x_val, client.y_val) if has_val else None
    best_weights: Weights | None = get_weights(model) if select else None
    for epoch in range(1, epochs + 1):
        sgd(model, client.x_train, client.y_train, training, lr, sub_seed(seed, epoch), epochs=1,
            params=trainable, after_step=after_step)
        if not has_val:
            best_epochs = epoch
            continue
        acc = model_accuracy(model, client.x_val, client.y_val)
        if not select or acc > best_acc:
            best_epochs, best_acc = epoch, acc
            if select:
                best_weights = get_weights(model)
    if select and best_epochs < epochs:
        set_weights(model, best_weights)
    model.eval()
    return best_epochs, best_acc


def float_keys(weights: Weights) -> list[str]:
    return [k for k, w in weights.items() if np.issubdtype(np.asarray(w).dtype, np.floating)]
