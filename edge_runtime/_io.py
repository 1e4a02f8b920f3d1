"""File input and output for every layer: durable writes (a unique temporary name created with
O_EXCL, fsync, rename, fsync the directory) and bounded reads (regular files only, sizes checked
before anything is allocated, JSON parsed with its size, nesting and numbers bounded).

A rename within one directory is atomic on POSIX file systems, so a reader (or a device that lost
power) sees either the old file or the complete new one, never half of it. A writer that created
its temporary file with O_EXCL never follows a symlink planted at that name.
"""

from __future__ import annotations

import csv
import errno
import gzip
import hashlib
import io
import json
import logging
import os
import re
import shutil
import stat
import sys
import uuid
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .errors import one_line

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
# Most arrays an .npz in a bundle may hold, and the longest .npy header numpy should parse.
MAX_NPZ_MEMBERS = 16
_MAX_NPY_HEADER = 4096
# JSON the project reads is a few levels deep; deeper is damage or an attack (RecursionError)
MAX_JSON_DEPTH = 32
# a cache of per-client rows: a few MB for thousands of clients
MAX_CACHE_BYTES = 256 << 20


def temp_path(final: Path) -> Path:
    """A temporary name beside `final` that no other writer (process or thread) will pick:
    <name>.tmp-<pid>-<random>, so a writer only ever cleans up its own temporaries."""
    return final.with_name(f"{final.name}{TMP_SUFFIX}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def writer_alive(pid: int) -> bool:
    """Whether the process that owns a temporary (by the pid in its name) may still run."""
    if pid == os.getpid() or os.name == "nt":  # on Windows os.kill(pid, 0) would end it
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but belongs to someone else
        return True
    return True


_WRITER_TMP_RE = re.compile(rf"^.+{re.escape(TMP_SUFFIX)}-(\d+)-[0-9a-f]{{8}}$")


def remove_dead_writers_files(directory: str | os.PathLike) -> list[str]:
    """Remove the temporary files (`temp_path` names) that killed writers left in
    `directory`: a unique name is never reused, so nothing else would clean them up. Those of
    live processes are theirs to finish."""
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:  # not there yet
        return removed
    for entry in entries:
        match = _WRITER_TMP_RE.match(entry.name)
        if match and not entry.is_symlink() and entry.is_file() and not writer_alive(int(match[1])):
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
    if removed:
        log.warning(
            "removed %d temporary file(s) left by interrupted writes in %s", len(removed), directory
        )
    return removed


def fsync_dir(path: str | os.PathLike) -> None:
    """Make renames inside `path` durable (not possible on Windows: skipped there)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2  # linux/fs.h


def exchange_directories(a: Path, b: Path) -> bool:
    """Swap two directories in one atomic step (Linux renameat2 RENAME_EXCHANGE), so that a
    process killed at any instant leaves each path naming one complete directory. False where
    the system cannot (another OS, an old kernel or C library, a file system without it): the
    caller then falls back to two renames."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    done = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if done != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            return False
        raise OSError(err, os.strerror(err), os.fspath(a))
    fsync_dir(a.parent)
    return True


def swap_target(path: Path) -> Path:
    """The directory a swap at `path` replaces: `path`, or the directory a link there names
    (the link is kept and goes on naming the new directory)."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def staging_directory(path: Path, kind: str = "tmp") -> Path:
    """A new unique name (.<name>.<kind>-<pid>-<random>) beside `swap_target(path)`, where a
    directory is built complete before `swap_directory` puts it at `path`; the pid lets the
    next writer remove it if this one dies (bundle.remove_abandoned_temporaries)."""
    target = swap_target(path)
    return target.parent / f".{target.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def swap_directory(staged: Path, path: Path) -> None:
    """Put the complete directory `staged` (a `staging_directory(path)`) at `path` and remove
    the one it replaces. One atomic exchange where the system offers it (a process killed at
    any instant leaves the old directory or the new one at `path`), two renames otherwise (a
    window of two system calls); the caller holds the exclusive lock on `path` where a
    directory is there, so no reader sees it change. A link at `path` is kept: the directory
    it names is the one replaced."""
    fsync_dir(staged)
    target = swap_target(path)
    if not os.path.lexists(target):
        os.rename(staged, target)
        fsync_dir(target.parent)
        return
    old = staged
    if not exchange_directories(staged, target):
        old = staging_directory(target, "old")
        os.rename(target, old)
        try:
            os.rename(staged, target)
        except BaseException:
            os.rename(old, target)
            raise
        fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def replace_synced(tmp: Path, final: Path, *, sync_dir: bool = True) -> None:
    """Rename a written, fsynced temporary over `final`, durably."""
    os.replace(tmp, final)
    if sync_dir:
        fsync_dir(final.parent)


def open_exclusive(path: Path) -> BinaryIO:
    """A new file opened for writing that did not exist before (O_EXCL): a symlink or file
    someone planted at the name is never followed or overwritten (FileExistsError instead)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    return os.fdopen(os.open(path, flags, 0o644), "wb")


def write_atomic(
    path: str | os.PathLike, write: Callable[[BinaryIO], object], *, sync_dir: bool = True
) -> None:
    """Call `write` on a new unique temporary file beside `path` (`temp_path`, `open_exclusive`),
    fsync it and rename it over `path`; on any failure the temporary file is removed."""
    final = Path(path)
    tmp = temp_path(final)
    f = open_exclusive(tmp)
    try:
        with f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        replace_synced(tmp, final, sync_dir=sync_dir)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_files_atomic(files: Sequence[tuple[Path, bytes]]) -> None:
    """Write several files as one step: each to a new unique temporary beside it first
    (`open_exclusive`: nothing planted at the name is followed), and only once all are written
    and synced are they renamed into place, so a failure (a full disk, a bad name) changes
    none of them."""
    temps: list[tuple[Path, Path]] = []
    try:
        for final, data in files:
            temps.append((temp_path(final), final))
            with open_exclusive(temps[-1][0]) as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        for tmp, final in temps:
            os.replace(tmp, final)
    except BaseException:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)
        raise
    for directory in {final.parent for _, final in temps}:
        fsync_dir(directory)


