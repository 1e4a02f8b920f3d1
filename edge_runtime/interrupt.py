"""Ctrl-C while a command's heavy modules import (both console scripts use it).

A KeyboardInterrupt raised inside `import numpy` or `import torch` prints a traceback from
wherever the import was; the commands' own handling (one line, exit 130) only starts once they
run. Until then nothing has been read or written, so ending the process at once is safe. This
module imports only the standard library, so its handler is in place within milliseconds.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


# the handler a console script started with, where `exit_while_starting` replaced it
_STARTED_WITH: list[Any] = []


def _exit_at_once(prog: str) -> Callable[[int, object], None]:
    def interrupted(signum: int, frame: object) -> None:
        os.write(2, f"{prog}: interrupted\n".encode())
        os._exit(INTERRUPTED)

    interrupted.exits_at_once = True  # type: ignore[attr-defined]
    return interrupted


def exit_while_starting(prog: str) -> None:
    """For a console script, from the first statement of the package it imports (its
    __init__): Ctrl-C is one line and 130 before the package's own imports, until
    `exit_on_interrupt` hands over to the handler the process started with."""
    previous = _install(prog)
    if previous is not None and not _STARTED_WITH:
        _STARTED_WITH.append(previous)


def _install(prog: str) -> Any:
    """Ctrl-C ends the process at once with one line; returns the previous handler (None where
    nothing changed: an ignored SIGINT, a background job's, stays ignored, and outside the main
    thread handlers cannot be set)."""
    try:
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            return signal.signal(signal.SIGINT, _exit_at_once(prog))
    except ValueError:  # not the main thread
        pass
    return None


def exit_quietly_from_now(prog: str) -> None:
    """For a console script whose command has returned: a Ctrl-C while the interpreter shuts
    down (exit handlers, thread joins) is one line and 130, not a traceback from them."""
    _install(prog)


@contextmanager
def exit_on_interrupt(prog: str) -> Iterator[None]:
    """Inside: Ctrl-C prints "PROG: interrupted" and exits 130 at once. The previous handler
    returns afterwards (`_install` says where nothing changes)."""
    previous = _install(prog)
    if getattr(previous, "exits_at_once", False):  # installed at start: hand over to the first
        previous = _STARTED_WITH[0] if _STARTED_WITH else signal.default_int_handler
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
