"""The one answer to "is this a number" that every reader of files, messages and arguments
uses: a bool never counts, numpy scalars count as Python's do."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from edge_runtime.values import is_integer, is_real


@pytest.mark.parametrize(
    "value, integer, real, finite",
    [
        (3, True, True, True),
        (np.int64(-2), True, True, True),
        (np.uint8(7), True, True, True),
        (True, False, False, False),
        (np.bool_(True), False, False, False),
        (2.0, False, True, True),
        (np.float32(0.5), False, True, True),
        (Fraction(1, 3), False, True, True),
        (math.inf, False, True, False),
        (-math.inf, False, True, False),
        (math.nan, False, True, False),
        ("3", False, False, False),
        (None, False, False, False),
        ([1], False, False, False),
    ],
)
def test_integers_and_reals(value, integer, real, finite):
    assert is_integer(value) is integer
    assert is_real(value) is real
    assert is_real(value, finite=True) is finite
