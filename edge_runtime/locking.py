"""Advisory locks on a bundle directory, so that processes sharing one bundle never interleave.

Writers (`Runtime.add`, `Runtime.upgrade`, replacing a bundle) hold an exclusive lock from
reading the manifest to committing the new one; readers (`read_bundle`) hold a shared lock while
they read the manifest and the files it lists, so a reader sees one complete generation, never
the manifest of one and the files of the next. The lock is flock(2) on the directory itself, and
the kernel releases every lock when a process dies, so a killed writer never leaves a bundle
locked. Locks are advisory: they order processes that use this runtime, nothing else.

Writers go first: flock grants a shared lock whenever no exclusive one is held, so readers that
load in a tight loop would keep a waiting writer out indefinitely. A turnstile fixes that: a
writer takes an exclusive flock on a second, stable file, the hidden sibling `.<bundle>.lock` in
the bundle's parent, before it waits for the directory, and holds it until it is done; a reader
takes a shared flock on the turnstile only until it holds its shared lock on the directory. A
waiting writer thus waits for the readers already inside, and no new reader gets in before it.
Once locked, both check that the directory they locked is still the one at the path, and lock
again if an upgrade exchanged it meanwhile. Writers create the turnstile; a reader writes
nothing (until the first writer creates it, readers lock the directory alone).
The turnstile is a sibling, not inside the bundle (no lock file is written into a bundle), and
stays meaningful when an upgrade exchanges the bundle's directory for a new one: its inode does
not change. It is opened with O_NOFOLLOW and must be a regular file with one link: a link there
is refused (LinkRefused). Where the parent is not writable and no turnstile exists, the
directory lock alone orders processes (without writer preference).
Without fcntl (Windows) the locks are no-ops and the runtime is single-process only.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

DEFAULT_LOCK_TIMEOUT = 30.0
_POLL_SECONDS = 0.005
# a writer polls the turnstile faster: readers hold it only for a few system calls each
_TURNSTILE_POLL_SECONDS = 0.0005


class LockTimeout(TimeoutError):
    """The lock was held by another process for longer than the timeout."""


class LinkRefused(OSError):
    """The turnstile's path is a link or not a regular file: it is not followed."""


_NOT_PLAIN = "is not a plain lock file (a link or another kind of file); remove it"


def turnstile_path(directory: str | os.PathLike) -> str:
    """The turnstile of `directory`: `.<name>.lock` beside it."""
    head, name = os.path.split(os.path.abspath(os.fspath(directory)))
    return os.path.join(head, f".{name}.lock")


def _open_turnstile(directory: str | os.PathLike, *, create: bool) -> int | None:
    """A descriptor on the turnstile, created if missing when `create` (writers); None where
    there is none and it cannot or need not be created (a reader writes nothing)."""
    path = turnstile_path(directory)
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = None
    try:
        if create:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o644)
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                    raise
        if fd is None:  # another user's turnstile can still be locked read-only
            fd = os.open(path, os.O_RDONLY | flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LinkRefused(errno.ELOOP, f"{path} is a link; remove it", path) from None
        if exc.errno in (errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):  # a socket, a device
            raise LinkRefused(exc.errno, f"{path} {_NOT_PLAIN}", path) from None
        if exc.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS):
            return None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise LinkRefused(errno.EPERM, f"{path} {_NOT_PLAIN}", path)
    return fd


def _flock(fd: int, mode: int, deadline: float, poll: float, what: str) -> None:
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LockTimeout(what) from None
            time.sleep(poll)


@contextmanager
def directory_lock(
    directory: str | os.PathLike, *, exclusive: bool, timeout: float = DEFAULT_LOCK_TIMEOUT
) -> Iterator[None]:
    """Hold a shared or exclusive flock on `directory` for the `with` block, writers first
    (see the module docstring); LockTimeout when another process holds a conflicting lock for
    more than `timeout` seconds."""
    if fcntl is None:
        yield
        return
    busy = (
        f"{os.fspath(directory)} is busy: another process has held its "
        f"{'lock' if exclusive else 'write lock'} for over {timeout:g} s"
    )
    deadline = time.monotonic() + max(0.0, timeout)
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    fd = os.open(os.fspath(directory), flags)  # first: a missing bundle gets no turnstile
    gate = None
    try:  # closing a descriptor releases its lock
        gate = _open_turnstile(directory, create=exclusive)
        try:
            if gate is not None:
                _flock(
                    gate,
                    fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH,
                    deadline,
                    _TURNSTILE_POLL_SECONDS if exclusive else _POLL_SECONDS,
                    busy,
                )
            while True:
                _flock(
                    fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, deadline, _POLL_SECONDS, busy
                )
                if os.path.samestat(os.fstat(fd), os.stat(directory)):
                    break
                # an upgrade exchanged the directory while this process waited: lock the one
                # in place now
                os.close(fd)
                fd = -1
                fd = os.open(os.fspath(directory), flags)
        finally:
            if gate is not None and not exclusive:  # a reader inside lets the next writer queue
                os.close(gate)
                gate = None
        yield
    finally:
        if fd >= 0:
            os.close(fd)
        if gate is not None:
            os.close(gate)
