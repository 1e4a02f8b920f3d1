"""Advisory locks on a bundle directory, so that processes sharing one bundle never interleave.

Writers (`Runtime.add`, replacing a bundle) hold an exclusive lock from reading the manifest to
committing the new one; readers (`read_bundle`) hold a shared lock while they read the manifest
and the files it lists, so a reader sees one complete generation, never the manifest of one and
the files of the next. The lock is flock(2) on the directory itself: no lock file is written
into the bundle, and the kernel releases it when a process dies, so a killed writer never leaves
a bundle locked. Locks are advisory: they order processes that use this runtime, nothing else.
Without fcntl (Windows) the locks are no-ops and the runtime is single-process only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

DEFAULT_LOCK_TIMEOUT = 30.0
_POLL_SECONDS = 0.005


class LockTimeout(TimeoutError):
    """The lock was held by another process for longer than the timeout."""


@contextmanager
def directory_lock(
    directory: str | os.PathLike, *, exclusive: bool, timeout: float = DEFAULT_LOCK_TIMEOUT
) -> Iterator[None]:
    """Hold a shared or exclusive flock on `directory` for the `with` block; LockTimeout when
    another process holds a conflicting lock for more than `timeout` seconds."""
    if fcntl is None:
        yield
        return
    fd = os.open(os.fspath(directory), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            try:
                fcntl.flock(fd, mode)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeout(
                        f"{os.fspath(directory)} is busy: another process has held its "
                        f"{'lock' if exclusive else 'write lock'} for over {timeout:g} s"
                    ) from None
                time.sleep(_POLL_SECONDS)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
