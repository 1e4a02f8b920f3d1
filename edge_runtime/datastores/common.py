"""What every datastore backend shares: file names with generations, input and file checks."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..values import is_integer, is_real

FLAT_DTYPES = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8}
# Per-array overhead of an uncompressed .npz (zip headers + .npy header), generously rounded up.
_NPZ_ARRAY_OVERHEAD = 512
# The file's own overhead, with the member every datastore saves beside its arrays: the embedding
# id of the encoder that embedded its keys (32 bytes, edge_runtime.versions).
_NPZ_FILE_OVERHEAD = 512 + 320  # that member takes 288 bytes (measured)


# The memory model a budget is held to, in memory as on disk. A device process may pass its
# budget by 2 MiB: onnxruntime's session of the bundle, and a prediction's distance matrices of up
# to WORK_CELLS cells (the predictor cuts its batches to that). What a datastore holds beside its
# files (key norms, sums) and the intermediates of a search past WORK_CELLS cells (one input
# against every key) are counted in the budget: `search_nbytes`, part of each backend's
# `estimate_nbytes`, by which the exporter, `knnper-edge init` and `add` size a datastore and
# benchmarks/runtime_memory.py sets the budget it checks.
WORK_CELLS = 1 << 13


def search_nbytes(searched: int, held_per_key: int, cell_bytes: int) -> int:
    """Bytes a device holds beside a datastore's files to search `searched` keys:
    `held_per_key` each, and `cell_bytes` for every distance cell past WORK_CELLS."""
    return searched * held_per_key + cell_bytes * max(0, searched - WORK_CELLS)


def datastore_file_name(stem: str, ext: str, generation: int) -> str:
    """datastore.npz for generation 0, datastore.<g>.npz after g on-device updates."""
    return f"{stem}.{ext}" if generation == 0 else f"{stem}.{generation}.{ext}"


_GENERATION_RE = re.compile(r"^(?:datastore|hnsw)(?:\.(\d+))?\.(?:npz|bin)$")
DATASTORE_FILE_RE = re.compile(r"^(?:datastore|hnsw)(?:\.\d+)?\.(?:npz|bin)(?:\.tmp)?$")


def file_generation(name: str) -> int:
    """The generation number in a datastore file name (0 for datastore.npz / hnsw.bin)."""
    m = _GENERATION_RE.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a datastore file name")
    return int(m.group(1) or 0)


def max_count_within(estimate: Callable[[int], int], room: int) -> int:
    """The largest n >= 1 with estimate(n) <= room, or 0; estimate must grow with n."""
    if estimate(1) > room:
        return 0
    lo, hi = 1, 2
    while estimate(hi) <= room:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if estimate(mid) <= room else (lo, mid)
    return lo


# ----------------------------------------------------------------------------- shared checks


def check_fit_inputs(z: Any, y: Any, num_classes: int, dim: int | None = None):
    """(z, y) as float32 [n, dim] embeddings and int64 labels in [0, num_classes);
    ValueError, one line, otherwise: what `fit` and `add` take."""
    z = np.asarray(z)
    y = np.asarray(y)
    if z.ndim != 2:
        raise ValueError(f"z must be a 2-D array [n, p], got shape {list(z.shape)}")
    if dim is not None and z.shape[1] != dim:
        raise ValueError(f"z has dimension {z.shape[1]} but the datastore holds dimension {dim}")
    if z.dtype.kind not in "fiu" or not np.all(np.isfinite(z)):
        raise ValueError("z must hold finite numbers")
    if y.dtype.kind not in "iu":
        raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    if y.shape != (z.shape[0],):
        raise ValueError(f"got {y.size} labels for {z.shape[0]} embeddings")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must be in [0, {num_classes}), got range [{y.min()}, {y.max()}]")
    return np.ascontiguousarray(z, dtype=np.float32), y.astype(np.int64)


def _check_query(z: Any, dim: int) -> np.ndarray:
    z = np.asarray(z, dtype=np.float32)
    if z.ndim != 2 or z.shape[1] != dim:
        raise ValueError(f"queries must be [n, {dim}], got shape {list(z.shape)}")
    return z


def _subsample(n_total: int, n: int | None, seed: int) -> np.ndarray:
    """Indices of the samples kept when a datastore holds at most n of n_total (order kept)."""
    if n is None or n >= n_total:
        return np.arange(n_total)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n_total, size=n, replace=False))


def _require(arrays: dict[str, np.ndarray], names: Sequence[str], file: str) -> None:
    missing = [n for n in names if n not in arrays]
    if missing:
        raise ValueError(f"{file} lacks array(s) {missing}; it has {sorted(arrays)}")


def check_labels_array(labels: np.ndarray, n: int, num_classes: int, file: str) -> np.ndarray:
    """A saved file's `n` labels, checked (integers in range) before anything uses them."""
    if labels.dtype.kind not in "iu" or labels.shape != (n,):
        raise ValueError(
            f"{file}: labels must be integers of shape [{n}], got {labels.dtype} "
            f"{list(labels.shape)}"
        )
    if n and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"{file}: labels must be in [0, {num_classes}), got range "
            f"[{labels.min()}, {labels.max()}]"
        )
    return labels.astype(np.int64, copy=False)


# A parameter check: (name, value) -> None, or ValueError naming both.
ParamCheck = Callable[[str, Any], None]


def check_positive_int(name: str, value: Any) -> None:
    """A `PARAM_CHECKS` entry: the parameter must be a positive integer."""
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_positive_number(name: str, value: Any) -> None:
    if not is_real(value, finite=True) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _optional(check: ParamCheck) -> ParamCheck:
    """`check`, with None allowed (a parameter left unset)."""

    def check_unless_none(name: str, value: Any) -> None:
        if value is not None:
            check(name, value)

    return check_unless_none
