"""Progress of a long command over countable units (rounds, epochs, clients, training runs):
tqdm's bar on a terminal; anywhere else (a log file, a pipe, CI) a plain line at least every
30 s, written by a heartbeat thread so that one slow unit cannot silence the log. The time left
is the measured time per finished unit times the units left (per unit of `work` where units
differ in size, e.g. clients by their sample count), and the line says what it was measured
on; before the first unit finishes there is no estimate, and the line says so. The terminal's
bar shows the same estimate (tqdm's own would time the units read back from an interrupted
call as if they had just run, and promise minutes for hours of work)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TextIO

from tqdm import tqdm

EVERY_S = 30.0  # the longest a log goes without a line
# tqdm's bar with this module's estimate in place of tqdm's rate-based one
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


def duration(seconds: float) -> str:
    """90 -> '1m30s', 4000 -> '1h06m40s', 7.2 -> '7s'."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Progress:
    """`update()` once per finished unit (in any order: `work` names the finished unit's
    share when units differ). `initial`: units already done before this call (a resumed
    command); the estimate counts only the units measured in this call. `total` None: the
    count is not known ahead (lines then give the measured time per unit, no time left). Use
    it as a context manager, or call `close()`, so the heartbeat stops."""

    def __init__(
        self,
        total: int | None,
        *,
        desc: str,
        unit: str,
        enabled: bool = True,
        initial: int = 0,
        total_work: float | None = None,
        every_s: float = EVERY_S,
        stream: TextIO | None = None,
    ) -> None:
        self.total, self.done, self.desc, self.unit = total, initial, desc, unit
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self.postfix = ""
        self._initial = initial
        self._work_left = (
            float(total_work)
            if total_work is not None
            else float(total - initial)
            if total is not None
            else 0.0
        )
        self._work_done = 0.0
        self._start = self._last = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bar: tqdm | None = None
        self._beat: threading.Thread | None = None
        if not enabled or (total is not None and total <= initial):
            return
        if self.stream.isatty():
            self._bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit=f" {unit}",
                file=self.stream,
                bar_format=BAR_FORMAT,
            )
            self._bar.set_postfix_str(self._bar_text())
        else:
            self._beat = threading.Thread(
                target=self._heartbeat, daemon=True, name=f"progress-{desc}"
            )
            self._beat.start()

    def update(self, work: float = 1.0, *, measured: bool = True) -> None:
        """One unit finished; `measured` False: it was read back from a cache, so its time
        says nothing about the units left."""
        with self._lock:
            self.done += 1
            self._work_left = max(0.0, self._work_left - work)
            if measured:
                self._work_done += work
            else:
                self._initial += 1
            if self._bar is not None:
                self._bar.set_postfix_str(self._bar_text(), refresh=False)
                self._bar.update(1)
            elif self._beat is not None and (
                self.done == self.total or time.monotonic() - self._last >= self.every_s
            ):
                self._print()

    def set_postfix(self, text: str) -> None:
        """Shown after the counts (e.g. the last epoch's loss)."""
        self.postfix = text
        if self._bar is not None:
            self._bar.set_postfix_str(self._bar_text())

    def left(self, now: float | None = None) -> str:
        """The time left as the lines say it: measured on this call's own units only."""
        if self.total is None or self.done >= self.total:
            return ""
        now = time.monotonic() if now is None else now
        if self.done == self._initial:
            return f"no estimate until the first {self.unit} finishes"
        return f"about {duration((now - self._start) / self._work_done * self._work_left)} left"

    def _bar_text(self) -> str:
        return "; ".join(t for t in (self.left(), self.postfix) if t)

    def line(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        elapsed = now - self._start
        units = f"{self.unit}s" if self.total != 1 else self.unit
        fresh = self.done - self._initial
        if self.total is None:
            text = f"{self.desc}: {self.done} {units} done, {duration(elapsed)} elapsed"
            if fresh:
                text += f" (measured {duration(elapsed / fresh)} per {self.unit} over {fresh})"
            return f"{text}; {self.postfix}" if self.postfix else text
        text = f"{self.desc}: {self.done}/{self.total} {units} done, {duration(elapsed)} elapsed"
        if self.done >= self.total:
            text = f"{self.desc}: {self.done}/{self.total} {units} done in {duration(elapsed)}"
        elif fresh == 0:
            text += f", {self.left(now)}"
        else:
            text += (
                f", {self.left(now)} (measured "
                f"{duration(elapsed / fresh)} per {self.unit} over {fresh})"
            )
        return f"{text}; {self.postfix}" if self.postfix else text

    def _print(self) -> None:
        self._last = time.monotonic()
        print(self.line(self._last), file=self.stream, flush=True)

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s)):
            with self._lock:
                if time.monotonic() - self._last >= self.every_s and (
                    self.total is None or self.done < self.total
                ):
                    self._print()

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def track(
    items: Iterable[Any],
    *,
    total: int,
    desc: str,
    unit: str,
    enabled: bool = True,
    initial: int = 0,
    work: Sequence[float] | None = None,
) -> Iterator[Any]:
    """Iterate `items`, counting one unit as each one's turn ends; `work`: each item's share,
    in order, when items differ in cost."""
    shares = list(work) if work is not None else None
    with Progress(
        total,
        desc=desc,
        unit=unit,
        enabled=enabled,
        initial=initial,
        total_work=sum(shares) if shares is not None else None,
    ) as progress:
        for i, item in enumerate(items):
            yield item
            progress.update(shares[i] if shares is not None else 1.0)
