"""What an experiment is (its grids, its claims, what it returns) and the checks on grid values,
which run while the command line is parsed: a bad grid fails before any training starts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fed_train.errors import KnnperError

# "iid" on a grid of Dirichlet concentrations: every client's label shares equal to within ~1%.
IID_ALPHA = 1e4


class ExperimentError(KnnperError, ValueError):
    """An experiment that cannot run with the given grid, data or output folder."""


def format_alpha(alpha: float) -> str:
    return "iid" if alpha == IID_ALPHA else f"{alpha:g}"


def _number(kind: type, check: Callable[[float], bool], bound: str) -> Callable[[str], Any]:
    def parse(token: str) -> Any:
        if token == "iid" and bound.startswith("alpha"):
            return IID_ALPHA
        try:
            value = kind(token)
        except ValueError:
            raise ValueError(f"{token!r} is not a number") from None
        if not (math.isfinite(value) and check(value)):
            raise ValueError(f"{token} is out of range ({bound})")
        return value

    return parse


ALPHA = _number(float, lambda v: v > 0, "alpha > 0, or iid")
FRACTION = _number(float, lambda v: 0 < v <= 1, "a fraction in (0, 1]")
DELTA_C = _number(float, lambda v: 0 <= v < 0.5, "delta C in [0, 0.5)")
NEIGHBOURS = _number(int, lambda v: v >= 1, "k >= 1")
POSITIVE = _number(float, lambda v: v > 0, "> 0")
DIMENSION = _number(int, lambda v: v >= 1, ">= 1")


@dataclass(frozen=True)
class Grid:
    """One swept hyper-parameter: its flag, how a value is checked, its full and quick values."""

    name: str  # the flag without dashes, e.g. "alphas"
    parse: Callable[[str], Any]
    full: tuple[Any, ...]
    quick: tuple[Any, ...]
    help: str

    def argparse_type(self) -> Callable[[str], tuple[Any, ...]]:
        """Comma-separated values, each checked; an empty list is refused."""

        def parse_list(text: str) -> tuple[Any, ...]:
            tokens = [t.strip() for t in text.split(",") if t.strip()]
            if not tokens:
                raise argparse.ArgumentTypeError("the grid is empty")
            try:
                values = [self.parse(t) for t in tokens]
            except ValueError as err:
                raise argparse.ArgumentTypeError(str(err)) from None
            return tuple(dict.fromkeys(values))

        return parse_list


# The grids several experiments sweep, declared once: the paper's alphas of Fig. 3 and its
# datastore capacities.
ALPHAS = Grid("alphas", ALPHA, (0.1, 0.3, 1.0), (0.3,), "Dirichlet concentrations, or iid")
CAPACITIES = Grid(
    "capacities",
    FRACTION,
    (0.1, 0.2, 0.4, 0.6, 0.8, 1.0),
    (0.2, 1.0),
    "datastore sizes as fractions of each client's train split",
)


@dataclass
class Claim:
    """One row of the claim-by-claim table."""

    paper: str
    ours: str
    verdict: str  # "agree", "disagree", "partly" or "not measured"


@dataclass
class Result:
    """What an experiment hands to the report: every point, per-client rows, the plot file it
    wrote, and the claims checked against the points."""

    points: list[dict[str, Any]]
    point_columns: Sequence[str]
    table: Sequence[tuple[str, str, str]]  # summary.md's columns: (key, header, format)
    claims: list[Claim]
    plot: Path
    clients: list[dict[str, Any]] = field(default_factory=list)
    client_columns: Sequence[str] = ()
    notes: list[str] = field(default_factory=list)
    # compute time when the points do not each carry their own "seconds" (one record behind
    # every point would otherwise be counted once per point)
    compute_seconds: float | None = None


@dataclass
class Measured:
    """What an experiment measured for one seed, or for every seed combined
    (experiments.experiment_seeds): the summary (claims, plot) is made from this alone, so one
    seed and several are judged by the same code."""

    points: list[dict[str, Any]]
    clients: list[dict[str, Any]]  # rows carry a "seed" only when several seeds are combined
    keys: tuple[str, ...]  # the point columns that name a point (its grid values)
    seeds: tuple[int, ...]
    # per seed, in `seeds` order: what the summary needs besides the rows (e.g. the chosen k)
    facts: list[dict[str, Any]] = field(default_factory=list)
    compute_seconds: float | None = None  # as Result.compute_seconds
    scale: str = ""  # the data set and scale in a line, under every figure's title


@dataclass(frozen=True)
class Experiment:
    name: str
    help: str
    claim: str  # the paper's claim, in a sentence or two, with where it is in the paper
    grids: tuple[Grid, ...]
    measure: Callable[..., Measured]  # measure(ctx, grids): one seed's points and client rows
    summarise: Callable[[Measured, Path], Result]  # claims, and the plot written into the folder
    # how many points measure(ctx, grids) computes, for a time-left estimate; None: not known
    # ahead (it depends on the run, e.g. how many checkpoints training left)
    count: Callable[[dict[str, tuple]], int] | None = None

    def run(self, ctx: Any, grids: dict[str, tuple]) -> Result:
        """One seed, reported in OUT/NAME."""
        measured = self.measure(ctx, grids)
        measured.scale = ctx.figure_scale()
        return self.summarise(measured, ctx.out / self.name)
