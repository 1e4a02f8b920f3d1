"""A client's encoder with its own linear head in place of the global classifier: the exported
graph's "logits" output becomes that client's linear head on the same embeddings, so every
device path (the runtime's single session, `add`, the one-file ONNX predictor) interpolates the
kNN with the client's head without knowing it exists.

The head's weights replace the classifier's initializers in place (same names, shapes and
dtype), so the file keeps its size and the budget its encoder share; the int8 exporter keeps the
classifier in float, so the head runs at full precision."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from edge_runtime.linear_head import LinearHead
from export.errors import ExportError
from export.onnx_export import OUTPUT_NAMES


def _gemm_attributes(node: onnx.NodeProto) -> dict[str, float]:
    out = {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0}
    for a in node.attribute:
        if a.name in out:
            out[a.name] = a.f if a.type == onnx.AttributeProto.FLOAT else a.i
    return out


def with_linear_head(encoder: bytes | str | Path, head: LinearHead) -> bytes:
    """The encoder's bytes with the Gemm that produces "logits" computing `head` instead:
    logits = z @ coef_ + intercept_ on the classifier's own input."""
    model = onnx.load_from_string(encoder) if isinstance(encoder, bytes) else onnx.load(encoder)
    logits = OUTPUT_NAMES[1]
    node = next((n for n in model.graph.node if logits in n.output), None)
    inits = {init.name: init for init in model.graph.initializer}
    if node is None or node.op_type != "Gemm" or len(node.input) != 3 \
            or node.input[1] not in inits or node.input[2] not in inits:
        raise ExportError("the linear base needs an encoder whose logits come from one Gemm "
                          "with constant weights and bias (a linear classifier)")
    attrs = _gemm_attributes(node)
    if attrs["transA"] or attrs["alpha"] == 0 or attrs["beta"] == 0:
        raise ExportError("the encoder's classifier Gemm has a form the linear base cannot "
                          f"rewrite ({attrs})")
    weight = head.coef_.T if attrs["transB"] else head.coef_  # coef_ is [p, C]
    for name, value in ((node.input[1], weight / attrs["alpha"]),
                        (node.input[2], head.intercept_ / attrs["beta"])):
        old = inits[name]
        new = np.ascontiguousarray(value, dtype=np.float32)
        if tuple(old.dims) != new.shape or old.data_type != onnx.TensorProto.FLOAT:
            raise ExportError(f"classifier initializer {name!r} is {list(old.dims)} "
                              f"(type {old.data_type}); the linear head gives {list(new.shape)}")
        old.CopyFrom(numpy_helper.from_array(new, name))
    return model.SerializeToString()
