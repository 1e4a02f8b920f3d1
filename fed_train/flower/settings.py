"""A Flower run's settings: the same RunConfig `knnper train` saves, plus what only a deployment
has (the algorithm, the server's run directory, how long to wait for SuperNodes). They travel as
Flower's run config (`flwr run --run-config`), whose values are flat TOML scalars, so the nested
RunConfig goes as one JSON string under "run"."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from edge_runtime._io import parse_json
from edge_runtime.errors import one_line
from fed_train.algorithms import ALGORITHMS
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
    # kNN-Per's configuration as `--knn-config` and its pinning flags give it (fed_train.
    # knn_choice); Flower's run config holds no None, so 0 / "" mean "not pinned"
    knn_config: str = "tuned"
    k: int = 0
    sigma: float = 0.0
    normalize: str = ""
    lambda_estimator: str = ""
    lambda_rule: str = ""
    base: str = ""
    capacity: float = 1.0

    def knn_request(self) -> KNNRequest:
        try:
            return KNNRequest(self.knn_config, self.k or None, self.sigma or None,
                              self.normalize or None, self.lambda_estimator or None,
                              self.lambda_rule or None, self.base or None)
        except KnnperError as err:
            raise FlowerConfigError(f"kNN settings: {err}") from None

    def check(self) -> FlowerSettings:
        algorithm = ALGORITHMS.get(self.algorithm)
        if algorithm is None:
            raise FlowerConfigError(f"unknown algorithm {self.algorithm!r}; known: "
                                    f"{', '.join(ALGORITHMS)}")
        if not getattr(algorithm, "federated", False):
            raise FlowerConfigError(f"algorithm {self.algorithm!r} does not train federatedly; "
                                    "there is nothing to deploy")
        if not self.run_dir:
            raise FlowerConfigError("run config 'run-dir' (the server's run directory) is empty")
        for name in ("round_timeout", "connect_timeout"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise FlowerConfigError(f"{name.replace('_', '-')} must be a positive number of "
                                        f"seconds, got {value}")
        if not 0 <= self.min_train_clients <= self.run.clients:
            raise FlowerConfigError(f"min-train-clients must be from 0 to the run's "
                                    f"{self.run.clients} clients, got {self.min_train_clients}")
        unknown = [m for m in self.eval_methods if m not in ALGORITHMS]
        if unknown:
            raise FlowerConfigError(f"unknown evaluation method(s) {', '.join(unknown)}; known: "
                                    f"{', '.join(ALGORITHMS)}")
        if self.k < 0 or self.sigma < 0 or not 0 < self.capacity <= 1:
            raise FlowerConfigError(f"kNN settings need k >= 1, sigma > 0 (0: chosen), "
                                    f"0 < capacity <= 1; got k={self.k}, sigma={self.sigma}, "
                                    f"capacity={self.capacity}")
        self.knn_request()
        return self

    def to_run_config(self) -> dict[str, Any]:
        """Flower's run config: TOML scalars only."""
        return {"run": json.dumps(self.run.to_dict()), "run-dir": self.run_dir,
                "algorithm": self.algorithm, "round-timeout": float(self.round_timeout),
                "connect-timeout": float(self.connect_timeout),
                "min-train-clients": int(self.min_train_clients),
                "eval-methods": ",".join(self.eval_methods), "knn-config": self.knn_config,
                "k": int(self.k), "sigma": float(self.sigma), "normalize": self.normalize,
                "lambda-estimator": self.lambda_estimator, "lambda-rule": self.lambda_rule,
                "base": self.base,
                "capacity": float(self.capacity)}

    @classmethod
    def from_run_config(cls, values: dict[str, Any]) -> FlowerSettings:
        try:
            run = RunConfig.from_dict(parse_json(str(values.get("run", "{}")).encode("utf-8")))
        except (ValueError, TypeError) as err:  # RunError is a ValueError
            raise FlowerConfigError(f"run config 'run' is not a knnper run configuration: "
                                    f"{one_line(err)}") from None
        d = cls()
        try:
            settings = cls(
                run=run, run_dir=str(values.get("run-dir", d.run_dir)),
                algorithm=str(values.get("algorithm", d.algorithm)),
                round_timeout=float(values.get("round-timeout", d.round_timeout)),
                connect_timeout=float(values.get("connect-timeout", d.connect_timeout)),
                min_train_clients=int(values.get("min-train-clients", d.min_train_clients)),
                eval_methods=tuple(m for m in str(values.get("eval-methods", ",".join(
                    d.eval_methods))).split(",") if m),
                knn_config=str(values.get("knn-config", d.knn_config)),
                k=int(values.get("k", d.k)), sigma=float(values.get("sigma", d.sigma)),
                normalize=str(values.get("normalize", d.normalize)),
                lambda_estimator=str(values.get("lambda-estimator", d.lambda_estimator)),
                lambda_rule=str(values.get("lambda-rule", d.lambda_rule)),
                base=str(values.get("base", d.base)),
                capacity=float(values.get("capacity", d.capacity)))
        except (TypeError, ValueError) as err:
            raise FlowerConfigError(f"bad run config value: {err}") from err
        return settings.check()
