"""Exact kNN over stored keys (float32, float16 or int8)."""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from ..knn import (
    DEFAULT_K,
    DEFAULT_SIGMA,
    QUERY_SHIFT,
    search_transposed,
    transposed_key_norms,
)
from .base import SampleDatastore, SavedFiles
from .common import (
    _NPZ_ARRAY_OVERHEAD,
    _NPZ_FILE_OVERHEAD,
    FLAT_DTYPES,
    _check_query,
    _require,
    check_fit_inputs,
    check_labels_array,
    search_nbytes,
)

# Bytes of a flat search's intermediates alive at once per distance cell (int32 products, float32
# distances and their steps), as measured by benchmarks/runtime_memory.py, rounded up.
FLAT_CELL_BYTES = 32


def _check_dtype(name: str, value: Any) -> None:
    if value not in FLAT_DTYPES:
        raise ValueError(f"flat {name} must be one of {list(FLAT_DTYPES)}, got {value!r}")


class FlatDatastore(SampleDatastore):
    """Exact kNN over stored keys, kept as float32, float16 or int8 on disk and in memory.

    Keys are held transposed, keys_t_ [p, n], so that one query's distances stream them at
    memory speed, and in their stored dtype: float16 and int8 keys are widened a block at a time
    while scanning, never all at once, so the memory the keys take is the size of their file.
    int8 keys use one symmetric scale per dimension (max |z_d| / 127, fixed at fit; later samples
    are clipped to it) and are searched by a query quantised to 7-bit integers, as the runtime's
    integer scan does it (knn.key_products). On disk the keys are the [n, p] array in Fortran
    order, which is keys_t_ byte for byte: loading needs no transposed copy.
    """

    backend = "flat"
    PARAM_CHECKS = {**SampleDatastore.PARAM_CHECKS, "dtype": _check_dtype}
    FILES = ("datastore.npz",)
    FILES_RULE = "a flat datastore is one .npz file"
    NPZ_ARRAYS = ("keys", "labels", "order")
    RECIPE_TOKENS = (
        (re.compile(r"(fp32|fp16|int8)"), "dtype", str),
        (re.compile(r"n(\d+)"), "n", int),
        (re.compile(r"x(\d+)"), "inputs", int),
    )
    RECIPE_HELP = "fp32|fp16|int8, n<count> and x<input bytes>"
    RECIPE_FORMAT = (("dtype", "{}"), ("n", "n{}"), ("inputs", "x{}"))
    RECIPE_DEFAULTS = {"dtype": "fp32"}
    DESCRIPTION = "flat keys (exact search)"
    PARAM_WORDS = {
        "dtype": "keys stored as {}",
        # n is how many it may hold, not how many it does (`info` prints that beside it)
        "n": "n{0}: holds at most {0} samples",
        "inputs": "x{0}: keeps each sample's raw input ({0} bytes) to re-embed it when the "
        "model changes",
    }
    ONNX_FORM = "keys"
    EXACT_SEARCH = True
    SEARCH_AXES = {"dtype": "flat_dtypes"}

    def __init__(
        self,
        num_classes: int,
        *,
        k: int = DEFAULT_K,
        sigma: float = DEFAULT_SIGMA,
        dtype: str = "fp32",
        n: int | None = None,
        seed: int = 0,
        inputs: int | None = None,
    ) -> None:
        self._init_params(locals())

    # -- learning
    def _store(self, z: np.ndarray, y: np.ndarray) -> None:
        if self.dtype == "int8":
            peak = np.abs(z).max(axis=0)
            self.scale_ = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
        else:
            self.scale_ = None
        self._set(self._stored_form(z), y, 0)

    def fit_chunks(self, chunks, count: int, y: np.ndarray) -> FlatDatastore:
        """`fit` holding one chunk widened at a time beside the stored keys: int8 reads the
        chunks twice (the per-dimension scale first, then the keys)."""
        self.check_params()
        if self.inputs is not None or (self.n is not None and count > self.n):
            return super().fit_chunks(chunks, count, y)
        if count < 1:
            raise ValueError("fit needs at least one sample")
        labels = np.asarray(y).astype(np.int64)
        self.scale_ = None
        if self.dtype == "int8":
            peak = None
            for chunk in chunks():
                top = np.abs(chunk).max(axis=0)
                peak = top if peak is None else np.maximum(peak, top)
            self.scale_ = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
        keys_t, done = None, 0
        for chunk in chunks():
            chunk, _ = check_fit_inputs(
                chunk, labels[done : done + chunk.shape[0]], self.num_classes
            )
            stored = self._stored_form(chunk)
            if keys_t is None:
                keys_t = np.empty((stored.shape[0], count), stored.dtype)
            keys_t[:, done : done + chunk.shape[0]] = stored
            done += chunk.shape[0]
        if done != count or labels.shape != (count,):
            raise ValueError(f"got {done} embeddings and {labels.shape} labels for {count}")
        self._set(keys_t, labels, 0)
        return self

    def add(self, z: np.ndarray, y: np.ndarray, inputs: np.ndarray | None = None) -> FlatDatastore:
        """Append samples (and their raw inputs, where the recipe keeps them) with new
        insertion stamps (no eviction: the caller decides that)."""
        z, y = check_fit_inputs(z, y, self.num_classes, self.embedding_dim_)
        self._append_inputs(inputs, z.shape[0])
        self._set(
            np.concatenate([self.keys_t_, self._stored_form(z)], axis=1),
            np.concatenate([self.labels_, y]),
            self.first_stamp_,
        )
        return self

    def _drop_oldest(self, count: int) -> None:
        self._set(self.keys_t_[:, count:], self.labels_[count:], self.first_stamp_ + count)

    def _stored_form(self, z: np.ndarray) -> np.ndarray:
        """Embeddings [n, p] float32 -> keys as stored, transposed [p, n], in the recipe's dtype."""
        if self.dtype == "fp16":
            limit = np.finfo(np.float16).max  # clipped like int8, rather than stored as inf
            return np.clip(z, -limit, limit).T.astype(np.float16, order="C")
        if self.dtype == "int8":  # one float32 temporary of z's size, not three
            levels = np.divide(z, self.scale_)
            np.clip(np.rint(levels, out=levels), -127, 127, out=levels)
            return levels.T.astype(np.int8, order="C")
        return np.ascontiguousarray(z.T, dtype=np.float32)

    def _set(self, keys_t: np.ndarray, labels: np.ndarray, first_stamp: int) -> None:
        self.keys_t_ = np.ascontiguousarray(keys_t)
        # one byte a label where the classes fit (files keep int64): 0.7 MB less at 100k keys
        narrow = np.uint8 if self.num_classes <= 256 else np.int64
        self.labels_ = labels.astype(narrow, copy=False)
        self.first_stamp_ = int(first_stamp)
        self.embedding_dim_ = int(keys_t.shape[0])
        self.key_norms_ = transposed_key_norms(self.keys_t_, self.scale_)
        # the integer scan's correction for its query shift (see predictor_graph)
        self.key_offsets_ = None
        if self.dtype == "int8":
            self.key_offsets_ = self.keys_t_.sum(axis=0, dtype=np.int32)
            self.key_offsets_ *= QUERY_SHIFT

    @property
    def order_(self) -> np.ndarray:
        """The samples' insertion stamps, oldest first: consecutive, since samples are stored
        in the order they came (`add` appends, eviction takes the oldest), so only the first
        is held (at 100k keys the array would be 0.8 MB beside them)."""
        return np.arange(self.first_stamp_, self.first_stamp_ + len(self.labels_), dtype=np.int64)

    @property
    def exact_fp32(self) -> bool:
        return self.dtype == "fp32"

    def single_session(self) -> bool:
        # fp16 keys have no exact ONNX scan: the runtime searches them in numpy
        return self.dtype in ("fp32", "int8")

    def graph_feeds(self) -> dict[str, np.ndarray]:
        """The predictor graph's sample inputs ("stored" form): the datastore's own arrays."""
        feeds = {"keys_t": self.keys_t_, "key_norms": self.key_norms_, "labels": self.labels_}
        if self.dtype == "int8":
            feeds["key_offsets"] = self.key_offsets_
        return feeds

    def graph_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys [n, q] float32, labels [n]) a keys-as-inputs graph takes: every stored sample,
        as the search sees it."""
        return self.keys(), self.labels_.astype(np.int64)

    def key_rows(self, start: int, stop: int) -> np.ndarray:
        widened = self.keys_t_[:, start:stop].T.astype(np.float32)
        if self.scale_ is not None:
            widened *= self.scale_
        return widened

    # -- inference
    def kneighbors(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(squared distances, row indices into keys/labels_) of the k nearest, nearest first."""
        z = _check_query(z, self.embedding_dim_)
        return search_transposed(
            z, self.keys_t_, self.k, key_norms=self.key_norms_, scale=self.scale_
        )

    # -- footprint
    def estimate_nbytes(self, n_samples: int, dim: int) -> int:
        """Upper bound on what n_samples keys of dimension dim cost a device: the saved
        datastore.npz, and the key norms (int8: and sums) and search intermediates beside it
        (common.search_nbytes)."""
        held = 4 + 4 * (self.dtype == "int8")
        return self.file_nbytes(n_samples, dim) + search_nbytes(n_samples, held, FLAT_CELL_BYTES)

    def file_nbytes(self, n_samples: int, dim: int) -> int:
        """Upper bound on the saved datastore.npz for n_samples keys of dimension dim."""
        itemsize = np.dtype(FLAT_DTYPES[self.dtype]).itemsize
        arrays = 3 + (self.dtype == "int8")
        data = n_samples * (dim * itemsize + 16) + (4 * dim if self.dtype == "int8" else 0)
        return (
            data + arrays * _NPZ_ARRAY_OVERHEAD + _NPZ_FILE_OVERHEAD + self.inputs_nbytes(n_samples)
        )

    # -- persistence
    def save(self, directory: str | os.PathLike, *, generation: int = 0) -> list[str]:
        """Write datastore[.<generation>].npz (atomically, fsynced); returns the file names."""
        # keys_t_.T is the [n, p] array in Fortran order: saved without a copy, loaded likewise
        labels = self.labels_.astype(np.int64)  # the file's type, whatever memory holds
        arrays = {"keys": self.keys_t_.T, "labels": labels, "order": self.order_}
        if self.dtype == "int8":
            arrays["scale"] = self.scale_
        return [self.save_npz(directory, generation, arrays)]

    def _restore(self, saved: SavedFiles, embedding_dim: int | None) -> FlatDatastore:
        npz, arrays = saved.npz, saved.arrays
        keys, want = arrays["keys"], np.dtype(FLAT_DTYPES[self.dtype])
        if keys.dtype != want:
            raise ValueError(
                f"{npz}: keys are {keys.dtype} but the recipe says {self.dtype} ({want})"
            )
        if keys.ndim != 2 or keys.shape[0] < 1:
            raise ValueError(f"{npz}: keys must be [n >= 1, p], got {list(keys.shape)}")
        n, dim = keys.shape
        if embedding_dim is not None and dim != embedding_dim:
            raise ValueError(f"{npz}: keys have dimension {dim}, expected {embedding_dim}")
        labels = check_labels_array(arrays["labels"], n, self.num_classes, npz)
        order = arrays["order"]
        if order.dtype.kind not in "iu" or order.shape != (n,):
            raise ValueError(f"{npz}: order must be integers of shape [{n}]")
        order = order.astype(np.int64, copy=False)
        if n > 1 and not np.all(order[1:] > order[:-1]):
            raise ValueError(f"{npz}: order stamps must be increasing (oldest first)")
        if self.dtype == "int8":
            _require(arrays, ["scale"], npz)
            scale = arrays["scale"]
            if scale.dtype.kind == "f" and scale.shape == (dim,):
                with np.errstate(over="ignore", under="ignore", invalid="ignore"):
                    scale = scale.astype(np.float32)
            # normal float32s: a subnormal scale (1e-45) is exact in one session's arithmetic
            # and 0 or NaN in another's, so the server and devices would disagree
            if (
                scale.dtype != np.float32
                or scale.shape != (dim,)
                or not np.all(np.isfinite(scale))
                or np.any(scale < np.finfo(np.float32).tiny)
            ):
                raise ValueError(
                    f"{npz}: scale must be {dim} positive, finite, normal float32 numbers"
                )
            self.scale_ = scale
        else:
            self.scale_ = None
        with np.errstate(over="ignore", invalid="ignore"):
            # Fortran-order keys: .T is C-contiguous, no copy; the stamps keep their order
            # (a file's gaps between them, which no writer leaves, are closed at its next save)
            self._set(keys.T, labels, int(order[0]))
        if not np.all(np.isfinite(self.key_norms_)):
            raise ValueError(f"{npz}: keys hold NaN, infinite or overflowing values")
        return self
