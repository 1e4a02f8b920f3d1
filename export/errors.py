"""Exceptions the exporter raises for problems a user can fix (budgets, backends, bad runs)."""

from __future__ import annotations

from fed_train.errors import KnnperError

__all__ = ["ExportError", "BudgetError"]


class ExportError(KnnperError, ValueError):
    """An export cannot proceed: bad settings, a model that does not convert, a client with no
    data. The `knnper` CLI prints the one-line message and exits with 2."""


class BudgetError(ExportError):
    """A device budget is malformed, or too small for even the encoder."""
