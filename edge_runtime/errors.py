"""The runtime's error types: every problem with a bundle is a BundleError with a one-line
message, so a caller (or the CLI) catches one type and prints one line."""

from __future__ import annotations


def one_line(exc: BaseException, *, first_line: bool = False) -> str:
    """An exception's message on one line (its type's name when it has none): its lines joined,
    or with `first_line` the first alone (onnxruntime's and torch's messages run on for a
    screen after the line that names the problem)."""
    text = str(exc).strip()
    if first_line and text:
        text = text.splitlines()[0]
    return " ".join(text.split()) or type(exc).__name__


class BundleError(ValueError):
    """A bundle that cannot be used (or written) as it is; the message is one line."""


class BudgetExceeded(BundleError):
    """The files would take more bytes than the bundle's budget.

    Parameters
    ----------
    message : the one-line error shown to the user.
    needed : the bytes the files would take.
    budget : the budget's total bytes.
    """

    def __init__(self, message: str, needed: int, budget: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.budget = budget


class BundleBusy(BundleError):
    """Another process held the bundle's lock for longer than the timeout; try again later."""


class SignatureError(BundleError):
    """A runtime that trusts a signing key met a bundle that is unsigned or does not verify."""
