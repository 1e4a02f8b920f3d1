"""A device's memory budget: the bytes its bundle may take in all, the encoder's share of them,
the room that leaves the datastore, and of that the stored samples' room after a refitted linear
head's file. One value from the command line (or `knnper-edge init`) to the device's check
before it learns, so every room is worked out here. Budgets are made before the encoder is
known (a profile gives each device its total); the exporter then adds the encoder's share with
`with_encoder`. A bundle's is its manifest's (`Manifest.budget`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .values import is_integer


@dataclass(frozen=True)
class Budget:
    """A device's memory for one bundle, in bytes; `room` is what the datastore may take.

    Parameters
    ----------
    total : bytes for the encoder and the datastore together (a positive integer).
    encoder : bytes of them the encoder's file takes (a client's own encoder, with the linear
        base); None until it is known (`with_encoder`).
    head : bytes of the room the linear head's file takes where the device refits one
        (`with_head`); 0 otherwise.
    """

    total: int
    encoder: int | None = None
    head: int = 0

    def __post_init__(self) -> None:
        if not is_integer(self.total) or self.total < 1:
            raise ValueError(f"budget_bytes must be a positive integer, got {self.total!r}")
        object.__setattr__(self, "total", int(self.total))  # a numpy integer writes as JSON
        for name, what in (("encoder", "an encoder's"), ("head", "a head file's")):
            value = getattr(self, name)
            if value is None:  # the encoder, not known yet
                continue
            if not is_integer(value) or value < 0:
                raise ValueError(f"{what} bytes must be a non-negative integer, got {value!r}")
            object.__setattr__(self, name, int(value))

    def with_encoder(self, nbytes: int) -> Budget:
        """This budget with the encoder's share known: `nbytes`, the encoder's file."""
        return replace(self, encoder=nbytes)

    def with_head(self, nbytes: int) -> Budget:
        """This budget with a refitted head's file (`nbytes`) taken from the datastore's room."""
        return replace(self, head=nbytes)

    @property
    def room(self) -> int:
        """The datastore's bytes: what the encoder leaves (negative: it alone is over)."""
        if self.encoder is None:
            raise ValueError(
                f"a budget of {self.total} bytes has no room yet: its encoder's "
                "share is not known (Budget.with_encoder)"
            )
        return self.total - self.encoder

    @property
    def sample_room(self) -> int:
        """The stored samples' bytes: the room less the refitted head's file."""
        return self.room - self.head
