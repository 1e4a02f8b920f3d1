"""A Flower run's settings: the same RunConfig `knnper train` saves, plus what only a deployment
has (the algorithm, the server's run directory, how long to wait for SuperNodes). They travel as
Flower's run config (`flwr run --run-config`), whose values are flat TOML scalars, so the nested
RunConfig goes as one JSON string under "run"."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from edge_runtime._io import parse_json
from edge_runtime.errors import one_line
from fed_train.algorithms import ALGORITHMS, federated_methods
from fed_train.errors import KnnperError
from fed_train.knn_request import KNNRequest
from fed_train.run import RunConfig


class FlowerConfigError(KnnperError, ValueError):
    """A run or node configuration that cannot work; raised on the side that holds it."""


@dataclass
class FlowerSettings:
    run: RunConfig = field(default_factory=RunConfig)
    run_dir: str = ""
    algorithm: str = "fedavg"
    round_timeout: float = 600.0  # seconds to wait for a round's replies
    connect_timeout: float = 120.0  # seconds to wait for every training client's SuperNode
    min_train_clients: int = 0  # replies a round needs; 0: every sampled client
    # personalizations evaluated on the clients at the end; the trained algorithm's own one
    # uses the state its clients kept
    eval_methods: tuple[str, ...] = ("fedavg", "knnper")
    # kNN-Per's configuration as `--knn-config` and its pinning flags ask for it, carried whole
    knn: KNNRequest = field(default_factory=KNNRequest)
    capacity: float = 1.0
    # `knnper deploy release`: instead of training, push this export to the nodes' bundles
    release: str = ""
    keep_inputs: bool = False  # a bundle built on a node keeps its raw inputs (exact upgrades)
    force_upgrade: bool = False  # map keys even where the release advises otherwise

    def check(self) -> FlowerSettings:
        algorithm = ALGORITHMS.get(self.algorithm)
        if algorithm is None:
            raise FlowerConfigError(
                f"unknown algorithm {self.algorithm!r}; known: {', '.join(federated_methods())}"
            )
        if not algorithm.federated:
            raise FlowerConfigError(
                f"algorithm {self.algorithm!r} does not train federatedly; "
                "there is nothing to deploy"
            )
        if not self.run_dir:
            raise FlowerConfigError("run config 'run-dir' (the server's run directory) is empty")
        for name in ("round_timeout", "connect_timeout"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise FlowerConfigError(
                    f"{name.replace('_', '-')} must be a positive number of seconds, got {value}"
                )
        if not 0 <= self.min_train_clients <= self.run.clients:
            raise FlowerConfigError(
                f"min-train-clients must be from 0 to the run's "
                f"{self.run.clients} clients, got {self.min_train_clients}"
            )
        unknown = [m for m in self.eval_methods if m not in ALGORITHMS]
        if unknown:
            raise FlowerConfigError(
                f"unknown evaluation method(s) {', '.join(unknown)}; known: {', '.join(ALGORITHMS)}"
            )
        if not 0 < self.capacity <= 1:
            raise FlowerConfigError(f"kNN-Per's capacity must be in (0, 1], got {self.capacity}")
        return self

    def to_run_config(self) -> dict[str, Any]:
        """Flower's run config: TOML scalars only, each field under its dashed name (in field
        order), a scalar as its default's type."""
        values: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "run":
                values["run"] = json.dumps(value.to_dict())
            elif f.name == "knn":
                values.update(_knn_values(value))
            elif f.name == "eval_methods":
                values["eval-methods"] = ",".join(value)
            else:
                values[_key(f.name)] = type(f.default)(value)
        return values

    @classmethod
    def from_run_config(cls, values: dict[str, Any]) -> FlowerSettings:
        try:
            run = RunConfig.from_dict(parse_json(str(values.get("run", "{}")).encode("utf-8")))
        except (ValueError, TypeError) as err:  # RunError is a ValueError
            raise FlowerConfigError(
                f"run config 'run' is not a knnper run configuration: {one_line(err)}"
            ) from None
        methods = str(values.get("eval-methods", ",".join(cls.eval_methods))).split(",")
        try:
            scalars = {
                f.name: (_flag if isinstance(f.default, bool) else type(f.default))(
                    values.get(_key(f.name), f.default)
                )
                for f in fields(cls)
                if f.name not in ("run", "knn", "eval_methods")
            }
            settings = cls(
                run=run,
                eval_methods=tuple(m for m in methods if m),
                knn=_knn_request(values),
                **scalars,
            )
        except (TypeError, ValueError) as err:
            raise FlowerConfigError(f"bad run config value: {err}") from err
        return settings.check()


def _key(field_name: str) -> str:
    return field_name.replace("_", "-")


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r:.40}")
    return value


# A run config holds no None: a value kNN-Per chooses (not pinned by a flag) travels as 0 or "".
_KNN_KEYS = (
    ("k", "k", int),
    ("sigma", "sigma", float),
    ("normalize", "normalize", str),
    ("lambda_estimator", "lambda-estimator", str),
    ("lambda_rule", "lambda-rule", str),
    ("base", "base", str),
)


def _knn_values(request: KNNRequest) -> dict[str, Any]:
    """The request as run config scalars."""
    values: dict[str, Any] = {"knn-config": request.mode}
    for field_name, key, kind in _KNN_KEYS:
        pinned = getattr(request, field_name)
        values[key] = kind() if pinned is None else kind(pinned)
    return values


def _knn_request(values: dict[str, Any]) -> KNNRequest:
    """The request the run config's scalars give (checked as a command line's flags are)."""
    pinned = {}
    for field_name, key, kind in _KNN_KEYS:
        value = kind(values.get(key, kind()))
        pinned[field_name] = value if value != kind() else None
    try:
        return KNNRequest(str(values.get("knn-config", KNNRequest.mode)), **pinned)
    except KnnperError as err:
        raise FlowerConfigError(f"kNN settings: {err}") from None
