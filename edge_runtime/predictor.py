"""The runtime's whole prediction as one onnxruntime session: raw input to probabilities in one
`run`, with no numpy steps between the encoder and the answer (at batch 1 each of those costs
more in call overhead than in arithmetic).

The graph is `predictor_graph.build_predictor`'s, the one `knnper-edge export-onnx` writes,
with the datastore's samples (and ProtoNN's prototypes) fed as inputs straight from the arrays
the datastore holds (no copy, nothing held twice), so `Runtime.add` changes what the next call
sees without a new session. int8 keys of at most BAKED_KEY_BYTES are the exception: baked into
the graph as constants, which onnxruntime packs for its integer kernel once instead of on every
call (the products are exact either way); `Runtime.add` then opens a new session for the
samples it commits. The same session gives the encoder's outputs (`embed`): a bundle holds
one. Used for flat
float32 and int8 bundles and for ProtoNN; the numpy head (knn.py) stays the reference and
serves HNSW and float16 keys (widening float16 keys inside the graph holds a float32 copy of
all of them during each call, which the budget does not allow).
"""

from __future__ import annotations

import numpy as np

from .datastores.common import WORK_CELLS
from .encoder import RUNTIME_LEVEL, open_session, session_options
from .errors import one_line
from .manifest import Manifest
from .predictor_graph import build_predictor

# A run's intermediates must fit in the 2 MiB a bundle's memory may pass its budget by (with
# onnxruntime's own session; see datastores.common.WORK_CELLS): at most BATCH_ROWS inputs (the
# encoder's activations grow with them) and distance matrices [rows, searched] of at most
# WORK_CELLS cells, or one row. A larger batch runs in turn.
BATCH_ROWS = 4
# int8 keys up to this size are constants of the session (see the module docstring): at batch 1
# with 1,000 keys the integer product no longer repacks them on every call
# (benchmarks/results/runtime/last_mib/baked/). Held twice then (the datastore's arrays and
# onnxruntime's packed copy), they stay within the 2 MiB a bundle's memory may pass its budget
# by.
BAKED_KEY_BYTES = 256 << 10


class Predictor:
    """One session over a bundle's encoder and datastore. `run(x, datastore)` takes raw
    inputs as the manifest declares them (checked by the caller) and the datastore whose
    current samples to search; batches are cut so a distance matrix stays bounded."""

    def __init__(
        self,
        manifest: Manifest,
        datastore,
        encoder: bytes,
        *,
        intra_op_threads: int | None,
    ) -> None:
        bakes = datastore.ONNX_FORM == "keys" and datastore.dtype == "int8"
        bakes = bakes and datastore.keys_t_.nbytes <= BAKED_KEY_BYTES
        model = build_predictor(
            manifest,
            datastore,
            encoder,
            samples="baked" if bakes else "stored",
            probabilities="float64",
        )
        options = session_options(intra_op_threads, RUNTIME_LEVEL)
        self.session = open_session(model, options, "the predictor")
        # the arrays baked in: a run checks the datastore still holds them
        self._baked = datastore.graph_feeds() if bakes else None

    @property
    def baked(self) -> bool:
        """Whether the datastore's samples are constants of the session: `Runtime.add` then
        opens a new one for the samples it commits."""
        return self._baked is not None

    def run(self, x: np.ndarray, datastore) -> np.ndarray:
        """Raw inputs [N, ...] (N >= 1) -> probabilities [N, C] float64."""
        return self._fetch(["probabilities"], x, datastore)[0]

    def embed(self, x: np.ndarray, datastore) -> tuple[np.ndarray, np.ndarray]:
        """Raw inputs [N, ...] (N >= 1) -> the encoder's (embedding [N, p], logits [N, C]),
        from the same session: a bundle holds one."""
        z, logits = self._fetch(["embedding", "logits"], x, datastore)
        return z, logits

    def _fetch(self, outputs: list[str], x: np.ndarray, datastore) -> list[np.ndarray]:
        feeds = datastore.graph_feeds()
        searched = feeds["labels"].shape[0]
        if "prototypes" in feeds:  # ProtoNN's prototypes [d, m] beside the buffer
            searched += feeds["prototypes"].shape[1]
        if self._baked is not None:
            self._check_baked(feeds)
            feeds = {}
        rows = max(1, min(BATCH_ROWS, WORK_CELLS // max(1, searched)))
        if x.shape[0] <= rows:  # one run, as at batch 1: nothing to gather
            feeds["input"] = x
            return self._run(outputs, feeds)
        parts: list[list[np.ndarray]] = [[] for _ in outputs]
        for start in range(0, x.shape[0], rows):
            feeds["input"] = x[start : start + rows]
            for part, value in zip(parts, self._run(outputs, feeds), strict=True):
                part.append(value)
        return [np.concatenate(p) for p in parts]

    def _check_baked(self, feeds: dict[str, np.ndarray]) -> None:
        """The datastore holds the samples baked in (the same arrays, or, reloaded after a
        failed update, equal ones); otherwise the session would answer for others."""
        if feeds["keys_t"] is self._baked["keys_t"]:
            return
        if feeds.keys() != self._baked.keys() or not all(
            np.array_equal(feeds[name], value) for name, value in self._baked.items()
        ):
            raise ValueError(
                "the predictor's session holds samples its datastore no longer has (changed "
                "outside Runtime.add); load the bundle again"
            )
        self._baked = feeds

    def _run(self, outputs: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        try:
            return self.session.run(outputs, feeds)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ValueError(f"the predictor failed: {one_line(exc, first_line=True)}") from None
