"""Durable file writes for bundles: write a temporary name, fsync, rename, fsync the directory.

A rename within one directory is atomic on POSIX file systems, so a reader (or a device that lost
power) sees either the old file or the complete new one, never half of it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

TMP_SUFFIX = ".tmp"


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
    tmp = final.with_name(final.name + TMP_SUFFIX)
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
    tmp = final.with_name(final.name + TMP_SUFFIX)
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


def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of an .npz, never unpickling (a bundle is untrusted input)."""
    with np.load(path, allow_pickle=False) as f:
        return {name: f[name] for name in f.files}
