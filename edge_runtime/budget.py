"""A device's memory budget: the bytes its bundle may take in all, the encoder's share of them,
and the room that leaves the datastore. One value from the exporter (or `knnper-edge init`) to
the device's check before it learns, so the room is worked out in one place; a manifest
records it as `budget_bytes` and its footprint's `encoder`."""

from __future__ import annotations

import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    """`total` bytes for the encoder and the datastore together, `encoder` of them the
    encoder's (a client's own encoder, with the linear base)."""

    total: int
    encoder: int

    def __post_init__(self) -> None:
        if not _is_count(self.total) or self.total < 1:
            raise ValueError(f"budget_bytes must be a positive integer, got {self.total!r}")
        if not _is_count(self.encoder) or self.encoder < 0:
            raise ValueError(f"an encoder's bytes must be a non-negative integer, got "
                             f"{self.encoder!r}")
        object.__setattr__(self, "total", int(self.total))  # a numpy integer writes as JSON
        object.__setattr__(self, "encoder", int(self.encoder))

    @property
    def room(self) -> int:
        """The datastore's bytes: what the encoder leaves (negative: it alone is over)."""
        return self.total - self.encoder

    @classmethod
    def of(cls, manifest: dict) -> Budget:
        """A bundle's budget, from its validated manifest."""
        return cls(manifest["budget_bytes"], manifest["footprint"]["encoder"])


def _is_count(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
