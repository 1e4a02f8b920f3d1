"""Datastore backends (flat / hnsw / protonn) behind one small surface, and their recipe strings.

Every backend answers the local kNN-Per posterior `predict_proba(z) -> [n, C]` and knows how to
save itself into a bundle directory and load back. The surface, scikit-learn style:

    ds = make_datastore("flat:int8:n500", num_classes=10, k=10, sigma=1.0).fit(z, y)
    ds.predict_proba(z_query); ds.add(z_new, y_new); ds.evict_oldest(3); len(ds)
    ds.estimate_nbytes(n, dim)        # bytes the saved files take for n samples (an upper bound
    ds.nbytes                         #   for flat and protonn, an estimate for hnsw)
    names = ds.save(directory, generation=0)
    ds = FlatDatastore.load(directory, {"num_classes": 10, "k": 10, "sigma": 1.0, "dtype": "int8"},
                            files=names, embedding_dim=64)

Every sample carries an insertion stamp (int64, increasing), so "evict the oldest" is defined for
the on-device update strategies. File names carry a generation number after the first save
(datastore.npz, datastore.1.npz, ...) so that an update never overwrites the files the current
manifest points at.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._io import TMP_SUFFIX, fsync_dir, fsync_file, load_npz, save_npz_atomic
from .knn import exact_search, kernel_posterior

FLAT_DTYPES = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8}
# Per-array overhead of an uncompressed .npz (zip headers + .npy header), generously rounded up.
_NPZ_ARRAY_OVERHEAD = 512
_NPZ_FILE_OVERHEAD = 512


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


def _check_fit_inputs(z: Any, y: Any, num_classes: int, dim: int | None = None):
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


def _check_labels_array(labels: np.ndarray, n: int, num_classes: int, file: str) -> np.ndarray:
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
    return labels.astype(np.int64)


def _check_positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_common(num_classes: Any, k: Any, sigma: Any) -> None:
    if not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    _check_positive_int("k", k)
    if not _is_real(sigma) or not sigma > 0 or not math.isfinite(sigma):
        raise ValueError(f"sigma must be a positive number, got {sigma!r}")


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_load_params(cls: type, params: dict) -> dict:
    allowed = cls.PARAM_NAMES
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {cls.backend} datastore parameter(s) {unknown}")
    if "num_classes" not in params:
        raise ValueError("loading a datastore needs num_classes")
    return params


# ----------------------------------------------------------------------------- flat


class FlatDatastore:
    """Exact kNN over stored keys, kept as float32, float16 or int8 on disk.

    int8 keys use one symmetric scale per dimension (max |z_d| / 127, fixed at fit; later samples
    are clipped to it). In memory the keys are widened to float32 once (numpy float16 arithmetic
    is about 10x slower per query), so the saved file is smaller than the memory the keys take.
    Widened int8/fp16 keys convert back to their stored form exactly, so only one copy is held.
    """

    backend = "flat"
    PARAM_NAMES = ("num_classes", "k", "sigma", "dtype", "n", "seed")

    def __init__(
        self,
        num_classes: int,
        *,
        k: int = 10,
        sigma: float = 1.0,
        dtype: str = "fp32",
        n: int | None = None,
        seed: int = 0,
    ) -> None:
        self.num_classes = num_classes
        self.k = k
        self.sigma = sigma
        self.dtype = dtype
        self.n = n
        self.seed = seed

    def _check_params(self) -> None:
        _check_common(self.num_classes, self.k, self.sigma)
        if self.dtype not in FLAT_DTYPES:
            raise ValueError(f"flat dtype must be one of {list(FLAT_DTYPES)}, got {self.dtype!r}")
        _check_positive_int("n", self.n, allow_none=True)

    # -- learning
    def fit(self, z: np.ndarray, y: np.ndarray) -> FlatDatastore:
        """Store (a seeded random subset of at most n of) the pairs (z_i, y_i)."""
        self._check_params()
        z, y = _check_fit_inputs(z, y, self.num_classes)
        if z.shape[0] == 0:
            raise ValueError("fit needs at least one sample")
        keep = _subsample(z.shape[0], self.n, self.seed)
        z, y = z[keep], y[keep]
        if self.dtype == "int8":
            peak = np.abs(z).max(axis=0)
            self.scale_ = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
        else:
            self.scale_ = None
        self._set(self._roundtrip(z), y, np.arange(z.shape[0], dtype=np.int64))
        return self

    def add(self, z: np.ndarray, y: np.ndarray) -> FlatDatastore:
        """Append samples with new insertion stamps (no eviction: the caller decides that)."""
        z, y = _check_fit_inputs(z, y, self.num_classes, self.embedding_dim_)
        start = int(self.order_[-1]) + 1 if len(self.order_) else 0
        stamps = np.arange(start, start + z.shape[0], dtype=np.int64)
        self._set(
            np.concatenate([self.keys_, self._roundtrip(z)]),
            np.concatenate([self.labels_, y]),
            np.concatenate([self.order_, stamps]),
        )
        return self

    def evict_oldest(self, count: int) -> FlatDatastore:
        """Drop the `count` samples with the smallest insertion stamps."""
        if not 0 <= count <= len(self):
            raise ValueError(f"cannot evict {count} of {len(self)} samples")
        if count:
            self._set(self.keys_[count:].copy(), self.labels_[count:], self.order_[count:])
        return self

    def _roundtrip(self, z: np.ndarray) -> np.ndarray:
        """z as the search will see it: quantized to the stored dtype and widened to float32."""
        if self.dtype == "fp16":
            limit = np.finfo(np.float16).max  # clipped like int8, rather than stored as inf
            return np.clip(z, -limit, limit).astype(np.float16).astype(np.float32)
        if self.dtype == "int8":
            return self._dequantize(self._quantize(z))
        return np.ascontiguousarray(z, dtype=np.float32)

    def _quantize(self, z: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(z / self.scale_), -127, 127).astype(np.int8)

    def _dequantize(self, q: np.ndarray) -> np.ndarray:
        return q.astype(np.float32) * self.scale_

    def _set(self, keys: np.ndarray, labels: np.ndarray, order: np.ndarray) -> None:
        self.keys_ = np.ascontiguousarray(keys, dtype=np.float32)
        self.labels_ = labels
        self.order_ = order
        self.embedding_dim_ = int(keys.shape[1])
        self._key_norms = np.einsum("ij,ij->i", self.keys_, self.keys_)

    # -- inference
    def kneighbors(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(squared distances, row indices into keys_/labels_) of the k nearest, nearest first."""
        z = _check_query(z, self.embedding_dim_)
        return exact_search(z, self.keys_, self.k, key_norms=self._key_norms)

    def predict_proba(self, z: np.ndarray) -> np.ndarray:
        sq, idx = self.kneighbors(z)
        return kernel_posterior(
            sq, self.labels_[idx], self.num_classes, self.sigma, self.embedding_dim_
        )

    def __len__(self) -> int:
        return int(self.labels_.shape[0]) if hasattr(self, "labels_") else 0

    # -- footprint
    def estimate_nbytes(self, n_samples: int, dim: int) -> int:
        """Upper bound on the saved datastore.npz size for n_samples keys of dimension dim."""
        itemsize = np.dtype(FLAT_DTYPES[self.dtype]).itemsize
        arrays = 3 + (self.dtype == "int8")
        data = n_samples * (dim * itemsize + 16) + (4 * dim if self.dtype == "int8" else 0)
        return data + arrays * _NPZ_ARRAY_OVERHEAD + _NPZ_FILE_OVERHEAD

    @property
    def nbytes(self) -> int:
        return self.estimate_nbytes(len(self), self.embedding_dim_)

    # -- recipe
    def recipe_params(self) -> dict:
        params: dict = {"dtype": self.dtype}
        if self.n is not None:
            params["n"] = int(self.n)
        return params

    @property
    def recipe(self) -> str:
        return format_recipe(self.backend, self.recipe_params())

    # -- persistence
    def save(self, directory: str | os.PathLike, *, generation: int = 0) -> list[str]:
        """Write datastore[.<generation>].npz (atomically, fsynced); returns the file names."""
        name = datastore_file_name("datastore", "npz", generation)
        arrays = {"keys": self._stored_keys(), "labels": self.labels_, "order": self.order_}
        if self.dtype == "int8":
            arrays["scale"] = self.scale_
        save_npz_atomic(Path(directory) / name, arrays)
        return [name]

    def _stored_keys(self) -> np.ndarray:
        if self.dtype == "fp16":
            return self.keys_.astype(np.float16)
        if self.dtype == "int8":
            return self._quantize(self.keys_)
        return self.keys_

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike,
        params: dict,
        *,
        files: Sequence[str] | None = None,
        embedding_dim: int | None = None,
    ) -> FlatDatastore:
        """Rebuild from saved files; ValueError names what is inconsistent."""
        ds = cls(**_check_load_params(cls, params))
        ds._check_params()
        files = list(files) if files is not None else ["datastore.npz"]
        npz = [f for f in files if f.endswith(".npz")]
        if len(npz) != 1 or len(files) != 1:
            raise ValueError(f"a flat datastore is one .npz file, got {files}")
        arrays = load_npz(Path(directory) / npz[0])
        _require(arrays, ["keys", "labels", "order"], npz[0])
        keys, want = arrays["keys"], np.dtype(FLAT_DTYPES[ds.dtype])
        if keys.dtype != want:
            raise ValueError(
                f"{npz[0]}: keys are {keys.dtype} but the recipe says {ds.dtype} ({want})"
            )
        if keys.ndim != 2 or keys.shape[0] < 1:
            raise ValueError(f"{npz[0]}: keys must be [n >= 1, p], got {list(keys.shape)}")
        n, dim = keys.shape
        if embedding_dim is not None and dim != embedding_dim:
            raise ValueError(f"{npz[0]}: keys have dimension {dim}, expected {embedding_dim}")
        labels = _check_labels_array(arrays["labels"], n, ds.num_classes, npz[0])
        order = arrays["order"]
        if order.dtype.kind not in "iu" or order.shape != (n,):
            raise ValueError(f"{npz[0]}: order must be integers of shape [{n}]")
        if len(np.unique(order)) != n:
            raise ValueError(f"{npz[0]}: order stamps must be distinct")
        if ds.dtype == "int8":
            _require(arrays, ["scale"], npz[0])
            scale = arrays["scale"]
            if scale.shape != (dim,) or not np.all(np.isfinite(scale)) or np.any(scale <= 0):
                raise ValueError(f"{npz[0]}: scale must be {dim} positive finite numbers")
            ds.scale_ = scale.astype(np.float32)
            widened = ds._dequantize(keys)
        else:
            ds.scale_ = None
            widened = keys.astype(np.float32, copy=False)
            if not np.all(np.isfinite(widened)):
                raise ValueError(f"{npz[0]}: keys hold NaN or infinite values")
        order = order.astype(np.int64, copy=False)
        if n > 1 and np.any(np.diff(order) < 0):  # saved files are in order: no copy then
            sort = np.argsort(order, kind="stable")
            widened, labels, order = widened[sort], labels[sort], order[sort]
        ds._set(widened, labels, order)
        return ds