def write_path_atomic(
    path: str | os.PathLike, write: Callable[[Path], object], *, sync_dir: bool = True
) -> None:
    """`write_atomic` for a writer that takes a file name, not an open file (hnswlib's
    save_index, a download): it writes a new unique temporary name beside `path` (created
    first with O_EXCL, so no planted symlink is followed), which is fsynced and renamed over
    `path`; on any failure the temporary file is removed."""
    final = Path(path)
    tmp = temp_path(final)
    try:
        open_exclusive(tmp).close()
        write(tmp)
        fsync_file(tmp)
        replace_synced(tmp, final, sync_dir=sync_dir)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# What a user may name as an output to mean the process's standard output: written through,
# never replaced (os.replace over /dev/stdout would swap the link, or as root the device).
STDOUT_NAMES = ("-", "/dev/stdout")


def is_stdout(path: str | os.PathLike | None) -> bool:
    """Whether an output path names standard output (`STDOUT_NAMES`)."""
    return path is not None and os.fspath(path) in STDOUT_NAMES


def output_problem(path: str | os.PathLike) -> str | None:
    """Why an output file cannot be written at `path`, or None: an existing path must be a
    regular file or a link to one, since the atomic rename would replace whatever is there (a
    device such as /dev/null, a pipe, a socket: as root, the system's own node); a new one must
    lie in an existing writable directory. Standard output is the caller's to allow."""
    if is_stdout(path):
        return "standard output is not accepted here; give a file"
    text, link = os.fspath(path), os.path.islink(path)
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # new (or under a file: said below)
        if link:
            return f"{text} is a link to nothing ({os.readlink(path)}); give a file"
        mode = None
    except OSError as exc:
        return f"cannot write {text}: {exc.strerror or exc}"
    if mode is not None and stat.S_ISDIR(mode):
        return f"{text} is a directory, not a file"
    if mode is not None and not stat.S_ISREG(mode):
        return (
            f"{text} exists and is not a regular file (a device, pipe or socket); give a "
            "file path, or - for standard output where the option allows it"
        )
    parent = Path(os.path.realpath(path)).parent
    if not parent.is_dir():
        missing = "" if parent.exists() else " (it does not exist)"
        return f"cannot write {text}: {parent} is not a directory{missing}"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{text}: {parent} is not writable"
    return None


