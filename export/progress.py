"""Progress over the clients of an export: tqdm's bar (with its estimate) on a terminal, and plain
periodic lines otherwise, so a log file gets readable lines instead of carriage returns."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class ClientProgress:
    """`update()` once per finished client. `initial`: clients already done (a resumed export);
    the estimate counts only the clients done in this call."""

    def __init__(self, total: int, *, desc: str = "export", enabled: bool = True,
                 initial: int = 0, every_s: float = 30.0, stream: TextIO | None = None) -> None:
        self.total, self.done, self.desc = total, initial, desc
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.every_s = every_s
        self._initial = initial
        self._start = self._last = time.monotonic()
        terminal = enabled and self.stream.isatty()
        self._bar = (tqdm(total=total, initial=initial, desc=desc, unit="client",
                          file=self.stream) if terminal else None)

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
            return
        now = time.monotonic()
        if self.enabled and (now - self._last >= self.every_s or self.done == self.total):
            self._last = now
            print(self.line(now), file=self.stream, flush=True)

    def line(self, now: float | None = None) -> str:
        elapsed = (now or time.monotonic()) - self._start
        fresh = self.done - self._initial
        text = (f"{self.desc}: {self.done}/{self.total} clients, {_duration(elapsed)} elapsed")
        if 0 < fresh and self.done < self.total:
            text += f", about {_duration(elapsed / fresh * (self.total - self.done))} left"
        return text

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
