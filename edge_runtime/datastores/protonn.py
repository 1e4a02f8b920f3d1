"""ProtoNN-compressed datastore: a projection, prototypes and their label scores, plus a bounded
buffer of samples learned on the device, searched beside the prototypes."""

from __future__ import annotations

import math
import os
import re
from typing import Any

import numpy as np

from ..knn import DEFAULT_K, DEFAULT_SIGMA
from .base import BaseDatastore, SavedFiles
from .common import (
    _NPZ_ARRAY_OVERHEAD,
    _NPZ_FILE_OVERHEAD,
    _check_positive_number,
    _check_query,
    _optional,
    _require,
    check_fit_inputs,
    check_labels_array,
    check_positive_int,
    search_nbytes,
)

# Bytes of a ProtoNN search's intermediates alive at once per distance cell (float64 distances,
# their kernel, its float32 copy and slices), as measured by benchmarks/runtime_memory.py,
# rounded up.
PROTONN_CELL_BYTES = 64

_BUFFER_ARRAYS = ("buffer_keys", "buffer_labels", "buffer_order")
FLOAT32_MAX = float(np.finfo(np.float32).max)


class ProtoNNDatastore(BaseDatastore):
    """ProtoNN-compressed datastore: projection W [d,p], prototypes B [d,m], prototype label
    scores Z [C,m], kernel width gamma. Training needs torch (the protonn package, server side),
    and the result comes here through `from_matrices`.

    Score s_c(z) = sum_j Z[c,j] exp(-gamma^2 ||W z - B[:,j]||^2). The local posterior is s
    clipped at 0 and normalised to sum 1 (uniform if all zero). The exponentials are shifted by
    each row's nearest prototype before normalising, which cancels in the ratio but keeps far
    queries from underflowing to the uniform answer.

    Learning on the device: `add` puts samples, projected by W, into a buffer (`buffer` in the
    recipe, `b<count>`, is the capacity the budget reserves for it). Each buffered sample is one
    more prototype whose label score is `buffer_weight_` for its own label and 0 for the others,
    where buffer_weight_ is the mean over prototypes of their largest label score: a new sample
    counts as much as a typical prototype. `sample_store()` is the buffer, so the runtime's
    fifo and concatenate strategies work on it as they do on a flat datastore's keys.
    """

    backend = "protonn"
    PARAM_CHECKS = {
        **BaseDatastore.PARAM_CHECKS,
        "d": _optional(check_positive_int),
        "m": _optional(_check_positive_number),
        "buffer": _optional(check_positive_int),
    }
    FILES = ("datastore.npz",)
    FILES_RULE = "a protonn datastore is one .npz file"
    NPZ_ARRAYS = ("W", "B", "Z", "gamma")
    RECIPE_TOKENS = (
        (re.compile(r"d(\d+)"), "d", int),
        (re.compile(r"m(\d+(?:\.\d*)?|\.\d+)"), "m", float),
        (re.compile(r"n(\d+)"), "n", int),
        (re.compile(r"b(\d+)"), "buffer", int),
    )
    RECIPE_HELP = "d<projection dim>, m<prototype fraction>, n<count> and b<buffer capacity>"
    RECIPE_FORMAT = (("d", "d{}"), ("m", "m{:g}"), ("n", "n{}"), ("buffer", "b{}"))
    DESCRIPTION = "ProtoNN prototypes"
    PARAM_WORDS = {
        "d": "d{0}: keys projected to {0} dimensions",
        "m": "m{0:g}: prototypes {0:g} x the samples",
        "n": "n{0}: built from {0} of the client's samples",
        "buffer": "b{0}: room for {0} samples added on the device",
    }
    TRAINED = True
    ONNX_FORM = "prototypes"

    def __init__(
        self,
        num_classes: int,
        *,
        k: int = DEFAULT_K,
        sigma: float = DEFAULT_SIGMA,
        d: int | None = None,
        m: float | None = None,
        n: int | None = None,
        buffer: int | None = None,
    ) -> None:
        self._init_params(locals())

    def fit(self, z: np.ndarray, y: np.ndarray) -> ProtoNNDatastore:
        raise NotImplementedError(
            "ProtoNN datastores are trained on the server with the protonn package (it needs "
            "torch); build one here with ProtoNNDatastore.from_matrices(W, B, Z, gamma)"
        )

    @classmethod
    def for_checks(cls, z: np.ndarray, y: np.ndarray) -> ProtoNNDatastore:
        """The class means as prototypes, seen through an identity projection, with a
        buffer of 4 samples (no training: `check_backend` checks the datastore, not ProtoNN)."""
        classes = int(y.max()) + 1
        means = np.stack([z[y == c].mean(axis=0) for c in range(classes)]).T
        W = np.eye(z.shape[1], dtype=np.float32)
        return cls.from_matrices(W, means, np.eye(classes), 0.3, k=3, m=1.0, buffer=4)

    @classmethod
    def from_matrices(
        cls,
        W: np.ndarray,
        B: np.ndarray,
        Z: np.ndarray,
        gamma: float,
        **params: Any,
    ) -> ProtoNNDatastore:
        """A datastore from trained matrices (W [d,p], B [d,m], Z [C,m], gamma > 0), with an
        empty buffer of capacity `buffer` for samples added on the device. `params`: the
        constructor's keywords (k, sigma, m, n, buffer); num_classes and d are Z's and W's."""
        W, B, Z = (np.asarray(a) for a in (W, B, Z))
        for name, a in (("W", W), ("B", B), ("Z", Z)):
            if a.ndim != 2 or a.dtype.kind not in "fiu":
                raise ValueError(
                    f"{name} must be a 2-D array of numbers, got shape {list(a.shape)}"
                )
        if B.shape[0] != W.shape[0] or Z.shape[1] != B.shape[1]:
            raise ValueError(
                f"ProtoNN shapes disagree: W {list(W.shape)} [d,p], B {list(B.shape)} [d,m], "
                f"Z {list(Z.shape)} [C,m]"
            )
        gamma_arr = np.asarray(gamma, dtype=np.float64)
        g = float(gamma_arr.reshape(())) if gamma_arr.size == 1 else math.nan
        # the kernel is exp(-gamma^2 * d): gamma^2 must be finite, or 0 * inf makes it NaN
        if not (g > 0 and math.isfinite(g * g)):
            raise ValueError(
                f"gamma must be one positive number whose square is finite, got {gamma!r}"
            )
        ds = cls(int(Z.shape[0]), d=int(W.shape[0]), **params)
        ds.check_params()
        ds.W_, ds.B_, ds.Z_ = (
            _float32_matrix(name, a) for name, a in (("W", W), ("B", B), ("Z", Z))
        )
        ds.gamma_ = g
        ds.embedding_dim_ = int(W.shape[1])
        with np.errstate(over="ignore", invalid="ignore"):
            ds.prototype_norms_ = np.einsum("ij,ij->j", ds.B_, ds.B_)
            # a class score sums Z over the prototypes, each weighted by a kernel of at most 1
            score_bound = np.abs(ds.Z_).astype(np.float64).sum(axis=1).max(initial=0.0)
        if not np.all(np.isfinite(ds.prototype_norms_)):
            raise ValueError("B's prototypes overflow float32 (their squared norms are not finite)")
        if not score_bound <= FLOAT32_MAX:
            raise ValueError(
                f"Z's class scores can reach {score_bound:.3g}, past float32's "
                f"{FLOAT32_MAX:.3g}: they would overflow to NaN"
            )
        ds.buffer_weight_ = float(max(ds.Z_.max(axis=0).mean(), 0.0)) or 1.0
        ds._set_buffer(
            np.zeros((ds.W_.shape[0], 0), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
        )
        return ds

    def fold_input_map(
        self, weight: np.ndarray, bias: np.ndarray, **params: Any
    ) -> ProtoNNDatastore:
        """This datastore for another encoder's embeddings z', given the map back to the ones it
        was trained on, z = z' @ weight + bias (weight [p', p], bias [p]): W z = W' z' + W bias
        with W' = W weight^T, so W bias moves into the prototypes and the buffer (both live in
        the projected space) and the scores of z' are those of z exactly. `params`: the
        constructor's keywords to change (k, sigma, ...); the buffer keeps its labels and order.
        ValueError when the folded matrices leave float32's range."""
        weight, bias = np.asarray(weight, np.float64), np.asarray(bias, np.float64)
        p = self.embedding_dim_
        if weight.ndim != 2 or weight.shape[1] != p or bias.shape != (p,):
            raise ValueError(
                f"a map folded into this projection takes embeddings to dimension {p}: weight "
                f"[p', {p}] and bias [{p}], got {list(weight.shape)} and {list(bias.shape)}"
            )
        W = self.W_.astype(np.float64)
        shift = (W @ bias)[:, None]
        kept = {**self.get_params(), **params}
        kept.pop("num_classes"), kept.pop("d")
        with np.errstate(over="ignore", invalid="ignore"):
            folded = self.from_matrices(W @ weight.T, self.B_ - shift, self.Z_, self.gamma_, **kept)
            keys_t = _float32_matrix("the folded buffer", self.buffer_keys_t_ - shift)
        folded._set_buffer(keys_t, self.buffer_labels_.copy(), self.buffer_order_.copy())
        return folded

    # -- the buffer of samples learned on the device
    def _set_buffer(self, keys_t: np.ndarray, labels: np.ndarray, order: np.ndarray) -> None:
        self.buffer_keys_t_ = np.ascontiguousarray(keys_t, dtype=np.float32)
        self.buffer_labels_ = labels
        self.buffer_order_ = order
        self._buffer_norms = np.einsum("ij,ij->j", self.buffer_keys_t_, self.buffer_keys_t_)

    def stored_words(self) -> str:
        return f"{len(self)} prototypes + {len(self.sample_store())} buffered samples"

    def single_session(self) -> bool:
        return True

    def graph_feeds(self) -> dict[str, np.ndarray]:
        """The predictor graph's sample inputs ("stored" form): the datastore's own arrays."""
        return {
            "prototypes": self.B_,
            "prototype_scores": self.Z_,
            "prototype_norms": self.prototype_norms_,
            "keys_t": self.buffer_keys_t_,
            "labels": self.buffer_labels_,
        }

    def graph_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys [n, q] float32, labels [n]) a keys-as-inputs graph takes: the buffer."""
        return np.ascontiguousarray(self.buffer_keys_t_.T), self.buffer_labels_

    def sample_store(self) -> _SampleBuffer:
        """What the runtime's update strategies add to and evict from: the buffer."""
        return _SampleBuffer(self)

    def add(self, z: np.ndarray, y: np.ndarray) -> ProtoNNDatastore:
        """Project samples with W and append them to the buffer (the caller evicts)."""
        z, y = check_fit_inputs(z, y, self.num_classes, self.embedding_dim_)
        start = int(self.buffer_order_[-1]) + 1 if len(self.buffer_order_) else 0
        self._set_buffer(
            np.concatenate([self.buffer_keys_t_, self.W_ @ z.T], axis=1),
            np.concatenate([self.buffer_labels_, y]),
            np.concatenate([self.buffer_order_, np.arange(start, start + len(y), dtype=np.int64)]),
        )
        return self

    def evict_oldest(self, count: int) -> ProtoNNDatastore:
        """Drop the `count` oldest buffered samples (prototypes are never evicted)."""
        held = len(self.buffer_labels_)
        if not 0 <= count <= held:
            raise ValueError(f"cannot evict {count} of {held} buffered samples")
        if count:
            self._set_buffer(
                self.buffer_keys_t_[:, count:],
                self.buffer_labels_[count:],
                self.buffer_order_[count:],
            )
        return self

    def prototypes(self) -> tuple[np.ndarray, np.ndarray]:
        """(B [d, m'], Z [C, m']): the trained prototypes followed by the buffered samples with
        their one-label scores, i.e. everything predict_proba scores against."""
        held = len(self.buffer_labels_)
        scores = np.zeros((self.num_classes, held), np.float32)
        scores[self.buffer_labels_, np.arange(held)] = self.buffer_weight_
        return (
            np.concatenate([self.B_, self.buffer_keys_t_], axis=1),
            np.concatenate([self.Z_, scores], axis=1),
        )

    # -- inference
    def predict_proba(self, z: np.ndarray) -> np.ndarray:
        z = _check_query(z, self.embedding_dim_)
        wz = z @ self.W_.T
        wz_norms = np.einsum("ij,ij->i", wz, wz)[:, None].astype(np.float64)
        sq = wz_norms - 2.0 * (wz @ self.B_) + self.prototype_norms_[None, :]
        held = len(self.buffer_labels_)
        if held:
            sq_buf = wz_norms - 2.0 * (wz @ self.buffer_keys_t_) + self._buffer_norms[None, :]
            nearest = np.minimum(sq.min(axis=1), sq_buf.min(axis=1))[:, None]
        else:
            nearest = sq.min(axis=1, keepdims=True)
        g2 = self.gamma_**2
        kernel = np.exp(-g2 * np.maximum(sq - nearest, 0.0))
        scores = (kernel.astype(np.float32) @ self.Z_.T).astype(np.float64)
        if held:
            k_buf = np.exp(-g2 * np.maximum(sq_buf - nearest, 0.0)) * self.buffer_weight_
            for c in range(self.num_classes):
                scores[:, c] += k_buf[:, self.buffer_labels_ == c].sum(axis=1)
        np.maximum(scores, 0.0, out=scores)
        total = scores.sum(axis=1, keepdims=True)
        out = np.full_like(scores, 1.0 / self.num_classes)
        ok = total[:, 0] > 0
        out[ok] = scores[ok] / total[ok]
        return out

    def __len__(self) -> int:
        """The number of prototypes (what the datastore stores instead of samples)."""
        return int(self.B_.shape[1]) if hasattr(self, "B_") else 0

    # -- footprint
    def buffer_nbytes(self, count: int) -> int:
        """Bytes `count` buffered samples add to the saved file (projected key, label, stamp)."""
        d = self.d or 0
        return count * (4 * d + 16) + len(_BUFFER_ARRAYS) * _NPZ_ARRAY_OVERHEAD

    def estimate_nbytes(self, n_prototypes: int, dim: int) -> int:
        """Upper bound on what n_prototypes cost a device with the buffer full to capacity: the
        saved file, and the norms and search intermediates beside it (common.search_nbytes)."""
        held = self.buffer or 0
        return self.file_nbytes(n_prototypes, dim) + search_nbytes(
            n_prototypes + held, 4, PROTONN_CELL_BYTES
        )

    def file_nbytes(self, n_prototypes: int, dim: int) -> int:
        """Upper bound on the saved file for n_prototypes, with the buffer full to capacity."""
        held = self.buffer or 0
        return self._matrices_nbytes(n_prototypes, dim) + (self.buffer_nbytes(held) if held else 0)

    def _matrices_nbytes(self, n_prototypes: int, dim: int) -> int:
        """Upper bound on the saved file for n_prototypes, without the buffer."""
        d = self.d or dim
        data = 4 * (d * dim + d * n_prototypes + self.num_classes * n_prototypes) + 8
        return data + 4 * _NPZ_ARRAY_OVERHEAD + _NPZ_FILE_OVERHEAD

    # -- persistence
    def save(self, directory: str | os.PathLike, *, generation: int = 0) -> list[str]:
        arrays = {"W": self.W_, "B": self.B_, "Z": self.Z_, "gamma": np.float64(self.gamma_)}
        if self.buffer is not None or len(self.buffer_labels_):
            arrays.update(
                buffer_keys=self.buffer_keys_t_.T,  # [count, d] in Fortran order, no copy
                buffer_labels=self.buffer_labels_,
                buffer_order=self.buffer_order_,
            )
        return [self.save_npz(directory, generation, arrays)]

    def _restore(self, saved: SavedFiles, embedding_dim: int | None) -> ProtoNNDatastore:
        """A datastore of these params built from the saved matrices (`from_matrices`, which
        checks them), then its buffer."""
        npz, arrays = saved.npz, saved.arrays
        params = self.get_params()
        num_classes, d = params.pop("num_classes"), params.pop("d")
        try:
            ds = self.from_matrices(
                arrays["W"], arrays["B"], arrays["Z"], arrays["gamma"], **params
            )
        except ValueError as exc:  # name the file: the message names the field
            raise ValueError(f"{npz}: {exc}") from None
        if ds.num_classes != num_classes:
            raise ValueError(f"{npz}: Z has {ds.num_classes} classes, expected {num_classes}")
        if d is not None and d != ds.d:
            raise ValueError(f"{npz}: W projects to {ds.d} dimensions, the recipe says {d}")
        if embedding_dim is not None and ds.embedding_dim_ != embedding_dim:
            raise ValueError(
                f"{npz}: W takes dimension {ds.embedding_dim_}, expected {embedding_dim}"
            )
        if any(name in arrays for name in _BUFFER_ARRAYS):
            _require(arrays, _BUFFER_ARRAYS, npz)
            ds._load_buffer(arrays, npz)
        return ds

    def _load_buffer(self, arrays: dict[str, np.ndarray], file: str) -> None:
        keys, order = arrays["buffer_keys"], arrays["buffer_order"]
        d = self.W_.shape[0]
        if keys.ndim != 2 or keys.shape[1] != d or keys.dtype != np.float32:
            raise ValueError(f"{file}: buffer_keys must be float32 [count, {d}]")
        held = keys.shape[0]
        labels = check_labels_array(arrays["buffer_labels"], held, self.num_classes, file)
        if order.dtype.kind not in "iu" or order.shape != (held,):
            raise ValueError(f"{file}: buffer_order must be integers of shape [{held}]")
        order = order.astype(np.int64, copy=False)
        if held > 1 and not np.all(order[1:] > order[:-1]):
            raise ValueError(f"{file}: buffer_order stamps must be increasing (oldest first)")
        with np.errstate(over="ignore", invalid="ignore"):
            self._set_buffer(keys.T, labels, order)
        if not np.all(np.isfinite(self._buffer_norms)):
            raise ValueError(f"{file}: buffer_keys hold NaN, infinite or overflowing values")


