"""Byte counts as people write them, read the same way by both command lines: `500000`,
`500kB`, `1.5MB`, `2MiB`, `1.5M`, `2 MB` (SI powers of 1000 and IEC powers of 1024, any case,
the `B` optional, a space before the unit allowed: README.md says so). Whole bytes only: a
count that works out to a fraction of a byte is refused rather than rounded, since a budget is
a promise about memory."""

from __future__ import annotations

import re
from decimal import Decimal

MAX_BYTES = 2**50  # 1 PiB: no device has more; a larger number is a typo
_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "p": 10**15,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
    "pi": 2**50,
}
_PATTERN = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*([kmgtp]i?)?b?", re.IGNORECASE)


def parse_byte_count(text: str) -> int:
    """The number of bytes `text` says; ValueError (one line) for anything else: empty,
    negative, nan, inf, exponents, unknown units, fractions of a byte, zero, over 1 PiB."""
    match = _PATTERN.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"not a byte count: {text!r} (write e.g. 500000, 500kB, 1.5MB or 2MiB)")
    value = Decimal(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    if value != value.to_integral_value():
        raise ValueError(f"not a whole number of bytes: {text!r} is {value.normalize():f} bytes")
    if not 1 <= value <= MAX_BYTES:
        raise ValueError(f"a byte count must be between 1 byte and 1 PiB, got {text!r}")
    return int(value)