def output_target(path: str | os.PathLike) -> Path:
    """The file an output path names, checked again at write time (`output_problem`,
    ValueError): a link to a regular file is written through (its target replaced
    atomically), never replaced by a file of its own."""
    problem = output_problem(path)
    if problem:
        raise ValueError(problem)
    return Path(os.path.realpath(path))


def write_output(path: str | os.PathLike, data: bytes) -> None:
    """An output a user named: standard output for `STDOUT_NAMES` (written through), else the
    regular file it names or links to, replaced atomically (`output_target`)."""
    if is_stdout(path):
        import sys

        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    write_bytes_atomic(output_target(path), data)


def open_append(path: str | os.PathLike) -> BinaryIO:
    """A journal or log opened for appending (O_APPEND: one write() per line, so lines from
    parallel processes do not interleave), created if needed. A link at `path` is never
    followed (O_NOFOLLOW), and anything but a regular file is refused (OSError naming the
    path), so an append never lands outside the run or --out."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0), 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(
                errno.ELOOP, "is a link; appends never follow links (remove it)", os.fspath(path)
            ) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(
                errno.EINVAL, "not a regular file (a pipe, device or socket)", os.fspath(path)
            )
        return os.fdopen(fd, "ab", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def append_bytes(path: str | os.PathLike, data: bytes, *, sync: bool = False) -> None:
    """Append `data` in one write() through `open_append`."""
    with open_append(path) as f:
        f.write(data)
        if sync:
            os.fsync(f.fileno())


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, sync_dir: bool = True) -> None:
    """Write `data` to `path` through a unique temporary file (`write_atomic`)."""
    write_atomic(path, lambda f: f.write(data), sync_dir=sync_dir)


def write_text_atomic(path: str | os.PathLike, text: str, *, sync_dir: bool = True) -> None:
    """Write `text` (UTF-8) to `path` through a unique temporary file (`write_atomic`): a
    report or table killed mid-write is the old one or the new one, never half of either."""
    write_bytes_atomic(path, text.encode("utf-8"), sync_dir=sync_dir)


def csv_text(rows: Iterable[dict[str, Any]], columns: Sequence[str]) -> str:
    """`rows` as CSV text with a header of `columns` (a row's other keys are left out)."""
    out = io.StringIO(newline="")
    writer = csv.DictWriter(out, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def json_default(value: object) -> object:
    """json.dumps' `default` for every file the project writes: numpy scalars and arrays as
    Python numbers and lists, paths as strings."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def to_json_types(obj: Any) -> Any:
    """obj as JSON will give it back (numpy scalars to Python, tuples to lists, keys to
    strings): what a row or key read back from a file will be, so the two compare equal."""
    return json.loads(json.dumps(obj, default=json_default))


def json_bytes(obj: Any, *, indent: int = 2) -> bytes:
    """The bytes of every JSON file the project writes (numpy values as `json_default` says)."""
    return (json.dumps(obj, indent=indent, default=json_default) + "\n").encode("utf-8")


def write_json_atomic(
    path: str | os.PathLike, obj: dict, *, sync_dir: bool = True, indent: int = 2
) -> None:
    write_bytes_atomic(path, json_bytes(obj, indent=indent), sync_dir=sync_dir)


def save_npz_atomic(
    path: str | os.PathLike, arrays: dict[str, np.ndarray], *, sync_dir: bool = True
) -> None:
    """np.savez (uncompressed: the file size is the memory the arrays take) through a temp name."""
    write_atomic(path, lambda f: np.savez(f, **arrays), sync_dir=sync_dir)


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """Open a file for reading only if it is a regular file: a named pipe or a device would
    block the reader forever or never end, so it is refused (OSError) before any read. The
    open itself does not block (O_NONBLOCK), which for regular files changes nothing."""
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(
                errno.EINVAL, "not a regular file (a pipe, device or directory)", os.fspath(path)
            )
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, limit: int) -> bytes | None:
    """A regular file's bytes (`open_regular`), or None when it holds more than `limit`."""
    with open_regular(path) as f:
        return read_bounded(f, limit)


def read_within(path: str | os.PathLike, limit: int, fail: Callable[[str], Exception]) -> bytes:
    """`read_regular`, where every way to fail is one exception, `fail(why)`: why is "is
    missing", "cannot be read (<reason>)" (a pipe, a device, no permission) or "is over
    <limit> bytes". Every reader of an untrusted file words its refusals alike this way."""
    try:
        raw = read_regular(path, limit)
    except FileNotFoundError:
        raise fail("is missing") from None
    except OSError as exc:
        raise fail(f"cannot be read ({exc.strerror or exc})") from None
    if raw is None:
        raise fail(f"is over {limit} bytes")
    return raw


def read_bounded(f: BinaryIO, limit: int) -> bytes | None:
    """All of an open file's bytes, or None when it holds more than `limit`. Never asks for
    more than the file's size plus one byte, so a huge limit allocates nothing up front."""
    size = os.fstat(f.fileno()).st_size
    data = f.read(min(limit, size) + 1)
    return None if len(data) > limit else data


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _npy_header(f: BinaryIO, what: str) -> tuple[tuple[int, ...], np.dtype, int, bool]:
    """(shape, dtype, header bytes, Fortran order) of the .npy whose start `f` is at; nothing
    else is read."""
    version = np.lib.format.read_magic(f)
    read_header = {
        (1, 0): np.lib.format.read_array_header_1_0,
        (2, 0): np.lib.format.read_array_header_2_0,
    }.get(version)
    if read_header is None:
        raise ValueError(f"{what} has unsupported .npy version {version}")
    shape, fortran, dtype = read_header(f, max_header_size=_MAX_NPY_HEADER)
    if dtype.hasobject:
        raise ValueError(f"{what} holds Python objects (pickles: refused, allow_pickle=False)")
    return shape, dtype, f.tell(), fortran


def _data_bytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=object)) * dtype.itemsize


