"""What counts as a number in a file, a message or an argument: one answer for every reader.
`True` is an int to Python but never a count or a measure here; numpy's scalars count as
Python's do (a value computed in numpy reaches a check before it is written as JSON)."""

from __future__ import annotations

import math
import numbers


def is_integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object, *, finite: bool = False) -> bool:
    """A real number (an integer included); with `finite`, not NaN nor infinite, and as a
    float (the kind every consumer turns it into) not past float64's range."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:  # a 400-digit integer is no float: math.isfinite raises OverflowError for it
        return not finite or math.isfinite(value)
    except OverflowError:
        return False
