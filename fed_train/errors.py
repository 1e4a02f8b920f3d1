"""Exceptions the server side raises for problems a user can fix (bad data, bad settings)."""

from __future__ import annotations

__all__ = ["KnnperError", "DataError", "PartitionError", "TrainingError", "TrainingDiverged"]


class KnnperError(Exception):
    """Base of every expected failure; the CLI prints its one-line message and exits with 2."""


class DataError(KnnperError, ValueError):
    """A data set is unknown, missing, or malformed (wrong magic, truncated, bad shapes)."""


class PartitionError(KnnperError, ValueError):
    """A partition cannot be made with the given settings, or a saved one is unreadable."""


class TrainingError(KnnperError, RuntimeError):
    """Training went wrong in a way the user should hear about (for example a NaN loss)."""


class TrainingDiverged(TrainingError):
    """The training loss became NaN or infinite: this learning rate is unusable, which a
    learning-rate grid records and skips (any other TrainingError stops it)."""