def _check_member(what: str, shape, dtype, header_bytes: int, stored_bytes: int) -> int:
    """The member's array bytes, after checking that its data is exactly what it declares."""
    data_bytes = _data_bytes(shape, dtype)
    if header_bytes + data_bytes != stored_bytes:
        raise ValueError(
            f"{what} declares a {dtype} array of shape {list(shape)} ({data_bytes} bytes) "
            f"but holds {stored_bytes - header_bytes} bytes of data"
        )
    return data_bytes


def _npz_members(path: str | os.PathLike, *, stored_only: bool) -> int:
    """Check every member's .npy header against its (uncompressed) size, reading only headers;
    returns the bytes its arrays take in memory. `stored_only`: refuse compressed members."""
    name = Path(path).name
    total = 0
    with open_regular(path) as raw, zipfile.ZipFile(raw) as zf:
        members = zf.infolist()
        if len(members) > MAX_NPZ_MEMBERS:
            raise ValueError(f"{name} holds {len(members)} members, more than {MAX_NPZ_MEMBERS}")
        seen = set()
        for info in members:
            what = f"{name}: member {info.filename!r}"
            if info.filename in seen or not info.filename.endswith(".npy"):
                raise ValueError(f"{what} is repeated or not an .npy array")
            seen.add(info.filename)
            compressed = info.compress_type != zipfile.ZIP_STORED
            if stored_only and (compressed or info.compress_size != info.file_size):
                raise ValueError(
                    f"{what} is compressed; bundles store arrays uncompressed (np.savez), so that "
                    "their size on disk is the memory they take"
                )
            # zipfile never inflates a member past its declared file_size, so checking the
            # header against that size bounds what decompressing it can produce
            with zf.open(info) as f:
                shape, dtype, header_bytes, _ = _npy_header(f, what)
            total += _check_member(what, shape, dtype, header_bytes, info.file_size)
    return total


def check_npz_members(path: str | os.PathLike) -> None:
    """Refuse an .npz whose arrays could take more memory than its file: every member must be
    stored uncompressed (so a member's bytes in memory are its bytes on disk) and its .npy
    header must declare exactly the array its data holds. Nothing is decompressed or allocated
    before these checks pass; ValueError names the problem."""
    _npz_members(path, stored_only=True)


