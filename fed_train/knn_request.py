"""What a command asks of kNN-Per's configuration: the tuned or the paper's setting, plus the
values its flags pin. Light on purpose (no torch): Flower's run settings carry it to every
ClientApp process."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

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
        if self.normalize is not None and self.normalize not in NORMALIZATIONS:
            raise KnnperError(
                f"unknown normalisation {self.normalize!r}; known: {', '.join(NORMALIZATIONS)}"
            )
        if self.lambda_estimator is not None and self.lambda_estimator not in ESTIMATOR_CHOICES:
            raise KnnperError(
                f"unknown lambda estimator {self.lambda_estimator!r}; known: "
                f"{', '.join(ESTIMATOR_CHOICES)}"
            )
        if self.lambda_rule is not None and self.lambda_rule not in RULE_CHOICES:
            raise KnnperError(
                f"unknown lambda rule {self.lambda_rule!r}; known: {', '.join(RULE_CHOICES)}"
            )
        if self.base is not None and self.base not in BASE_CHOICES:
            raise KnnperError(f"unknown base {self.base!r}; known: {', '.join(BASE_CHOICES)}")

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
        out["lambda_estimator"] = (
            FROM_VALIDATION
            if self.estimator() == "auto"
            else FROM_FLAG
            if self.lambda_estimator is not None
            else FROM_PAPER
        )
        out["lambda_rule"] = (
            FROM_VALIDATION
            if self.rule() == "auto"
            else FROM_FLAG
            if self.lambda_rule is not None
            else FROM_PAPER
        )
        out["base"] = (
            FROM_VALIDATION
            if self.base_choice() == "auto"
            else FROM_FLAG
            if self.base is not None
            else FROM_PAPER
        )
        return out

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)
