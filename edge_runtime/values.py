"""What counts as a number in a file, a message or an argument: one answer for every reader.
`True` is an int to Python but never a count or a measure here; numpy's scalars count as
Python's do (a value computed in numpy reaches a check before it is written as JSON)."""

from __future__ import annotations

import math
import numbers


def is_integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object, *, finite: bool = False) -> bool:
    """A real number (an integer included); with `finite`, not NaN nor infinite."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and (not finite or math.isfinite(value)))
