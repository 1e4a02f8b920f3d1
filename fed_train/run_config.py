"""The settings of a run (config.json) and of a pretraining (pretrain.json), with their checks,
apart from the training code: the `knnper` parsers take their defaults from these types before
torch is imported."""

from __future__ import annotations

import types
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Union, get_args, get_origin, get_type_hints

from edge_runtime.values import is_integer, is_real
from fed_train.errors import KnnperError
from fed_train.training_config import TrainingConfig

# What `knnper evaluate` can compare (fed_train.run_evaluation).
EVAL_METHODS = ("local", "fedavg", "knnper")


class RunError(KnnperError, ValueError):
    """A run directory that is missing, incomplete or inconsistent."""


@dataclass
class RunConfig:
    """Everything needed to reproduce a run; saved as config.json beside its results.

    Parameters
    ----------
    dataset : a data set name (`load_dataset`), "digits" by default.
    data : the data's file or folder; None uses the data set's default location.
    max_train : a stratified, seeded subsample of this many training samples; None: all.
    partition : the split scheme (`make_partition`): "dirichlet", "pachinko",
        "pathological" or "natural".
    alpha, beta, classes_per_client : the scheme's settings (`make_partition`).
    clients : the number of clients.
    unseen_fraction : share of clients held out of training, in [0, 1).
    val_fraction : share of each client's training samples held out for validation.
    model : a model name (`build_model`); None: small-cnn for images, char-lstm for tokens.
    seed : seeds the data subsample, the partition, the model's initial weights and training.
    checkpoint_every : rounds between checkpoints.
    init : a pretrain directory or a .pt state dict every method starts from; None: random
        weights.
    continue_from : a finished run whose model this one continues training (its weights are
        the start, its pretraining's server split stays the server's); the lineage its exports
        record.
    training : the optimisation settings every method shares (`TrainingConfig`).
    """

    dataset: str = "digits"
    data: str | None = None
    max_train: int | None = None
    partition: str = "dirichlet"
    alpha: float = 0.3
    beta: float = 10.0
    classes_per_client: int = 2
    clients: int = 20
    unseen_fraction: float = 0.2
    val_fraction: float = 0.2
    model: str | None = None
    seed: int = 0
    checkpoint_every: int = 5
    init: str | None = None
    continue_from: str | None = None
    training: TrainingConfig = field(default_factory=TrainingConfig)

    def to_dict(self) -> dict:
        data = asdict(self)
        if data["init"] is None:
            del data["init"]  # runs from scratch keep the config.json they were saved with
        if data["continue_from"] is None:
            del data["continue_from"]
        if data["training"]["precision"] == "fp32":
            del data["training"]["precision"]  # and so do runs in the default precision
        return data

    @classmethod
    def from_dict(cls, data: dict) -> RunConfig:
        """A config from JSON data (config.json, Flower's run config); RunError names the
        first key that is unknown or of the wrong type."""
        if not isinstance(data, dict):
            raise RunError(f"config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known - _RECORDED_KEYS
        if unknown:
            raise RunError(f"config has unknown keys: {', '.join(sorted(unknown))}")
        values = {k: v for k, v in data.items() if k in known}
        training = values.pop("training", {})
        if not isinstance(training, dict):
            raise RunError("config 'training' must be a JSON object")
        unknown = set(training) - {f.name for f in fields(TrainingConfig)}
        if unknown:
            raise RunError(f"config 'training' has unknown keys: {', '.join(sorted(unknown))}")
        training = dict(training)
        if isinstance(training.get("milestones"), list):
            training["milestones"] = tuple(training["milestones"])
        config = cls(**values, training=TrainingConfig(**training))
        _check_types(config, "config")
        _check_types(config.training, "config 'training'")
        return config


# Keys config.json records beside the settings (what the run found or computed).
_RECORDED_KEYS = {"num_classes", "input_spec", "model_name", "init_sha256", "data_sha256"}


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value has the type a config field declares."""
    if hint is type(None):
        return value is None
    if get_origin(hint) in (Union, types.UnionType):
        return any(_fits(value, arg) for arg in get_args(hint))
    if get_origin(hint) is tuple:
        return isinstance(value, tuple) and all(_fits(v, get_args(hint)[0]) for v in value)
    if hint is int:
        return is_integer(value)
    if hint is float:
        return is_real(value, finite=True)
    return not isinstance(hint, type) or isinstance(value, hint)


def _check_types(config: Any, where: str) -> None:
    hints = get_type_hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        if not _fits(value, hints[f.name]):
            kind = str(hints[f.name]).replace("<class '", "").replace("'>", "")
            raise RunError(f"{where} {f.name!r} must be {kind}, got {value!r}")


@dataclass
class PretrainConfig:
    """Everything a pretraining depends on; saved in pretrain.json beside its results."""

    dataset: str = "digits"
    data: str | None = None
    public_data: str | None = None  # an npz to train on instead of a split of the training set
    model: str | None = None
    server_fraction: float = 0.1
    val_fraction: float = 0.1  # of the pretraining data, held out to choose the epoch
    max_train: int | None = None
    epochs: int = 30
    patience: int = 5  # stop after this many epochs without a better validation accuracy
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    augment: bool = False  # random shifted crops and horizontal flips (CIFAR's usual recipe)
    precision: str = "fp32"  # of the forward passes (fed_train.accelerator.autocast)
    seed: int = 0  # the data: the server split, max_train's subsample, the held-out slice
    # the training: initial weights, batch order, augmentation (None: `seed`); another value
    # trains an independent model on the very same server split, so runs from either
    # pretraining give the clients the same samples
    weights_seed: int | None = None

    def training_seed(self) -> int:
        """The seed of the initial weights, the batch order and the augmentation."""
        return self.seed if self.weights_seed is None else self.weights_seed
