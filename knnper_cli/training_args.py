"""The training flags of `train`, `pretrain`, `bench table`, `experiment` and `deploy`, and the
RunConfig they make. Their defaults come from the settings types (RunConfig, TrainingConfig),
not from the training code: these parsers answer before torch is imported."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

from edge_runtime.arg_types import (
    FLOAT32_MAX,
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
    seed,
)
from fed_train import defaults
from fed_train.accelerator import DEVICES, PRECISIONS
from fed_train.data import DEFAULT_PATHS
from fed_train.run_config import RunConfig
from fed_train.training_config import TrainingConfig

Settings = TypeVar("Settings")


def from_flags(kind: type[Settings], args: argparse.Namespace, **given: Any) -> Settings:
    """A settings dataclass from the flags named like its fields and the `given` values (the
    others keep defaults)."""
    flagged = {f.name for f in fields(kind)} & vars(args).keys() - given.keys()
    return kind(**{name: getattr(args, name) for name in flagged}, **given)


def learning_rate(text: str) -> float:
    """A rate torch can apply to float32 weights (larger ones overflow inside the optimizer;
    merely large ones end in the trainer's 'loss became NaN' error)."""
    value = positive_float(text)
    if value > FLOAT32_MAX:
        raise argparse.ArgumentTypeError(
            f"must fit a float32 (at most {FLOAT32_MAX:.3g}), got {text}"
        )
    return value


DATA_HELP = (
    "path of the data (file or directory); default: none needed for digits (it ships "
    "with scikit-learn), "
    + ", ".join(f"{path} for {name}" for name, path in DEFAULT_PATHS.items())
    + "; every other data set needs one"
)


def add_sgd_arguments(p: argparse.ArgumentParser, d: Any, what: str) -> None:
    """--batch-size, --lr, --momentum and --weight-decay with `d`'s values as defaults."""
    p.add_argument(
        "--batch-size", type=positive_int, default=d.batch_size, help=f"{what} batch size"
    )
    p.add_argument("--lr", type=learning_rate, default=d.lr, help=f"{what} learning rate")
    p.add_argument(
        "--momentum", type=non_negative_float, default=d.momentum, help=f"{what} momentum"
    )
    p.add_argument(
        "--weight-decay",
        type=non_negative_float,
        default=d.weight_decay,
        help=f"{what} weight decay",
    )


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    """Data, partition and optimisation flags shared by `train` and `bench table`; the
    optimisation defaults are fed_train.defaults.TRAINING (chosen on validation)."""
    d = RunConfig()
    _add_data_arguments(p, d)
    add_model_argument(p)
    _add_optimisation_arguments(p, defaults.TRAINING)
    p.add_argument(
        "--seed",
        type=seed,
        default=d.seed,
        help="seed of the partition, initialisation and client sampling",
    )
    p.add_argument(
        "--init",
        default=None,
        help="start every method from these weights: a `knnper pretrain` directory "
        "(its server split is then left out of the clients' data) or a .pt state dict",
    )
    add_device_argument(p)
    add_precision_argument(p)
    p.add_argument(
        "--client-batch",
        type=positive_int,
        default=1,
        help="step up to this many sampled clients together (one vmap over their "
        "stacked weights): for a GPU; on 2 CPU cores it was 3x slower. Models with "
        "BatchNorm or an LSTM train one after another (mobilenet-v2-gn can)",
    )


def _add_data_arguments(p: argparse.ArgumentParser, d: RunConfig) -> None:
    """The data set and how it is partitioned over the clients (defaults: `d`'s)."""
    p.add_argument(
        "--dataset",
        default=d.dataset,
        help="digits, fashion-mnist, mnist, npz, cifar10, cifar100, femnist, shakespeare",
    )
    p.add_argument("--data", default=None, help=DATA_HELP)
    p.add_argument(
        "--max-train",
        type=positive_int,
        default=None,
        help="subsample the training set (stratified) to this many samples",
    )
    p.add_argument(
        "--partition", default=d.partition, help="dirichlet, pachinko, pathological, natural"
    )
    p.add_argument(
        "--alpha",
        type=positive_float,
        default=d.alpha,
        help="Dirichlet / pachinko concentration (smaller: more heterogeneous)",
    )
    p.add_argument(
        "--beta",
        type=positive_float,
        default=d.beta,
        help="pachinko: concentration of the fine labels within a coarse label",
    )
    p.add_argument(
        "--classes-per-client",
        type=positive_int,
        default=d.classes_per_client,
        help="pathological: classes each client holds",
    )
    p.add_argument("--clients", type=positive_int, default=d.clients, help="number of clients")
    p.add_argument(
        "--unseen-fraction",
        type=float,
        default=d.unseen_fraction,
        help="fraction of clients held out of training (evaluated as unseen)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=d.val_fraction,
        help="fraction of each client's train data kept for validation",
    )


def _add_optimisation_arguments(p: argparse.ArgumentParser, t: TrainingConfig) -> None:
    """Rounds, participation, local work and the learning-rate schedule (defaults: `t`'s)."""
    p.add_argument("--rounds", type=positive_int, default=t.rounds, help="federated rounds")
    p.add_argument(
        "--participation",
        type=fraction,
        default=t.participation,
        help="fraction of training clients sampled per round",
    )
    p.add_argument(
        "--local-epochs", type=positive_int, default=t.epochs, help="local epochs per round"
    )
    p.add_argument(
        "--local-steps",
        type=positive_int,
        default=None,
        help="a fixed number of local SGD steps instead of epochs",
    )
    add_sgd_arguments(p, t, "local SGD")
    p.add_argument(
        "--milestones",
        type=fraction,
        nargs="*",
        default=list(t.milestones),
        help="fractions of the rounds at which the learning rate decays",
    )
    p.add_argument(
        "--lr-gamma",
        type=positive_float,
        default=t.gamma,
        help="learning-rate factor at each milestone",
    )


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="small-cnn, mobilenet-v2, mobilenet-v2-gn, char-lstm (default: chosen by input kind)",
    )


def add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where to train and evaluate: auto takes the GPU when torch sees one; "
        "cuda without one is an error. Checkpoints and model.pt load on any device",
    )


def add_precision_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="of the training forward passes: bf16 autocasts them (weights and "
        "optimiser state stay fp32); saved with the run's training settings",
    )


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run the training flags describe (--local-epochs, --local-steps and --lr-gamma are
    the training's epochs, steps and gamma)."""
    training = from_flags(
        TrainingConfig,
        args,
        epochs=args.local_epochs,
        steps=args.local_steps,
        milestones=tuple(args.milestones),
        gamma=args.lr_gamma,
    )
    continue_from = getattr(args, "continue_from", None)
    return from_flags(
        RunConfig,
        args,
        training=training,
        # absolute, so later commands find them from any directory
        init=None if args.init is None else str(Path(args.init).resolve()),
        continue_from=None if continue_from is None else str(Path(continue_from).resolve()),
        checkpoint_every=getattr(args, "checkpoint_every", defaults.CHECKPOINT_EVERY),
    )
