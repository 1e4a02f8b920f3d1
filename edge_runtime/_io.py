"""Durable file writes for bundles: write a temporary name, fsync, rename, fsync the directory.

A rename within one directory is atomic on POSIX file systems, so a reader (or a device that lost
power) sees either the old file or the complete new one, never half of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
import zipfile
from pathlib import Path

import numpy as np

TMP_SUFFIX = ".tmp"
# Most arrays an .npz in a bundle may hold, and the longest .npy header numpy should parse.
MAX_NPZ_MEMBERS = 16
_MAX_NPY_HEADER = 4096


def temp_path(final: Path) -> Path:
    """A temporary name beside `final` that no other writer (process or thread) will pick:
    <name>.tmp-<pid>-<random>, so a writer only ever cleans up its own temporaries."""
    return final.with_name(f"{final.name}{TMP_SUFFIX}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


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


def _replace_synced(tmp: Path, final: Path, *, sync_dir: bool) -> None:
    os.replace(tmp, final)
    if sync_dir:
        fsync_dir(final.parent)


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, sync_dir: bool = True) -> None:
    """Write `data` to `path` through `path.tmp`, fsynced, then renamed over `path`."""
    final = Path(path)
    tmp = temp_path(final)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _replace_synced(tmp, final, sync_dir=sync_dir)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _numpy_to_json(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def to_json_types(obj: dict) -> dict:
    """obj as JSON will give it back (numpy scalars to Python, tuples to lists)."""
    return json.loads(json.dumps(obj, default=_numpy_to_json))


def write_json_atomic(path: str | os.PathLike, obj: dict, *, sync_dir: bool = True) -> None:
    text = json.dumps(obj, indent=2, default=_numpy_to_json) + "\n"
    write_bytes_atomic(path, text.encode("utf-8"), sync_dir=sync_dir)


def save_npz_atomic(
    path: str | os.PathLike, arrays: dict[str, np.ndarray], *, sync_dir: bool = True
) -> None:
    """np.savez (uncompressed: the file size is the memory the arrays take) through a temp name."""
    final = Path(path)
    tmp = temp_path(final)
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        _replace_synced(tmp, final, sync_dir=sync_dir)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_npz_members(path: str | os.PathLike) -> None:
    """Refuse an .npz whose arrays could take more memory than its file: every member must be
    stored uncompressed (so a member's bytes in memory are its bytes on disk) and its .npy
    header must declare exactly the array its data holds. Nothing is decompressed or allocated
    before these checks pass; ValueError names the problem."""
    name = Path(path).name
    with zipfile.ZipFile(path) as zf:
        members = zf.infolist()
        if len(members) > MAX_NPZ_MEMBERS:
            raise ValueError(f"{name} holds {len(members)} members, more than {MAX_NPZ_MEMBERS}")
        seen = set()
        for info in members:
            what = f"{name}: member {info.filename!r}"
            if info.filename in seen or not info.filename.endswith(".npy"):
                raise ValueError(f"{what} is repeated or not an .npy array")
            seen.add(info.filename)
            if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                raise ValueError(
                    f"{what} is compressed; bundles store arrays uncompressed (np.savez), so that "
                    "their size on disk is the memory they take"
                )
            with zf.open(info) as f:
                version = np.lib.format.read_magic(f)
                read_header = {
                    (1, 0): np.lib.format.read_array_header_1_0,
                    (2, 0): np.lib.format.read_array_header_2_0,
                }.get(version)
                if read_header is None:
                    raise ValueError(f"{what} has unsupported .npy version {version}")
                shape, _, dtype = read_header(f, max_header_size=_MAX_NPY_HEADER)
                header_bytes = f.tell()
            if dtype.hasobject:
                raise ValueError(f"{what} holds Python objects")
            data_bytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
            if header_bytes + data_bytes != info.file_size:
                raise ValueError(
                    f"{what} declares a {dtype} array of shape {list(shape)} ({data_bytes} bytes) "
                    f"but holds {info.file_size - header_bytes} bytes of data"
                )


def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of an .npz, after `check_npz_members`, never unpickling (a bundle is
    untrusted input)."""
    check_npz_members(path)
    with np.load(path, allow_pickle=False) as f:
        return {name: f[name] for name in f.files}
