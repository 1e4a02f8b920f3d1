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


def _exit_at_once(prog: str) -> Callable[[int, object], None]:
    def interrupted(signum: int, frame: object) -> None:
        os.write(2, f"{prog}: interrupted\n".encode())
        os._exit(INTERRUPTED)

    return interrupted


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
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
