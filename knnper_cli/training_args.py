"""The training flags of `train`, `pretrain`, `bench table`, `experiment` and `deploy`, and the
RunConfig they make. Their defaults come from the settings types (RunConfig, TrainingConfig),
not from the training code: these parsers answer before torch is imported."""

from __future__ import annotations

import argparse
from collections.abc import Callable
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


Flag = str | tuple[Callable[[str], Any], str]


def add_setting_flags(p: argparse.ArgumentParser, settings: Any, **flags: Flag) -> None:
    """A flag per keyword, named like the field (`--val-fraction` for `val_fraction`) and
    defaulting to `settings`' value of it, so that the flag, its default and the field
    from_flags fills cannot drift apart; each value is the flag's help, or (type, help)."""
    for name, flag in flags.items():
        kind, help_text = (None, flag) if isinstance(flag, str) else flag
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=getattr(settings, name),
            help=help_text,
        )


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
    add_setting_flags(
        p,
        d,
        batch_size=(positive_int, f"{what} batch size"),
        lr=(learning_rate, f"{what} learning rate"),
        momentum=(non_negative_float, f"{what} momentum"),
        weight_decay=(non_negative_float, f"{what} weight decay"),
    )


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    """Data, partition and optimisation flags shared by `train` and `bench table`; the
    optimisation defaults are fed_train.defaults.TRAINING (chosen on validation)."""
    d = RunConfig()
    _add_data_arguments(p, d)
    add_model_argument(p)
    _add_optimisation_arguments(p, defaults.TRAINING)
    add_setting_flags(
        p,
        d,
        seed=(seed, "seed of the partition, initialisation and client sampling"),
        init="start every method from these weights: a `knnper pretrain` directory "
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
    add_setting_flags(
        p,
        d,
        dataset="digits, fashion-mnist, mnist, npz, cifar10, cifar100, femnist, shakespeare",
        data=DATA_HELP,
        max_train=(positive_int, "subsample the training set (stratified) to this many samples"),
        partition="dirichlet, pachinko, pathological, natural",
        alpha=(positive_float, "Dirichlet / pachinko concentration (smaller: more heterogeneous)"),
        beta=(positive_float, "pachinko: concentration of the fine labels within a coarse label"),
        classes_per_client=(positive_int, "pathological: classes each client holds"),
        clients=(positive_int, "number of clients"),
        unseen_fraction=(float, "fraction of clients held out of training (evaluated as unseen)"),
        val_fraction=(float, "fraction of each client's train data kept for validation"),
    )


def _add_optimisation_arguments(p: argparse.ArgumentParser, t: TrainingConfig) -> None:
    """Rounds, participation, local work and the learning-rate schedule (defaults: `t`'s)."""
    add_setting_flags(
        p,
        t,
        rounds=(positive_int, "federated rounds"),
        participation=(fraction, "fraction of training clients sampled per round"),
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
