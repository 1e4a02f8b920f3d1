"""Worker processes that never outlive their command: spawned (torch and onnxruntime hold thread
pools that a forked child inherits in an undefined state), deaf to Ctrl-C (the terminal sends
it to the whole process group; the command's own process answers it), and terminated at once
when the command stops on an error or Ctrl-C, however many times Ctrl-C is pressed.

What a worker writes must be crash-safe on its own (atomic renames, journals): a terminated
worker leaves at most a temporary file, which the resumed command removes."""

from __future__ import annotations

import io
import multiprocessing
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any

JOIN_SECONDS = 5.0  # after SIGTERM, before SIGKILL
CLEAR_LINE = "\r\x1b[K"  # to the line's start, then erase it


class OwnLines(io.TextIOBase):
    """A worker's stdout or stderr on a terminal: every line it writes starts by clearing the
    terminal line it lands on, so a warning a worker prints while the command's progress bar is
    drawn replaces the bar (redrawn at its next update) instead of gluing onto it."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self._at_line_start = True

    def write(self, text: str) -> int:
        pieces = []
        for piece in text.splitlines(keepends=True):
            if self._at_line_start:
                pieces.append(CLEAR_LINE)
            pieces.append(piece)
            self._at_line_start = piece.endswith(("\n", "\r"))
        self.stream.write("".join(pieces))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


@contextmanager
def ignoring_ctrl_c() -> Iterator[None]:
    """Cleanup that a further Ctrl-C must not cut short: cut short, it leaves processes
    behind. Only the main thread may change signal handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _start_worker(initializer: Callable[..., None] | None, initargs: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and stream.isatty():
            setattr(sys, name, OwnLines(stream))
    if initializer is not None:
        initializer(*initargs)


@contextmanager
def worker_pool(
    workers: int, initializer: Callable[..., None] | None = None, initargs: tuple = ()
) -> Iterator[ProcessPoolExecutor]:
    """A spawned process pool. Leaving the block normally waits for the submitted work;
    leaving it by an exception (KeyboardInterrupt included) cancels what has not started and
    terminates the workers, ignoring Ctrl-C until they are gone."""
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_start_worker,
        initargs=(initializer, initargs),
    )
    try:
        yield pool
    except BaseException:
        with ignoring_ctrl_c():
            terminate_pool(pool)
        raise
    pool.shutdown(wait=True)


def terminate_pool(pool: ProcessPoolExecutor) -> None:
    """SIGTERM every worker, SIGKILL any still there after JOIN_SECONDS, then let the pool's
    manager thread see them gone (so interpreter exit does not wait on it)."""
    processes: list[Any] = list((pool._processes or {}).values())
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(JOIN_SECONDS)
        if process.is_alive():
            process.kill()
            process.join(JOIN_SECONDS)
    pool.shutdown(wait=True, cancel_futures=True)
