"""ProtoNN-compressed datastore: a projection, prototypes and their label scores."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .._io import load_npz, save_npz_atomic
from .common import (
    _NPZ_ARRAY_OVERHEAD,
    _NPZ_FILE_OVERHEAD,
    _check_common,
    _check_load_params,
    _check_positive_int,
    _check_query,
    _is_real,
    _require,
    datastore_file_name,
)
from .recipes import format_recipe


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
