"""Ctrl-C while a command's heavy modules import (both console scripts use it).

A KeyboardInterrupt raised inside `import numpy` or `import torch` prints a traceback from
wherever the import was; the commands' own handling (one line, exit 130) only starts once they
run. Until then nothing has been read or written, so ending the process at once is safe. This
module imports only the standard library, so its handler is in place within milliseconds.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


@contextmanager
def exit_on_interrupt(prog: str) -> Iterator[None]:
    """Inside: Ctrl-C prints "PROG: interrupted" and exits 130 at once. The previous handler
    returns afterwards; an ignored SIGINT (a background job) stays ignored, and outside the
    main thread (where handlers cannot be set) nothing changes."""

    def interrupted(signum: int, frame: object) -> None:
        os.write(2, f"{prog}: interrupted\n".encode())
        os._exit(INTERRUPTED)

    previous = None
    try:
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            previous = signal.signal(signal.SIGINT, interrupted)
    except ValueError:  # not the main thread
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