# ----------------------------------------------------------------------------- hnsw


def _import_hnswlib():
    try:
        return importlib.import_module("hnswlib")
    except ImportError:
        raise ValueError(
            "hnsw datastores need the hnswlib package: pip install 'knnper[hnsw]'"
        ) from None


class HNSWDatastore:
    """Approximate kNN with an hnswlib graph (space "l2", which returns squared distances).

    The hnswlib label of each stored sample is its insertion stamp, so eviction of the oldest
    marks the smallest labels deleted and later additions reuse their slots. Saving with deleted
    slots left over rebuilds a compact graph first (hnswlib keeps deleted items in its file).
    Insertion runs on one thread so the same data gives the same graph.
    """

    backend = "hnsw"
    PARAM_NAMES = (
        "num_classes",
        "k",
        "sigma",
        "M",
        "ef_construction",
        "ef",
        "n",
        "seed",
        "num_threads",
    )

    def __init__(
        self,
        num_classes: int,
        *,
        k: int = 10,
        sigma: float = 1.0,
        M: int = 16,
        ef_construction: int = 200,
        ef: int = 64,
        n: int | None = None,
        seed: int = 0,
        num_threads: int = 1,
    ) -> None:
        self.num_classes = num_classes
        self.k = k
        self.sigma = sigma
        self.M = M
        self.ef_construction = ef_construction
        self.ef = ef
        self.n = n
        self.seed = seed
        self.num_threads = num_threads

    def _check_params(self) -> None:
        _check_common(self.num_classes, self.k, self.sigma)
        for name in ("M", "ef_construction", "ef", "num_threads"):
            _check_positive_int(name, getattr(self, name))
        _check_positive_int("n", self.n, allow_none=True)

    def _new_index(self, dim: int, max_elements: int):
        hnswlib = _import_hnswlib()
        index = hnswlib.Index(space="l2", dim=dim)
        index.init_index(
            max_elements=max(max_elements, 1),
            M=self.M,
            ef_construction=self.ef_construction,
            random_seed=self.seed,
            allow_replace_deleted=True,
        )
        return index

    def fit(self, z: np.ndarray, y: np.ndarray) -> HNSWDatastore:
        self._check_params()
        z, y = _check_fit_inputs(z, y, self.num_classes)
        if z.shape[0] == 0:
            raise ValueError("fit needs at least one sample")
        keep = _subsample(z.shape[0], self.n, self.seed)
        z, y = z[keep], y[keep]
        ids = np.arange(z.shape[0], dtype=np.int64)
        self.index_ = self._new_index(z.shape[1], z.shape[0])
        self.index_.add_items(z, ids, num_threads=1)
        self.ids_, self.labels_, self.embedding_dim_ = ids, y, int(z.shape[1])
        self._next_id = int(z.shape[0])
        return self

    def add(self, z: np.ndarray, y: np.ndarray) -> HNSWDatastore:
        z, y = _check_fit_inputs(z, y, self.num_classes, self.embedding_dim_)
        if z.shape[0] == 0:
            return self
        free = self.index_.element_count - len(self)  # deleted slots, reused first
        needed = self.index_.element_count + max(0, z.shape[0] - free)
        if needed > self.index_.max_elements:
            self.index_.resize_index(needed)
        ids = np.arange(self._next_id, self._next_id + z.shape[0], dtype=np.int64)
        self.index_.add_items(z, ids, num_threads=1, replace_deleted=True)
        self.ids_ = np.concatenate([self.ids_, ids])
        self.labels_ = np.concatenate([self.labels_, y])
        self._next_id += z.shape[0]
        return self

    def evict_oldest(self, count: int) -> HNSWDatastore:
        if not 0 <= count <= len(self):
            raise ValueError(f"cannot evict {count} of {len(self)} samples")
        for label in self.ids_[:count]:
            self.index_.mark_deleted(int(label))
        self.ids_, self.labels_ = self.ids_[count:], self.labels_[count:]
        return self

    def _compact(self) -> None:
        """Rebuild the graph from the live samples only, so the file holds no deleted slots."""
        if self.index_.element_count == len(self):
            return
        vectors = np.asarray(self.index_.get_items(self.ids_), dtype=np.float32)
        index = self._new_index(self.embedding_dim_, len(self))
        index.add_items(vectors, self.ids_, num_threads=1)
        self.index_ = index

    def kneighbors(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(squared distances, positions in ids_/labels_) of the k nearest found, nearest first."""
        z = _check_query(z, self.embedding_dim_)
        k = min(self.k, len(self))
        ef = max(self.ef, k)
        for attempt in range(3):
            self.index_.set_ef(ef)
            try:
                found, sq = self.index_.knn_query(z, k=k, num_threads=self.num_threads)
                break
            except RuntimeError:
                # Too few reachable live items at this ef (many deleted slots): search wider.
                if attempt == 2:
                    raise
                ef = max(4 * ef, len(self)) if attempt == 1 else 4 * ef
        return sq, np.searchsorted(self.ids_, found.astype(np.int64))

    def predict_proba(self, z: np.ndarray) -> np.ndarray:
        sq, pos = self.kneighbors(z)
        return kernel_posterior(
            sq, self.labels_[pos], self.num_classes, self.sigma, self.embedding_dim_
        )

    def __len__(self) -> int:
        return int(self.ids_.shape[0]) if hasattr(self, "ids_") else 0

    def estimate_nbytes(self, n_samples: int, dim: int) -> int:
        """hnsw.bin (level-0 links, vectors, labels, expected upper levels) plus labels/ids npz."""
        m = self.M
        level0 = (2 * m * 4 + 4) + dim * 4 + 8
        upper = 4 + (m * 4 + 4) * 1.5 / max(m - 1, 1)  # 1.5x the expected number of levels
        index = int(n_samples * (level0 + upper)) + 256
        npz = n_samples * 16 + 2 * _NPZ_ARRAY_OVERHEAD + _NPZ_FILE_OVERHEAD
        return index + npz

    @property
    def nbytes(self) -> int:
        return self.estimate_nbytes(len(self), self.embedding_dim_)

    def recipe_params(self) -> dict:
        params: dict = {
            "M": int(self.M),
            "ef": int(self.ef),
            "ef_construction": int(self.ef_construction),
        }
        if self.n is not None:
            params["n"] = int(self.n)
        return params

    @property
    def recipe(self) -> str:
        return format_recipe(self.backend, self.recipe_params())

    def save(self, directory: str | os.PathLike, *, generation: int = 0) -> list[str]:
        """Write datastore[.g].npz (labels, ids) and hnsw[.g].bin, each atomically."""
        self._compact()
        directory = Path(directory)
        npz = datastore_file_name("datastore", "npz", generation)
        binary = datastore_file_name("hnsw", "bin", generation)
        tmp = directory / (binary + TMP_SUFFIX)
        try:
            self.index_.save_index(os.fspath(tmp))
            fsync_file(tmp)
            os.replace(tmp, directory / binary)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        save_npz_atomic(directory / npz, {"labels": self.labels_, "ids": self.ids_}, sync_dir=False)
        fsync_dir(directory)
        return [npz, binary]

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike,
        params: dict,
        *,
        files: Sequence[str] | None = None,
        embedding_dim: int | None = None,
    ) -> HNSWDatastore:
        ds = cls(**_check_load_params(cls, params))
        ds._check_params()
        if embedding_dim is None:
            raise ValueError("loading an hnsw datastore needs embedding_dim")
        files = list(files) if files is not None else ["datastore.npz", "hnsw.bin"]
        npz = [f for f in files if f.endswith(".npz")]
        binary = [f for f in files if f.endswith(".bin")]
        if len(npz) != 1 or len(binary) != 1 or len(files) != 2:
            raise ValueError(f"an hnsw datastore is one .npz and one .bin file, got {files}")
        arrays = load_npz(Path(directory) / npz[0])
        _require(arrays, ["labels"], npz[0])
        n = arrays["labels"].shape[0] if arrays["labels"].ndim == 1 else -1
        ids = arrays.get("ids", np.arange(max(n, 0), dtype=np.int64))
        if ids.dtype.kind not in "iu" or ids.ndim != 1 or n < 1 or ids.shape[0] != n:
            raise ValueError(f"{npz[0]}: labels and ids must be 1-D of the same length >= 1")
        if np.any(np.diff(ids) <= 0) or ids[0] < 0:
            raise ValueError(f"{npz[0]}: ids must be increasing non-negative stamps")
        labels = _check_labels_array(arrays["labels"], n, ds.num_classes, npz[0])
        hnswlib = _import_hnswlib()
        index = hnswlib.Index(space="l2", dim=int(embedding_dim))
        try:
            index.load_index(os.fspath(Path(directory) / binary[0]), allow_replace_deleted=True)
        except RuntimeError as exc:
            raise ValueError(
                f"{binary[0]} is not an hnswlib index of dimension {embedding_dim}: {exc}"
            ) from None
        stored = np.sort(np.asarray(index.get_ids_list(), dtype=np.int64))
        if index.element_count != n or not np.array_equal(stored, ids):
            raise ValueError(
                f"{binary[0]} holds {index.element_count} items that do not match the {n} "
                f"labels in {npz[0]}"
            )
        ds.index_, ds.ids_, ds.labels_ = index, ids.astype(np.int64), labels
        if index.M != ds.M:
            raise ValueError(f"{binary[0]} was built with M={index.M}, the recipe says M={ds.M}")
        ds.embedding_dim_ = int(embedding_dim)
        ds._next_id = int(ids[-1]) + 1
        return ds


# ----------------------------------------------------------------------------- protonn


class ProtoNNDatastore:
    """ProtoNN-compressed datastore: projection W [d,p], prototypes B [d,m], prototype label
    scores Z [C,m], kernel width gamma. Inference only; training needs torch (the protonn
    package, server side), and the result comes here through `from_matrices`.

    Score s_c(z) = sum_j Z[c,j] exp(-gamma^2 ||W z - B[:,j]||^2). The local posterior is s
    clipped at 0 and normalised to sum 1 (uniform if all zero). The exponentials are shifted by
    each row's nearest prototype before normalising, which cancels in the ratio but keeps far
    queries from underflowing to the uniform answer.
    """

    backend = "protonn"
    PARAM_NAMES = ("num_classes", "k", "sigma", "d", "m", "n")

    def __init__(
        self,
        num_classes: int,
        *,
        k: int = 10,
        sigma: float = 1.0,
        d: int | None = None,
        m: float | None = None,
        n: int | None = None,
    ) -> None:
        self.num_classes = num_classes
        self.k = k
        self.sigma = sigma
        self.d = d
        self.m = m
        self.n = n

    def _check_params(self) -> None:
        _check_common(self.num_classes, self.k, self.sigma)
        _check_positive_int("d", self.d, allow_none=True)
        _check_positive_int("n", self.n, allow_none=True)
        if self.m is not None and not (_is_real(self.m) and self.m > 0):
            raise ValueError(f"m must be a positive number, got {self.m!r}")

    def fit(self, z: np.ndarray, y: np.ndarray) -> ProtoNNDatastore:
        raise NotImplementedError(
            "ProtoNN datastores are trained on the server with the protonn package (it needs "
            "torch); build one here with ProtoNNDatastore.from_matrices(W, B, Z, gamma)"
        )

    @classmethod
    def from_matrices(
        cls,
        W: np.ndarray,
        B: np.ndarray,
        Z: np.ndarray,
        gamma: float,
        *,
        k: int = 10,
        sigma: float = 1.0,
        m: float | None = None,
        n: int | None = None,
    ) -> ProtoNNDatastore:
        """A datastore from trained matrices (W [d,p], B [d,m], Z [C,m], gamma > 0)."""
        W, B, Z = (np.asarray(a) for a in (W, B, Z))
        for name, a in (("W", W), ("B", B), ("Z", Z)):
            if a.ndim != 2 or a.dtype.kind not in "fiu" or not np.all(np.isfinite(a)):
                raise ValueError(f"{name} must be a finite 2-D array, got shape {list(a.shape)}")
        if B.shape[0] != W.shape[0] or Z.shape[1] != B.shape[1]:
            raise ValueError(
                f"ProtoNN shapes disagree: W {list(W.shape)} [d,p], B {list(B.shape)} [d,m], "
                f"Z {list(Z.shape)} [C,m]"
            )
        gamma_arr = np.asarray(gamma, dtype=np.float64)
        if gamma_arr.size != 1 or not np.isfinite(gamma_arr) or not gamma_arr.reshape(()) > 0:
            raise ValueError(f"gamma must be one positive number, got {gamma!r}")
        ds = cls(int(Z.shape[0]), k=k, sigma=sigma, d=int(W.shape[0]), m=m, n=n)
        ds._check_params()
        ds.W_ = np.ascontiguousarray(W, dtype=np.float32)
        ds.B_ = np.ascontiguousarray(B, dtype=np.float32)
        ds.Z_ = np.ascontiguousarray(Z, dtype=np.float32)
        ds.gamma_ = float(gamma_arr.reshape(()))
        ds.embedding_dim_ = int(W.shape[1])
        # float64 copies and prototype norms, made once: predict_proba runs per query
        ds._W64, ds._B64, ds._Z64 = (a.astype(np.float64) for a in (ds.W_, ds.B_, ds.Z_))
        ds._b_norms = (ds._B64 * ds._B64).sum(axis=0)
        return ds

    def add(self, z: np.ndarray, y: np.ndarray) -> ProtoNNDatastore:
        raise ValueError(
            "a protonn datastore cannot take new samples on the device; use update strategy 'fixed'"
        )

    def evict_oldest(self, count: int) -> ProtoNNDatastore:
        raise ValueError("a protonn datastore has no stored samples to evict; use 'fixed'")

    def predict_proba(self, z: np.ndarray) -> np.ndarray:
        z = _check_query(z, self.embedding_dim_).astype(np.float64)
        wz = z @ self._W64.T
        sq = (wz * wz).sum(axis=1)[:, None] - 2.0 * (wz @ self._B64) + self._b_norms[None, :]
        np.maximum(sq, 0.0, out=sq)
        g2 = self.gamma_**2
        kernel = np.exp(-g2 * (sq - sq.min(axis=1, keepdims=True)))
        scores = np.maximum(kernel @ self._Z64.T, 0.0)
        total = scores.sum(axis=1, keepdims=True)
        out = np.full_like(scores, 1.0 / self.num_classes)
        ok = total[:, 0] > 0
        out[ok] = scores[ok] / total[ok]
        return out

    def __len__(self) -> int:
        """The number of prototypes (what the datastore stores instead of samples)."""
        return int(self.B_.shape[1]) if hasattr(self, "B_") else 0

    def estimate_nbytes(self, n_prototypes: int, dim: int) -> int:
        d = self.d or dim
        data = 4 * (d * dim + d * n_prototypes + self.num_classes * n_prototypes) + 8
        return data + 4 * _NPZ_ARRAY_OVERHEAD + _NPZ_FILE_OVERHEAD

    @property
    def nbytes(self) -> int:
        return self.estimate_nbytes(len(self), self.embedding_dim_)

    def recipe_params(self) -> dict:
        params: dict = {}
        if self.d is not None:
            params["d"] = int(self.d)
        if self.m is not None:
            params["m"] = float(self.m)
        if self.n is not None:
            params["n"] = int(self.n)
        return params

    @property
    def recipe(self) -> str:
        return format_recipe(self.backend, self.recipe_params())

    def save(self, directory: str | os.PathLike, *, generation: int = 0) -> list[str]:
        name = datastore_file_name("datastore", "npz", generation)
        arrays = {"W": self.W_, "B": self.B_, "Z": self.Z_, "gamma": np.float64(self.gamma_)}
        save_npz_atomic(Path(directory) / name, arrays)
        return [name]

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike,
        params: dict,
        *,
        files: Sequence[str] | None = None,
        embedding_dim: int | None = None,
    ) -> ProtoNNDatastore:
        params = dict(_check_load_params(cls, params))
        files = list(files) if files is not None else ["datastore.npz"]
        if len(files) != 1 or not files[0].endswith(".npz"):
            raise ValueError(f"a protonn datastore is one .npz file, got {files}")
        arrays = load_npz(Path(directory) / files[0])
        _require(arrays, ["W", "B", "Z", "gamma"], files[0])
        num_classes = params.pop("num_classes")
        ds = cls.from_matrices(
            arrays["W"],
            arrays["B"],
            arrays["Z"],
            arrays["gamma"],
            **{key: params[key] for key in ("k", "sigma", "m", "n") if key in params},
        )
        if ds.num_classes != num_classes:
            raise ValueError(f"{files[0]}: Z has {ds.num_classes} classes, expected {num_classes}")
        if params.get("d") is not None and params["d"] != ds.d:
            raise ValueError(
                f"{files[0]}: W projects to {ds.d} dimensions, the recipe says {params['d']}"
            )
        if embedding_dim is not None and ds.embedding_dim_ != embedding_dim:
            raise ValueError(
                f"{files[0]}: W takes dimension {ds.embedding_dim_}, expected {embedding_dim}"
            )
        return ds


# ----------------------------------------------------------------------------- recipes

BACKENDS: dict[str, type] = {
    "flat": FlatDatastore,
    "hnsw": HNSWDatastore,
    "protonn": ProtoNNDatastore,
}

# Per backend: (token pattern, parameter name, converter); the first full match wins.
_TOKENS: dict[str, list[tuple[re.Pattern, str, Callable[[str], Any]]]] = {
    "flat": [
        (re.compile(r"(fp32|fp16|int8)"), "dtype", str),
        (re.compile(r"n(\d+)"), "n", int),
    ],
    "hnsw": [
        (re.compile(r"M(\d+)"), "M", int),
        (re.compile(r"efc(\d+)"), "ef_construction", int),
        (re.compile(r"ef(\d+)"), "ef", int),
        (re.compile(r"n(\d+)"), "n", int),
    ],
    "protonn": [
        (re.compile(r"d(\d+)"), "d", int),
        (re.compile(r"m(\d+(?:\.\d*)?|\.\d+)"), "m", float),
        (re.compile(r"n(\d+)"), "n", int),
    ],
}
_TOKEN_HELP = {
    "flat": "fp32|fp16|int8 and n<count>",
    "hnsw": "M<links>, ef<search width>, efc<construction width> and n<count>",
    "protonn": "d<projection dim>, m<prototype fraction> and n<count>",
}
_FORMAT = {
    "flat": [("dtype", "{}"), ("n", "n{}")],
    "hnsw": [("M", "M{}"), ("ef", "ef{}"), ("ef_construction", "efc{}"), ("n", "n{}")],
    "protonn": [("d", "d{}"), ("m", "m{:g}"), ("n", "n{}")],
}


def parse_recipe(recipe: str) -> tuple[str, dict]:
    """ "flat:int8:n500" -> ("flat", {"dtype": "int8", "n": 500}); ValueError on anything else.

    flat:fp32|fp16|int8[:n<count>]   hnsw[:M16][:ef64][:efc200][:n<count>]
    protonn[:d<dim>][:m<fraction>][:n<count>]
    """
    if not isinstance(recipe, str) or not recipe.strip():
        raise ValueError(f"a datastore recipe must be a non-empty string, got {recipe!r}")
    name, *tokens = recipe.strip().split(":")
    if name not in _TOKENS:
        raise ValueError(
            f"unknown datastore backend {name!r} in recipe {recipe!r}; known: {sorted(_TOKENS)}"
        )
    params: dict = {}
    for token in tokens:
        key, value = _read_token(name, token, recipe)
        if key in params:
            raise ValueError(f"recipe {recipe!r} sets {key} twice")
        if key != "dtype" and not value > 0:
            raise ValueError(f"recipe {recipe!r}: {key} must be positive, got {value}")
        params[key] = value
    if name == "flat":
        params.setdefault("dtype", "fp32")
    return name, params


def _read_token(name: str, token: str, recipe: str) -> tuple[str, Any]:
    for pattern, key, convert in _TOKENS[name]:
        match = pattern.fullmatch(token)
        if match:
            return key, convert(match.group(1))
    raise ValueError(
        f"cannot read {token!r} in recipe {recipe!r}: {name} recipes take {_TOKEN_HELP[name]}"
    )


def format_recipe(name: str, params: dict) -> str:
    """The canonical recipe string for (backend name, recipe params); inverse of parse_recipe."""
    parts = [name]
    for key, fmt in _FORMAT[name]:
        if params.get(key) is not None:
            parts.append(fmt.format(params[key]))
    return ":".join(parts)


def make_datastore(
    recipe: str, num_classes: int, k: int = 10, sigma: float = 1.0, **options: Any
) -> FlatDatastore | HNSWDatastore | ProtoNNDatastore:
    """An unfitted datastore for a recipe string; `options` are other hyper-parameters (seed...)."""
    name, params = parse_recipe(recipe)
    ds = BACKENDS[name](num_classes, k=k, sigma=sigma, **params, **options)
    ds._check_params()
    return ds


def load_datastore(
    directory: str | os.PathLike,
    backend: str,
    params: dict,
    *,
    files: Sequence[str] | None = None,
    embedding_dim: int | None = None,
):
    """Load a datastore of the named backend (see each class's `load`)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown datastore backend {backend!r}; known: {sorted(BACKENDS)}")
    return BACKENDS[backend].load(directory, params, files=files, embedding_dim=embedding_dim)
