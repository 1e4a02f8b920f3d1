"""A toy datastore backend in one file, for the registry's test and docs/extending.md's recipe:
the samples' keys stored after a seeded Gaussian random projection to `d` dimensions, searched
exactly in numpy. It declares what the code asks of a backend on its class and registers with
`register_backend(ProjectionDatastore)`; it has no ONNX form."""

from __future__ import annotations

import os
import re

import numpy as np

from edge_runtime.datastores import (
    SampleDatastore,
    SavedFiles,
    check_fit_inputs,
    check_labels_array,
    check_positive_int,
)
from edge_runtime.knn import DEFAULT_K, DEFAULT_SIGMA


class ProjectionDatastore(SampleDatastore):
    backend = "randproj"
    PARAM_CHECKS = {**SampleDatastore.PARAM_CHECKS, "d": check_positive_int}
    FILES = ("datastore.npz",)
    FILES_RULE = "a randproj datastore is one .npz file"
    NPZ_ARRAYS = ("keys", "labels", "order", "projection")
    RECIPE_TOKENS = (
        (re.compile(r"d(\d+)"), "d", int),
        (re.compile(r"n(\d+)"), "n", int),
        (re.compile(r"x(\d+)"), "inputs", int),
    )
    RECIPE_HELP = "d<projected dim>, n<count> and x<input bytes>"
    RECIPE_FORMAT = (("d", "d{}"), ("n", "n{}"), ("inputs", "x{}"))
    DESCRIPTION = "randomly projected keys (exact search)"
    PARAM_WORDS = {
        "d": "d{0}: keys projected to {0} dimensions",
        "n": "n{0}: holds at most {0} samples",
        "inputs": "x{0}: keeps each sample's raw input ({0} bytes)",
    }
    EXACT_SEARCH = True
    SEARCH_AXES = {"d": (8,)}

    def __init__(
        self,
        num_classes: int,
        *,
        k: int = DEFAULT_K,
        sigma: float = DEFAULT_SIGMA,
        d: int = 8,
        n: int | None = None,
        inputs: int | None = None,
        seed: int = 0,
    ) -> None:
        self._init_params(locals())

    def _store(self, z: np.ndarray, y: np.ndarray) -> None:
        self.embedding_dim_ = int(z.shape[1])
        rng = np.random.default_rng(self.seed)
        self.projection_ = (rng.normal(size=(z.shape[1], self.d)) / np.sqrt(self.d)).astype(
            np.float32
        )
        self.keys_, self.labels_ = z @ self.projection_, y
        self.order_ = np.arange(len(y), dtype=np.int64)

    def add(
        self, z: np.ndarray, y: np.ndarray, inputs: np.ndarray | None = None
    ) -> ProjectionDatastore:
        self._append_inputs(inputs, z.shape[0])
        z, y = check_fit_inputs(z, y, self.num_classes, self.embedding_dim_)
        start = int(self.order_[-1]) + 1 if len(self.order_) else 0
        self.keys_ = np.concatenate([self.keys_, z @ self.projection_])
        self.labels_ = np.concatenate([self.labels_, y])
        self.order_ = np.concatenate([self.order_, np.arange(start, start + len(y))])
        return self

    def _drop_oldest(self, count: int) -> None:
        self.keys_, self.labels_, self.order_ = (
            a[count:] for a in (self.keys_, self.labels_, self.order_)
        )

    def key_rows(self, start: int, stop: int) -> np.ndarray:
        return self.keys_[start:stop].copy()

    def kneighbors(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = np.asarray(z, dtype=np.float32) @ self.projection_
        sq = ((q[:, None, :] - self.keys_[None]) ** 2).sum(-1)
        rows = np.argsort(sq, axis=1, kind="stable")[:, : self.k]
        return np.take_along_axis(sq, rows, axis=1), rows

    def estimate_nbytes(self, n_samples: int, dim: int) -> int:
        """The memory model: projected keys, labels, stamps and the projection, plus npz
        overhead (an upper bound)."""
        return (
            n_samples * (4 * self.d + 16) + 4 * dim * self.d + 4096 + self.inputs_nbytes(n_samples)
        )

    def save(self, directory: str | os.PathLike, *, generation: int = 0) -> list[str]:
        arrays = {"keys": self.keys_, "labels": self.labels_, "order": self.order_}
        return [self.save_npz(directory, generation, {**arrays, "projection": self.projection_})]

    def _restore(self, saved: SavedFiles, embedding_dim: int | None) -> ProjectionDatastore:
        keys, projection = saved.arrays["keys"], saved.arrays["projection"]
        if (
            projection.dtype != np.float32
            or projection.ndim != 2
            or projection.shape[1] != self.d
            or keys.dtype != np.float32
            or keys.ndim != 2
            or keys.shape[1] != self.d
            or len(keys) < 1
        ):
            raise ValueError(f"{saved.npz}: keys and projection must be float32 of width {self.d}")
        if embedding_dim is not None and projection.shape[0] != embedding_dim:
            raise ValueError(f"{saved.npz}: projection expects dimension {projection.shape[0]}")
        self.embedding_dim_ = int(projection.shape[0])
        self.projection_, self.keys_ = projection, keys
        self.labels_ = check_labels_array(
            saved.arrays["labels"], len(keys), self.num_classes, saved.npz
        )
        self.order_ = saved.arrays["order"].astype(np.int64)
        return self
