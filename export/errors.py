"""Exceptions the exporter raises for problems a user can fix (budgets, backends, bad runs)."""

from __future__ import annotations

from fed_train.errors import KnnperError

__all__ = ["ExportError", "BudgetInvalid"]


class ExportError(KnnperError, ValueError):
    """An export cannot proceed: bad settings, a model that does not convert, a client with no
    data. The `knnper` CLI prints the one-line message and exits with 2."""


class BudgetInvalid(ExportError):
    """A device budget the exporter cannot meet: malformed, or too small for even the encoder.
    (The device's edge_runtime.errors.BudgetExceeded is a different event: an update or a write
    that would take a valid budget's bytes.)"""
