"""A device's refitted linear head: the file that carries it and how it enters the encoder.

A bundle with the linear base ships its client's linear head inside the encoder, as one float
Gemm named HEAD_NAME on the "embedding" output (export/personal_encoder.py), so every path that
runs the encoder (the runtime's session, the one-file ONNX predictor) uses it unchanged. After
`add`, the device refits that head on the samples its datastore stores (`refit_head`, the same
numpy fit the exporter used) and writes the weights to their own file, linear_head.<generation>
.npz, committed with the datastore's files; loading the bundle puts them into the encoder's Gemm
(`with_head`). So encoder.onnx stays the file the exporter signed, and the refitted head is, like
the stored samples, the device's own data: covered by the sha256 list and counted in the budget
(the footprint's datastore share), not by the signature.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ._io import load_npz, save_npz_atomic
from .budget import Budget
from .datastores import SampleDatastore, max_count_within
from .linear_head import LinearHead
from .onnx_proto import replace_initializers

HEAD_NAME = "personal_linear_head"
HEAD_FILE_RE = re.compile(r"^linear_head(?:\.\d+)?\.npz$")
_MEMBERS = ("coef", "intercept")


def head_generation(name: str) -> int:
    """The generation in a head file's name (`head_file_name`'s inverse; 0 for
    linear_head.npz)."""
    if not HEAD_FILE_RE.match(name):
        raise ValueError(f"{name!r} is not a linear head file name")
    parts = name.split(".")
    return int(parts[1]) if len(parts) == 3 else 0


def head_file_name(generation: int) -> str:
    return "linear_head.npz" if generation == 0 else f"linear_head.{generation}.npz"


def head_tensors(coef: np.ndarray, intercept: np.ndarray) -> dict[str, np.ndarray]:
    """The encoder initializers a head's weights go into."""
    return {f"{HEAD_NAME}.weight": coef, f"{HEAD_NAME}.bias": intercept}


def save_head(directory: str | os.PathLike, head: LinearHead, generation: int) -> str:
    """Write the head's weights (uncompressed) under the generation's name; returns the name."""
    name = head_file_name(generation)
    save_npz_atomic(Path(directory) / name, _arrays(head.coef_, head.intercept_), sync_dir=False)
    return name


def head_nbytes(dim: int, num_classes: int | None) -> int:
    """The bytes `save_head` writes for a head of this shape (what it takes of the budget); 0
    for `num_classes` None, where the device refits no head."""
    if num_classes is None:
        return 0
    buffer = io.BytesIO()
    np.savez(
        buffer,
        **_arrays(np.zeros((dim, num_classes), np.float32), np.zeros(num_classes, np.float32)),
    )
    return buffer.tell()


def samples_within(store: Any, dim: int, budget: Budget) -> int:
    """The most samples `store` may hold within the budget's `sample_room` by its estimate
    (files and held memory). One rule for `add` and `upgrade`, so an upgrade keeps what `add`
    kept."""
    return max_count_within(lambda n: store.estimate_nbytes(n, dim), budget.sample_room)


def one_sample_room(stores: Iterable[Any], dim: int, head_classes: int | None) -> int:
    """The fewest bytes after the encoder in which one of `stores` holds one sample by
    `samples_within`'s rule (the head's file, then one sample's estimate)."""
    return head_nbytes(dim, head_classes) + min(store.estimate_nbytes(1, dim) for store in stores)


def no_sample_fits(budget: Budget, stores: Iterable[Any], dim: int) -> str:
    """The one-line refusal where not even one sample of any of `stores` fits `budget` by
    `samples_within`'s rule: what the encoder and the refitted head take, the budget, and the
    smallest budget that would hold one. The exporter and `init` refuse such a budget instead
    of writing a bundle that `add` and `upgrade` would find over it."""
    taken = f"the encoder takes {budget.encoder} bytes" + (
        f" and the refitted linear head's file {budget.head} bytes" if budget.head else ""
    )
    one = min(store.estimate_nbytes(1, dim) for store in stores)
    return (
        f"budget {budget.total} bytes: {taken}, leaving {budget.sample_room} bytes, too few for "
        f"one stored sample; the smallest budget that holds one is "
        f"{budget.encoder + budget.head + one} bytes"
    )


def load_head(path: str | os.PathLike, dim: int, num_classes: int) -> dict[str, np.ndarray]:
    """A head file's weights as encoder initializers, checked before anything uses them:
    exactly float32 coef [dim, C] and intercept [C], all finite (ValueError otherwise)."""
    return head_tensors(*read_head(path, dim, num_classes))


# float32's largest value: class scores past half of it make the softmax's differences overflow
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def head_score_problem(coef: np.ndarray, intercept: np.ndarray, keys: np.ndarray) -> str | None:
    """Why a head's class scores on embeddings like `keys` (the stored samples it is refitted
    on) could leave float32's range, or None: finite but huge coefficients (3e38) made every
    prediction NaN. Bounded as |score_c| <= ||coef[:, c]|| * max ||key|| + |intercept_c|."""
    if len(keys) == 0:
        return None
    norm = float(np.sqrt(np.einsum("ij,ij->i", keys, keys, dtype=np.float64)).max())
    bound = float(
        (
            np.linalg.norm(coef.astype(np.float64), axis=0) * norm
            + np.abs(intercept.astype(np.float64))
        ).max()
    )
    if not bound < _FLOAT32_MAX / 2:
        return (
            f"its class scores can reach {bound:.3g} on the stored samples, past float32's "
            "range (every prediction would be NaN)"
        )
    return None


def read_head(path: str | os.PathLike, dim: int, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """A head file's (coef [dim, C], intercept [C]), float32 and finite (ValueError)."""
    arrays = load_npz(path)
    if sorted(arrays) != sorted(_MEMBERS):
        raise ValueError(f"a linear head file holds {list(_MEMBERS)}, got {sorted(arrays)}")
    coef, intercept = arrays["coef"], arrays["intercept"]
    for name, array, shape in (
        ("coef", coef, (dim, num_classes)),
        ("intercept", intercept, (num_classes,)),
    ):
        if array.dtype != np.float32 or array.shape != shape:
            raise ValueError(
                f"the linear head's {name} is {array.dtype} {array.shape}, not float32 {shape}"
            )
        if not np.isfinite(array).all():
            raise ValueError(f"the linear head's {name} holds NaN or infinite values")
    return coef, intercept


def with_head(model: bytes, tensors: dict[str, np.ndarray]) -> bytes:
    """The encoder's bytes with its linear head's weights replaced (ValueError when it has no
    linear head of that shape: a bundle exported without the linear base)."""
    try:
        return replace_initializers(model, tensors)
    except ValueError as exc:
        raise ValueError(
            f"the encoder has no linear head to take the refitted one: {exc}"
        ) from None


def refits(datastore: Any) -> bool:
    """Whether a datastore holds samples to refit a head on (flat, HNSW; ProtoNN keeps
    prototypes)."""
    return isinstance(datastore, SampleDatastore)


def refit_head(datastore: SampleDatastore, num_classes: int, l2: float) -> LinearHead | None:
    """The linear head fitted on the samples the datastore stores, as the embeddings the
    encoder gives (already normalised as the kNN's); None when it stores none."""
    if len(datastore) == 0:
        return None
    return LinearHead(num_classes, l2=l2).fit(datastore.keys(), datastore.labels_)


def _arrays(coef: np.ndarray, intercept: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "coef": np.ascontiguousarray(coef, np.float32),
        "intercept": np.ascontiguousarray(intercept, np.float32),
    }
