"""What a command asks of kNN-Per's configuration: the tuned or the paper's setting, plus the
values its flags pin. Light on purpose (no torch): Flower's run settings carry it to every
ClientApp process."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from edge_runtime.arg_types import k_neighbours, kernel_sigma
from edge_runtime.knn import (
    DEFAULT_K,
    DEFAULT_NORMALIZE,
    DEFAULT_SIGMA,
    KNN_BASES,
    LAMBDA_ESTIMATORS,
    LAMBDA_RULES,
    NORMALIZATIONS,
    k_sigma_problem,
)
from fed_train.errors import KnnperError

KNN_MODES = ("tuned", "paper")
ESTIMATOR_CHOICES = (*LAMBDA_ESTIMATORS, "auto")
RULE_CHOICES = (*LAMBDA_RULES, "auto")
# what kNN-Per's kNN is interpolated with: the global model, or each client's linear head
BASE_CHOICES = (*KNN_BASES, "auto")
# where a value came from, as manifests and export.json record it
FROM_VALIDATION, FROM_FLAG, FROM_PAPER = "validation", "flag", "paper default"
K_GRID: tuple[int, ...] = (5, 10, 20, 50)
# half-decades from 1e-4 to 1e2: L2-normalised embeddings need small scales (squared distances
# are at most 4, divided by the dimension), raw ReLU embeddings large ones
SIGMA_GRID: tuple[float, ...] = tuple(float(10.0 ** (e / 2)) for e in range(-8, 5))


@dataclass(frozen=True)
class KNNRequest:
    """What a command asks for: a setting plus any values pinned by flags (None: not pinned)."""

    mode: str = "tuned"
    k: int | None = None
    sigma: float | None = None
    normalize: str | None = None
    lambda_estimator: str | None = None
    lambda_rule: str | None = None
    base: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in KNN_MODES:
            raise KnnperError(
                f"unknown kNN configuration {self.mode!r}; known: {', '.join(KNN_MODES)}"
            )
        problem = k_sigma_problem(self.k, self.sigma)
        if problem:
            raise KnnperError(problem)
        for name, what, known in (
            ("normalize", "normalisation", NORMALIZATIONS),
            ("lambda_estimator", "lambda estimator", ESTIMATOR_CHOICES),
            ("lambda_rule", "lambda rule", RULE_CHOICES),
            ("base", "base", BASE_CHOICES),
        ):
            value = getattr(self, name)
            if value is not None and value not in known:
                raise KnnperError(f"unknown {what} {value!r}; known: {', '.join(known)}")

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        """--knn-config and the flags that pin one value of it, for every command that runs
        kNN-Per (evaluate, export, bench table, demo, experiment, deploy, the benchmarks);
        `from_args` reads them back."""
        p.add_argument(
            "--knn-config",
            choices=KNN_MODES,
            default="tuned",
            help="kNN-Per's k, sigma, normalisation and lambda estimator: chosen on the "
            "seen clients' pooled validation splits (tuned, saved in the run directory "
            "and reused) or the paper's fixed setting (k=10, sigma=1, raw embeddings, "
            "lambda on validation)",
        )
        p.add_argument(
            "--k",
            type=k_neighbours,
            default=None,
            help="pin kNN-Per's number of neighbours (default: from --knn-config)",
        )
        p.add_argument(
            "--sigma",
            type=kernel_sigma,
            default=None,
            help="pin kNN-Per's kernel width (default: from --knn-config)",
        )
        p.add_argument(
            "--normalize",
            choices=NORMALIZATIONS,
            default=None,
            help="pin the embedding normalisation before the kNN (default: from --knn-config)",
        )
        p.add_argument(
            "--lambda-estimator",
            choices=ESTIMATOR_CHOICES,
            default=None,
            help="pin how each client picks lambda: its validation split (val), plus "
            "leave-one-out posteriors of its datastore (loo+val), or whichever wins 2-fold "
            "cross-validation inside the validation splits (auto; default: from "
            "--knn-config)",
        )
        p.add_argument(
            "--lambda-rule",
            choices=RULE_CHOICES,
            default=None,
            help="pin how lambda pools evidence across clients: each client's own "
            "(client, the paper's), one lambda from the seen clients' pooled validation "
            "splits (pooled), each client's own evidence shrunk toward the pooled one "
            "(shrunk), or whichever wins 2-fold cross-validation inside the validation "
            "splits (auto; default: auto with --knn-config tuned, client with paper)",
        )
        p.add_argument(
            "--base",
            choices=BASE_CHOICES,
            default=None,
            help="pin what the kNN is interpolated with: the global model (global, the "
            "paper's), each client's linear head fitted on its own embeddings (linear), "
            "or whichever wins 2-fold cross-validation inside the validation splits "
            "(auto; default: auto with --knn-config tuned, global with paper)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> KNNRequest:
        """The request `add_arguments`' flags spell."""
        return cls(args.knn_config, *(getattr(args, f.name) for f in fields(cls)[1:]))

    @property
    def tuned(self) -> bool:
        return self.mode == "tuned"

    def grids(self) -> tuple[tuple[int, ...], tuple[float, ...], tuple[str, ...]]:
        """The k, sigma and normalisation values searched: a pinned axis has one value."""

        def axis(pinned: Any, grid: tuple, paper: Any) -> tuple:
            if pinned is not None:
                return (pinned,)
            return grid if self.tuned else (paper,)

        return (
            axis(self.k, K_GRID, DEFAULT_K),
            axis(self.sigma, SIGMA_GRID, DEFAULT_SIGMA),
            axis(self.normalize, NORMALIZATIONS, DEFAULT_NORMALIZE),
        )

    def estimator(self) -> str:
        """The estimator asked for ("auto": chosen by cross-validation)."""
        if self.lambda_estimator is not None:
            return self.lambda_estimator
        return "auto" if self.tuned else "val"

    def rule(self) -> str:
        """The lambda rule asked for ("auto": chosen by cross-validation; the paper's setting
        keeps each client's own lambda)."""
        if self.lambda_rule is not None:
            return self.lambda_rule
        return "auto" if self.tuned else "client"

    def base_choice(self) -> str:
        """What the kNN is interpolated with ("auto": chosen by cross-validation; the paper's
        setting keeps the global model)."""
        if self.base is not None:
            return self.base
        return "auto" if self.tuned else "global"

    def sources(self) -> dict[str, str]:
        """Where each value will come from: a flag, the validation splits, or the paper."""
        unpinned = FROM_VALIDATION if self.tuned else FROM_PAPER
        out = {
            name: FROM_FLAG if getattr(self, name) is not None else unpinned
            for name in ("k", "sigma", "normalize")
        }
        for name, asked in (
            ("lambda_estimator", self.estimator()),
            ("lambda_rule", self.rule()),
            ("base", self.base_choice()),
        ):
            pinned = getattr(self, name) is not None
            out[name] = FROM_VALIDATION if asked == "auto" else FROM_FLAG if pinned else FROM_PAPER
        return out

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)