def _float32_matrix(name: str, a: np.ndarray) -> np.ndarray:
    """A matrix as the float32 the device computes in, refusing values that are not finite
    there (1e300 is a finite float64 but an infinite float32)."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.ascontiguousarray(a, dtype=np.float32)
    if not np.all(np.isfinite(out)):
        raise ValueError(f"{name} holds NaN or values past float32's range")
    return out


class _SampleBuffer:
    """A ProtoNN datastore's buffer, seen as the runtime sees a flat datastore: its length, its
    capacity `n`, add / evict_oldest, and the bytes of the whole datastore file for a number of
    buffered samples."""

    def __init__(self, datastore: ProtoNNDatastore) -> None:
        self.datastore = datastore

    def __len__(self) -> int:
        return len(self.datastore.buffer_labels_)

    @property
    def n(self) -> int:
        return int(self.datastore.buffer or 0)

    @n.setter
    def n(self, value: int) -> None:
        self.datastore.buffer = int(value)

    def add(self, z: np.ndarray, y: np.ndarray) -> _SampleBuffer:
        self.datastore.add(z, y)
        return self

    def evict_oldest(self, count: int) -> _SampleBuffer:
        self.datastore.evict_oldest(count)
        return self

    def estimate_nbytes(self, count: int, dim: int) -> int:
        ds = self.datastore
        searched = len(ds) + count
        return (
            ds._matrices_nbytes(len(ds), dim)
            + ds.buffer_nbytes(count)
            + search_nbytes(searched, 4, PROTONN_CELL_BYTES)
        )
