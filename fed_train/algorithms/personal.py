"""Helpers the personalized baselines share: what a client's validation split chooses (the
epochs of a fine-tuning, a value of a grid) and the accuracy it is judged by. Their local steps
are `base.local_sgd` with its hooks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from fed_train.algorithms.base import (
    ClientData,
    Weights,
    get_weights,
    local_sgd,
    predict_proba,
    set_weights,
    sub_seed,
)
from fed_train.training_config import TrainingConfig


def epochs_only(training: TrainingConfig) -> TrainingConfig:
    """The same optimiser settings counted in epochs: fine-tuning budgets are epochs even when
    federated rounds use a fixed number of steps."""
    return replace(training, steps=None)


def finetune_settings(
    finetune_epochs: int, finetune_lr: float | None, training: TrainingConfig
) -> tuple[int, float]:
    """(epochs, lr) of a local fine-tuning, checked. The lr defaults to the initial learning
    rate, not the decayed one: a few epochs at lr * gamma^2 would barely move the model."""
    if finetune_epochs < 0:
        raise ValueError(f"finetune_epochs must be >= 0, got {finetune_epochs}")
    if finetune_lr is not None and not finetune_lr > 0:
        raise ValueError(f"finetune_lr must be positive, got {finetune_lr}")
    return finetune_epochs, training.lr if finetune_lr is None else finetune_lr


def accuracy(proba: np.ndarray, y: torch.Tensor | np.ndarray) -> float:
    labels = y.cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
    return float(np.mean(np.asarray(proba).argmax(1) == labels))


def model_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return accuracy(predict_proba(model, x), y)


def best_on_validation(
    model_with: Callable[[Weights], nn.Module],
    candidates: Iterable[tuple[float, Weights]],
    client: ClientData,
) -> tuple[float, nn.Module]:
    """The candidate (a grid value and its weights) whose model, built by `model_with`, is most
    accurate on the client's validation split, and that model. Ties keep the first candidate,
    and so does a client without validation data."""
    best_value, best_acc, best_model = None, -1.0, None
    for value, weights in candidates:
        model = model_with(weights)
        acc = model_accuracy(model, client.x_val, client.y_val) if len(client.y_val) else 0.0
        if acc > best_acc:
            best_value, best_acc, best_model = value, acc, model
    return best_value, best_model


def finetune(
    model: nn.Module,
    client: ClientData,
    training: TrainingConfig,
    lr: float,
    epochs: int,
    seed: int,
    *,
    select_on_validation: bool = True,
    after_step: Callable[[], None] | None = None,
    params: Iterable[nn.Parameter] | None = None,
) -> tuple[int, float | None]:
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
        local_sgd(
            model,
            client.x_train,
            client.y_train,
            training,
            lr,
            sub_seed(seed, epoch),
            epochs=1,
            params=trainable,
            after_step=after_step,
        )
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