def array_file_bytes(path: str | os.PathLike) -> int:
    """The memory the arrays of an .npy or .npz file take once loaded, read from their headers
    (nothing decompressed); ValueError when a header does not match the data behind it. Named
    pipes and devices are refused (`open_regular`)."""
    with open_regular(path) as f:
        is_zip = f.read(4) == b"PK\x03\x04"
        if not is_zip:
            f.seek(0)
            shape, dtype, header_bytes, _ = _npy_header(f, Path(path).name)
            return _check_member(
                Path(path).name, shape, dtype, header_bytes, os.fstat(f.fileno()).st_size
            )
    return _npz_members(path, stored_only=False)


def load_arrays(path: str | os.PathLike, limit: int, what: str = "arrays"):
    """np.load of an .npy / .npz once `array_file_bytes` shows its arrays take at most `limit`
    bytes (ValueError otherwise, before anything is decompressed or allocated); never unpickles."""
    need = array_file_bytes(path)
    if need > limit:
        raise ValueError(
            f"{path}: its {what} would take {need} bytes in memory, over the limit of {limit} bytes"
        )
    return np.load(path, allow_pickle=False)


def memory_limit() -> int:
    """Half of this machine's physical memory: what one input file's arrays may take (more
    cannot be worked on, and a file that claims more is a mistake or an attack)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (AttributeError, ValueError, OSError):  # not POSIX: a fixed, generous bound
        return 8 << 30


def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of an .npz, after `check_npz_members`, never unpickling (a bundle is
    untrusted input)."""
    check_npz_members(path)
    with np.load(path, allow_pickle=False) as f:
        return {name: f[name] for name in f.files}


class NpzRows:
    """Members of an .npz with the same number of rows, read together a chunk of rows at a time
    (a compressed member is inflated as it is read), so that what a device command holds does
    not grow with the file. Headers are checked against the members' sizes when opened; a
    member with two or more axes must be in C order (Fortran order cannot be cut into rows)."""

    def __init__(self, path: str | os.PathLike, names: Sequence[str]) -> None:
        self.path = Path(path)
        self.names = tuple(names)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, np.dtype] = {}
        with open_regular(self.path) as raw, zipfile.ZipFile(raw) as zf:
            for name in self.names:
                what = f"{self.path.name}: member {name!r}"
                info = zf.getinfo(f"{name}.npy")
                with zf.open(info) as f:
                    shape, dtype, header_bytes, fortran = _npy_header(f, what)
                _check_member(what, shape, dtype, header_bytes, info.file_size)
                if not shape:
                    raise ValueError(f"{what} is a scalar, not rows")
                if fortran and len(shape) > 1:
                    raise ValueError(f"{what} is in Fortran order; rows cannot be read in turn")
                self.shapes[name], self.dtypes[name] = shape, dtype
        counts = {self.shapes[name][0] for name in self.names}
        if len(counts) != 1:
            sizes = ", ".join(f"{n} {self.shapes[n][0]}" for n in self.names)
            raise ValueError(f"{self.path.name}: members have different numbers of rows ({sizes})")

    def __len__(self) -> int:
        return self.shapes[self.names[0]][0]

    def chunks(self, rows: int) -> Iterator[tuple[np.ndarray, ...]]:
        """Consecutive chunks of at most `rows` rows, one array per member, in order."""
        with open_regular(self.path) as raw, zipfile.ZipFile(raw) as zf:
            streams = [zf.open(f"{name}.npy") for name in self.names]
            try:
                pairs = list(zip(streams, self.names, strict=True))
                for f, name in pairs:
                    _npy_header(f, name)  # skip to the data
                for start in range(0, len(self), rows):
                    count = min(rows, len(self) - start)
                    yield tuple(self._read(f, name, count) for f, name in pairs)
            finally:
                for f in streams:
                    f.close()

    def _read(self, f: BinaryIO, name: str, count: int) -> np.ndarray:
        shape, dtype = self.shapes[name], self.dtypes[name]
        row_bytes = _data_bytes(shape[1:], dtype)
        data = f.read(count * row_bytes)
        if len(data) != count * row_bytes:
            raise ValueError(f"{self.path.name}: member {name!r} ended early")
        return np.frombuffer(data, dtype).reshape(count, *shape[1:])


