"""Approximate kNN with an hnswlib graph."""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import numpy as np

from .._io import fsync_dir, write_path_atomic
from ..cli_help import install_hint
from ..hnsw_format import check_hnsw_index
from ..knn import DEFAULT_K, DEFAULT_SIGMA
from .base import SampleDatastore, SavedFiles
from .common import (
    _NPZ_ARRAY_OVERHEAD,
    _NPZ_FILE_OVERHEAD,
    _check_query,
    check_fit_inputs,
    check_labels_array,
    check_positive_int,
    datastore_file_name,
)


def _import_hnswlib():
    try:
        return importlib.import_module("hnswlib")
    except ImportError:
        raise ValueError(
            f"hnsw datastores need the hnswlib package: {install_hint('hnsw')}"
        ) from None


MEASURE_SCRATCH = 1 << 20  # bytes of float64 differences per step of _measured_again
# Twice the relative error bound of a float32 sum of p squared differences, per term (hnswlib's
# distances on two CPUs each within (p + 2) 2^-24 of the true one, relative), with room: two
# candidates closer than this times (p + 2) may be ranked either way round.
ROUNDING = 2.01 * 2.0**-24


class HNSWDatastore(SampleDatastore):
    """Approximate kNN with an hnswlib graph (space "l2", which returns squared distances).

    The hnswlib label of each stored sample is its insertion stamp, so eviction of the oldest
    marks the smallest labels deleted and later additions reuse their slots. Saving with deleted
    slots left over rebuilds a compact graph first (hnswlib keeps deleted items in its file).
    Insertion runs on one thread so the same data gives the same graph.
    """

    backend = "hnsw"
    PARAM_CHECKS = {
        **SampleDatastore.PARAM_CHECKS,
        **dict.fromkeys(("M", "ef_construction", "ef", "num_threads"), check_positive_int),
    }
    FILES = ("datastore.npz", "hnsw.bin")
    FILES_RULE = "an hnsw datastore is one .npz and one .bin file"
    NPZ_ARRAYS = ("labels",)
    RECIPE_TOKENS = (
        (re.compile(r"M(\d+)"), "M", int),
        (re.compile(r"efc(\d+)"), "ef_construction", int),
        (re.compile(r"ef(\d+)"), "ef", int),
        (re.compile(r"n(\d+)"), "n", int),
        (re.compile(r"x(\d+)"), "inputs", int),
    )
    RECIPE_HELP = "M<links>, ef<search width>, efc<construction width>, n<count> and x<input bytes>"
    RECIPE_FORMAT = (
        ("M", "M{}"),
        ("ef", "ef{}"),
        ("ef_construction", "efc{}"),
        ("n", "n{}"),
        ("inputs", "x{}"),
    )
    DESCRIPTION = "an HNSW graph index"
    PARAM_WORDS = {
        "M": "M{0}: {0} links per node",
        "ef": "ef{0}: search width {0}",
        "ef_construction": "efc{0}: construction width {0}",
        "n": "n{0}: holds at most {0} samples",
        "inputs": "x{0}: keeps each sample's raw input ({0} bytes) to re-embed it when the "
        "model changes",
    }
    DEVICE_EXTRA = "hnsw"
    SEARCH_AXES = {"M": "hnsw_M", "ef": "hnsw_ef"}
    # float32 keys plus links: flat float32 keys hold more samples in the same room, exactly
    DOMINATED_BY = "flat:fp32"

    def __init__(
        self,
        num_classes: int,
        *,
        k: int = DEFAULT_K,
        sigma: float = DEFAULT_SIGMA,
        M: int = 16,
        ef_construction: int = 200,
        ef: int = 64,
        n: int | None = None,
        seed: int = 0,
        inputs: int | None = None,
        num_threads: int = 1,
    ) -> None:
        self._init_params(locals())

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

    def _store(self, z: np.ndarray, y: np.ndarray) -> None:
        ids = np.arange(z.shape[0], dtype=np.int64)
        self.index_ = self._new_index(z.shape[1], z.shape[0])
        self.index_.add_items(z, ids, num_threads=1)
        self.ids_, self.labels_, self.embedding_dim_ = ids, y, int(z.shape[1])
        self._next_id = int(z.shape[0])

    def fit_chunks(self, chunks, count: int, y: np.ndarray) -> HNSWDatastore:
        """`fit` adding one chunk at a time to the graph (inserted in the same order as `fit`
        inserts them, so the same graph)."""
        self.check_params()
        if self.inputs is not None or (self.n is not None and count > self.n) or count < 1:
            return super().fit_chunks(chunks, count, y)
        labels = np.asarray(y).astype(np.int64)
        done = 0
        for chunk in chunks():
            chunk, _ = check_fit_inputs(
                chunk, labels[done : done + chunk.shape[0]], self.num_classes
            )
            if done == 0:
                self.index_ = self._new_index(chunk.shape[1], count)
            ids = np.arange(done, done + chunk.shape[0], dtype=np.int64)
            self.index_.add_items(chunk, ids, num_threads=1)
            done += chunk.shape[0]
        if done != count or labels.shape != (count,):
            raise ValueError(f"got {done} embeddings and {labels.shape} labels for {count}")
        self.ids_, self.labels_ = np.arange(count, dtype=np.int64), labels
        self.embedding_dim_, self._next_id = self.index_.dim, count
        return self

    def add(self, z: np.ndarray, y: np.ndarray, inputs: np.ndarray | None = None) -> HNSWDatastore:
        z, y = check_fit_inputs(z, y, self.num_classes, self.embedding_dim_)
        if z.shape[0] == 0:
            return self
        self._append_inputs(inputs, z.shape[0])
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

    def _drop_oldest(self, count: int) -> None:
        for label in self.ids_[:count]:
            self.index_.mark_deleted(int(label))
        self.ids_, self.labels_ = self.ids_[count:], self.labels_[count:]

    def _compact(self) -> None:
        """Rebuild the graph from the live samples only, so the file holds no deleted slots."""
        if self.index_.element_count == len(self):
            return
        vectors = self.keys()
        index = self._new_index(self.embedding_dim_, len(self))
        index.add_items(vectors, self.ids_, num_threads=1)
        self.index_ = index

    def key_rows(self, start: int, stop: int) -> np.ndarray:
        ids = self.ids_[start:stop]
        if not len(ids):
            return np.zeros((0, self.embedding_dim_), np.float32)
        return np.asarray(self.index_.get_items(ids), dtype=np.float32)

    def kneighbors(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(squared distances, positions in ids_/labels_) of the k nearest found, nearest first.

        The same bundle must find the same neighbours on every CPU, but hnswlib sums a distance
        in its build's SIMD order (SSE lanes on x86, scalar on ARM), so two candidates at nearly
        the same distance can swap places in its ranking and the k-th neighbour change. So up to
        2k candidates of its search are taken (its ef-long candidate list: the search itself is
        unchanged); those within ROUNDING of the k-th (any a CPU could rank among the k) are
        measured again in numpy's fixed order in float64 and ranked by that distance, then by
        id: the answer depends on the candidates found, not on the last bits of hnswlib's sums
        or their order, and only near ties cost more than the k nearest."""
        z = _check_query(z, self.embedding_dim_)
        k = min(self.k, len(self))
        ef = max(self.ef, k)
        for attempt in range(3):
            self.index_.set_ef(ef)
            try:
                found, approx = self.index_.knn_query(
                    z, k=min(2 * k, ef, len(self)), num_threads=self.num_threads
                )
                break
            except RuntimeError:
                # Too few reachable live items at this ef (many deleted slots): search wider.
                if attempt == 2:
                    raise
                ef = max(4 * ef, len(self)) if attempt == 1 else 4 * ef
        kth = approx[:, k - 1 : k].astype(np.float64)
        near = approx <= kth + kth * (ROUNDING * (z.shape[1] + 2))
        found = found[:, : max(k, int(near.sum(axis=1).max(initial=0)))]
        sq = self._measured_again(z, found)
        order = np.lexsort((found, sq))[:, :k]
        found, sq = np.take_along_axis(found, order, 1), np.take_along_axis(sq, order, 1)
        return sq.astype(np.float32), np.searchsorted(self.ids_, found.astype(np.int64))

    def _measured_again(self, z: np.ndarray, found: np.ndarray) -> np.ndarray:
        """The squared distances [N, c] float64 of the candidates found, in numpy's pairwise
        order. A few rows at a time: at most MEASURE_SCRATCH bytes of differences."""
        sq = np.empty(found.shape, np.float64)
        rows = max(1, MEASURE_SCRATCH // (8 * found.shape[1] * z.shape[1]))
        for start in range(0, len(z), rows):
            part = found[start : start + rows]
            keys = self.index_.get_items(part.ravel(), return_type="numpy")
            diff = keys.reshape(*part.shape, -1).astype(np.float64) - z[start : start + rows, None]
            sq[start : start + rows] = np.square(diff).sum(axis=-1)
        return sq

    def estimate_nbytes(self, n_samples: int, dim: int) -> int:
        """hnsw.bin (level-0 links, vectors, labels, expected upper levels) plus labels/ids npz."""
        m = self.M
        level0 = (2 * m * 4 + 4) + dim * 4 + 8
        upper = 4 + (m * 4 + 4) * 1.5 / max(m - 1, 1)  # 1.5x the expected number of levels
        index = int(n_samples * (level0 + upper)) + 256
        npz = n_samples * 16 + 2 * _NPZ_ARRAY_OVERHEAD + _NPZ_FILE_OVERHEAD
        return index + npz + self.inputs_nbytes(n_samples)

    def save(self, directory: str | os.PathLike, *, generation: int = 0) -> list[str]:
        """Write datastore[.g].npz (labels, ids) and hnsw[.g].bin, each atomically."""
        self._compact()
        directory = Path(directory)
        binary = datastore_file_name("hnsw", "bin", generation)
        write_path_atomic(
            directory / binary, lambda tmp: self.index_.save_index(os.fspath(tmp)), sync_dir=False
        )
        arrays = {"labels": self.labels_, "ids": self.ids_}
        npz = self.save_npz(directory, generation, arrays, sync_dir=False)
        fsync_dir(directory)
        return [npz, binary]

    def _restore(self, saved: SavedFiles, embedding_dim: int | None) -> HNSWDatastore:
        if embedding_dim is None:
            raise ValueError("loading an hnsw datastore needs embedding_dim")
        npz, arrays, binary = saved.npz, saved.arrays, saved.by_kind[".bin"][0]
        n = arrays["labels"].shape[0] if arrays["labels"].ndim == 1 else -1
        ids = arrays.get("ids", np.arange(max(n, 0), dtype=np.int64))
        if ids.dtype.kind not in "iu" or ids.ndim != 1 or n < 1 or ids.shape[0] != n:
            raise ValueError(f"{npz}: labels and ids must be 1-D of the same length >= 1")
        if np.any(np.diff(ids) <= 0) or ids[0] < 0:
            raise ValueError(f"{npz}: ids must be increasing non-negative stamps")
        labels = check_labels_array(arrays["labels"], n, self.num_classes, npz)
        hnswlib = _import_hnswlib()
        index = hnswlib.Index(space="l2", dim=int(embedding_dim))
        # hnswlib trusts its file; a crafted one crashes the process at query time
        # streamed: the check holds a chunk of the file, not the file beside hnswlib's copy
        stored = check_hnsw_index(saved.directory / binary, embedding_dim, binary)
        try:
            index.load_index(os.fspath(saved.directory / binary), allow_replace_deleted=True)
        except RuntimeError as exc:
            raise ValueError(
                f"{binary} is not an hnswlib index of dimension {embedding_dim}: {exc}"
            ) from None
        # the labels the check read (not get_ids_list, a Python list of every id)
        stored = np.sort(stored.astype(np.int64))
        if index.element_count != n or not np.array_equal(stored, ids):
            raise ValueError(
                f"{binary} holds {index.element_count} items that do not match the {n} "
                f"labels in {npz}"
            )
        self.index_, self.ids_, self.labels_ = index, ids.astype(np.int64), labels
        if index.M != self.M:
            raise ValueError(f"{binary} was built with M={index.M}, the recipe says M={self.M}")
        self.embedding_dim_ = int(embedding_dim)
        self._next_id = int(ids[-1]) + 1
        return self
