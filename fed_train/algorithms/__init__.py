"""Federated algorithms by name, in the order the comparison tables list them. A new method is
one module (a class with `name`, `title` and the halves of `base.Algorithm`) plus one line here;
every list of methods (tables, titles, Flower's help, job costs) is read from this registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fed_train.algorithms.apfl import APFL
from fed_train.algorithms.base import Algorithm
from fed_train.algorithms.clustered import ClusteredFL
from fed_train.algorithms.ditto import Ditto
from fed_train.algorithms.fedavg import FedAvg
from fed_train.algorithms.fedavg_plus import FedAvgPlus
from fed_train.algorithms.fedrep import FedRep
from fed_train.algorithms.knnper import KNNPer
from fed_train.algorithms.linear import LinearPer
from fed_train.algorithms.local import Local
from fed_train.algorithms.pfedgp import PFedGP
from fed_train.models import ModelFactory
from fed_train.training_config import TrainingConfig

ALGORITHMS: dict[str, Callable[..., Algorithm]] = {
    "local": Local,
    "fedavg": FedAvg,
    "fedavg+": FedAvgPlus,
    "linear": LinearPer,
    "clustered": ClusteredFL,
    "ditto": Ditto,
    "fedrep": FedRep,
    "apfl": APFL,
    "pfedgp": PFedGP,
    "knnper": KNNPer,
}


def federated_methods() -> list[str]:
    """The methods that train federatedly (what a Flower federation can run)."""
    return [name for name, algorithm in ALGORITHMS.items() if algorithm.federated]


def build_algorithm(
    name: str, model_fn: ModelFactory, training: TrainingConfig, **hyper: Any
) -> Algorithm:
    """The federated algorithm registered under `name`, ready for `simulate`.

    Parameters
    ----------
    name : a key of ALGORITHMS ("fedavg", "local", "fedavg+", "ditto", "apfl", ...).
    model_fn : builds a fresh, untrained model (each client's and the server's copy).
    training : rounds, participation, local steps and the optimizer (`TrainingConfig`).
    **hyper : the algorithm's own hyper-parameters (its class's keyword arguments).
    """
    if name not in ALGORITHMS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name](model_fn, training, **hyper)