class JSONFileError(ValueError):
    """A JSON file that cannot be used; the message is one line naming the file and the fix."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """object_pairs_hook refusing repeated keys (JSON allows them; the last would win silently)."""
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        raise ValueError(f"duplicate key(s) {repeated}")
    return dict(pairs)


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def json_depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def parse_json(raw: bytes, *, max_depth: int = MAX_JSON_DEPTH, strict: bool = True) -> Any:
    """Bytes -> a JSON value; ValueError whose message completes "<file> ..." for anything else
    (never RecursionError, UnicodeDecodeError without a message, or a huge integer parsed).
    `strict` also refuses repeated keys; NaN and Infinity are refused always."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("is not UTF-8 text") from None
    try:
        value = json.loads(
            text, parse_constant=_refuse_constant, object_pairs_hook=unique_keys if strict else None
        )
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except RecursionError:
        raise ValueError(f"is nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # repeated keys, NaN, integers of more than 4300 digits
        raise ValueError(f"is not usable JSON ({one_line(exc)})") from None
    if json_depth(value) > max_depth:
        raise ValueError(f"is nested deeper than {max_depth} levels")
    return value


def read_json(
    path: str | os.PathLike,
    *,
    limit: int,
    fix: str,
    max_depth: int = MAX_JSON_DEPTH,
    strict: bool = True,
) -> Any:
    """The JSON value in a regular file of at most `limit` bytes (a `.gz` name is inflated, at
    most `limit` bytes of it). Any problem is a JSONFileError naming the file, the problem and
    `fix` (what the user should do); FileNotFoundError passes through for callers that treat
    a missing file as absent."""
    try:
        raw = read_data_bytes(path, limit)
        return parse_json(raw, max_depth=max_depth, strict=strict)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise JSONFileError(f"{path} cannot be read ({exc.strerror or exc}); {fix}") from None
    except ValueError as exc:
        raise JSONFileError(f"{path} {exc}; {fix}") from None


def read_data_bytes(path: str | os.PathLike, limit: int) -> bytes:
    """A regular file's bytes, inflated when its name ends in .gz, reading no more than `limit`
    bytes of content (ValueError past it): a small .gz cannot inflate to gigabytes in memory."""
    with open_regular(path) as f:
        if not os.fspath(path).endswith(".gz"):
            data = read_bounded(f, limit)
        else:
            with gzip.GzipFile(fileobj=f) as gz:
                data = read_exactly(gz, limit + 1, short_ok=True)
            data = None if len(data) > limit else data
    if data is None:
        raise ValueError(f"is over {limit} bytes")
    return data


def read_exactly(f: BinaryIO, size: int, *, short_ok: bool = False) -> bytes:
    """`size` bytes of a stream (a .gz inflates as it is read) in chunks, so memory grows with
    the bytes that are really there and never with a size a header only claims. ValueError
    (its message completes "<file> ...") when the stream ends first (unless `short_ok`) or
    cannot be inflated."""
    out = bytearray()
    try:
        while len(out) < size:
            chunk = f.read(min(size - len(out), 1 << 20))
            if not chunk:
                break
            out += chunk
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ValueError(f"cannot be inflated ({exc})") from None
    if len(out) < size and not short_ok:
        raise ValueError(f"is truncated ({len(out)} bytes where {size} are needed)")
    return bytes(out)


def read_json_cache(path: str | os.PathLike, limit: int = MAX_CACHE_BYTES) -> dict | None:
    """A cache file's JSON object, or None when there is none or it cannot be used (damaged,
    too large, not an object: one warning line, and the caller computes it again). Callers
    still compare the cache's recorded identity with their own before using it."""
    try:
        value = read_json(path, limit=limit, fix="computing it again")
    except FileNotFoundError:
        return None
    except JSONFileError as err:
        log.warning("%s", err)
        return None
    if not isinstance(value, dict):
        log.warning("%s is not a JSON object; computing it again", path)
        return None
    return value
