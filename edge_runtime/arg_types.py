"""The argparse types both command lines share (`knnper-edge` here, `knnper` in knnper_cli):
one definition of a positive number, a fraction, a thread count and a byte count, so the same
text means the same value to both and a bad one is the same one-line error, exit 2. Light on
purpose: `knnper --help` and a bad flag are answered before numpy is imported, so the checks
that need `_io` or `knn` (numpy) import them when they run."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

from .byte_count import parse_byte_count

_NAMES = {int: "an integer", float: "a number"}
INT64_MAX = 2**63 - 1  # counts end up in numpy and torch integers
SEED_MAX = 2**32 - 1  # the widest seed every library the project seeds takes
FLOAT32_MAX = 3.4028234663852886e38


def positive(kind: type, upper: float | None = None) -> Callable[[str], float | int]:
    """A type for a finite number > 0 (at most `upper`)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {_NAMES[kind]}: {text!r}") from None
        if not 0 < value < math.inf or (upper is not None and value > upper):
            bound = (
                f"in (0, {upper:g}]"
                if upper is not None
                else ">= 1"
                if kind is int
                else "a finite number > 0"
            )
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        if kind is int and value > INT64_MAX:
            raise argparse.ArgumentTypeError(f"must be at most {INT64_MAX} (2^63 - 1), got {text}")
        return value

    return parse


positive_int = positive(int)
positive_float = positive(float)
fraction = positive(float, 1.0)


def non_negative(kind: type, upper: float) -> Callable[[str], float | int]:
    """A type for a finite number from 0 to `upper` (an integer, or a number)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {_NAMES[kind]}: {text!r}") from None
        if not 0 <= value <= upper:
            shown = upper if kind is int else f"{upper:g}"
            raise argparse.ArgumentTypeError(f"must be from 0 to {shown}, got {text}")
        return value

    return parse


seed = non_negative(int, SEED_MAX)
count = non_negative(int, INT64_MAX)
# momentum, weight decay: a float32 optimizer applies them, so they must fit one
non_negative_float = non_negative(float, FLOAT32_MAX)


def _runnable(name: str, parse: Callable[[str], int | float]) -> Callable[[str], int | float]:
    """kNN-Per's `name` (k or sigma), refused at parse time when no device could run it
    (knn.k_sigma_problem: k past an int64, a kernel that underflows or overflows)."""

    def check(text: str) -> int | float:
        from .knn import k_sigma_problem

        value = parse(text)
        problem = k_sigma_problem(**{name: value})
        if problem:
            raise argparse.ArgumentTypeError(problem.removeprefix(f"{name} "))
        return value

    return check


k_neighbours = _runnable("k", positive_int)
kernel_sigma = _runnable("sigma", positive_float)


def threads(text: str) -> int:
    """1 to this machine's cores: more threads only contend, and a huge count makes the thread
    pools hang while they start."""
    value = positive_int(text)
    cores = os.cpu_count() or 1
    if value > cores:
        raise argparse.ArgumentTypeError(
            f"must be at most {cores} (this machine's cores), got {text}"
        )
    return value


def byte_count(text: str) -> int:
    """byte_count.parse_byte_count: a bad value is a one-line usage error, exit 2."""
    try:
        return parse_byte_count(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


class OutputDir(str):
    """A directory a command will create or write into (`check_outputs` checks it)."""


class OutputFile(str):
    """A file a command will write (`check_outputs` checks it)."""


class OutputFileOrStdout(OutputFile):
    """A file a command will write, or `-` / /dev/stdout for standard output."""


def output_dir(text: str) -> str:
    """The argparse type of an output directory: parsing stays free of the file system (a
    command line can be parsed anywhere); `check_outputs` checks it before the work starts."""
    return OutputDir(text)


def output_file(text: str) -> str:
    """The argparse type of an output file (see output_dir)."""
    return OutputFile(text)


def output_file_or_stdout(text: str) -> str:
    """The argparse type of an output file that may be standard output (`-`, /dev/stdout)."""
    return OutputFileOrStdout(text)


def check_outputs(args: argparse.Namespace) -> None:
    """Check every output path of a parsed command line before any work starts (a long
    evaluation or export must not fail at its last step); ValueError names the flag's value
    and the problem."""
    from ._io import is_stdout, output_problem

    for value in vars(args).values():
        if isinstance(value, OutputDir):
            _check_output_dir(value)
        elif isinstance(value, OutputFile) and not (
            isinstance(value, OutputFileOrStdout) and is_stdout(value)
        ):
            problem = output_problem(value)
            if problem:
                raise ValueError(problem)


def _writable_directory(directory: Path, text: str) -> None:
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"{text}: {directory} is not writable")


def _check_output_dir(text: str) -> None:
    """An existing directory, or a new one whose nearest existing ancestor is a writable
    directory."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{text} exists and is not a directory")
    base = path
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ValueError(f"cannot make {text}: {base} is not a directory")
    _writable_directory(base, text)
