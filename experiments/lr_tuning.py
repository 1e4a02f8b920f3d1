"""Choosing a method's learning rate on validation accuracy, never on test.

The paper tunes each method's learning rate on the grid {10^-0.5, 10^-1, 10^-1.5, 10^-2, 10^-2.5}
by the accuracy of the personalized models on the validation splits of the clients seen in
training. Tuning multiplies the cost of a table by the grid's size, so it is an option; without
it every method uses the one learning rate given on the command line.

The paper then retrains with the chosen learning rate on train + validation. This module does
not: the validation split is also what several methods personalize with (kNN-Per's lambda,
Ditto's lambda, APFL's alpha, FedAvg+'s epoch count, ClusteredFL's cluster for new clients), so
folding it into training would leave them nothing held out to choose on, and retraining would
double the cost. Reported numbers are those of the run trained on the train split alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

LR_GRID: tuple[float, ...] = tuple(float(10.0**-e) for e in (0.5, 1.0, 1.5, 2.0, 2.5))
MAX_LR = 1.0  # SGD on these models diverges long before; a larger value is a typo


def check_lr_grid(values: Iterable[float]) -> tuple[float, ...]:
    """The grid as floats, in the given order without repeats; every value in (0, MAX_LR]."""
    grid: list[float] = []
    for value in values:
        v = float(value)
        if not (math.isfinite(v) and 0.0 < v <= MAX_LR):
            raise ValueError(f"learning-rate grid value {value} is out of range (0, {MAX_LR:g}]")
        if v not in grid:
            grid.append(v)
    if not grid:
        raise ValueError("the learning-rate grid is empty")
    return tuple(grid)


def parse_lr_grid(text: str) -> tuple[float, ...]:
    """A comma-separated grid from the command line, e.g. "0.1,0.03,0.01"."""
    values = []
    for part in text.split(","):
        try:
            values.append(float(part))
        except ValueError:
            raise ValueError(f"learning-rate grid value {part.strip()!r} is not a number") from None
    return check_lr_grid(values)


def validation_score(rows: list[dict[str, Any]]) -> float | None:
    """Validation accuracy of the seen clients, weighted by validation size like the test mean."""
    scored = [r for r in rows if not r["unseen"] and r["val_accuracy"] is not None]
    if not scored:
        return None
    return float(
        np.average([r["val_accuracy"] for r in scored], weights=[r["n_val"] for r in scored])
    )


def choose_lr(scores: dict[float, float | None]) -> float:
    """The learning rate with the best validation score; ties go to the first in grid order."""
    valid = {lr: s for lr, s in scores.items() if s is not None}
    if not valid:
        raise ValueError("no seen client has validation data: cannot tune the learning rate")
    best = max(valid.values())
    return next(lr for lr, s in valid.items() if s == best)
