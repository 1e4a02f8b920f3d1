"""A client's encoder with its own linear head in place of the global classifier: the exported
graph's "logits" output becomes that client's linear head on the graph's "embedding" output
(the embeddings its kNN searches, normalised as the run's kNN configuration says), so every
device path (the runtime's single session, `add`, the one-file ONNX predictor) interpolates the
kNN with the client's head without knowing it exists.

The global classifier's nodes and weights are removed and the head is one float Gemm (p x C
weights), so the bundle's budget counts the head through the encoder's bytes, and an int8
encoder's quantized classifier does not clip the head's logits. A device refits the head after
`add` by replacing the Gemm's two initializers (edge_runtime.head_file)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edge_runtime.head_file import HEAD_NAME, head_tensors
from edge_runtime.linear_head import LinearHead
from export.errors import ExportError
from export.onnx_export import OUTPUT_NAMES


def with_linear_head(encoder: bytes | str | Path, head: LinearHead) -> bytes:
    """The encoder's bytes with "logits" = embedding @ coef_ + intercept_ (then softmax on the
    device, as for the global model's logits)."""
    model = onnx.load_from_string(encoder) if isinstance(encoder, bytes) else onnx.load(encoder)
    graph = model.graph
    embedding, logits = OUTPUT_NAMES
    if sorted(o.name for o in graph.output) != sorted(OUTPUT_NAMES):
        raise ExportError(
            f"the encoder's outputs are {[o.name for o in graph.output]}, not {list(OUTPUT_NAMES)}"
        )
    dim = head.coef_.shape[0]
    for node in graph.node:  # the global classifier's output becomes a dead end, pruned below
        for i, name in enumerate(node.output):
            if name == logits:
                node.output[i] = f"{logits}/global"
    weight, bias = (
        numpy_helper.from_array(np.ascontiguousarray(array, np.float32), name)
        for name, array in head_tensors(head.coef_, head.intercept_).items()
    )
    graph.initializer.extend([weight, bias])
    graph.node.append(
        helper.make_node("Gemm", [embedding, weight.name, bias.name], [logits], name=HEAD_NAME)
    )
    _prune(graph)
    out = {o.name: o for o in graph.output}[embedding]
    dims = out.type.tensor_type.shape.dim
    if len(dims) == 2 and dims[1].HasField("dim_value") and dims[1].dim_value != dim:
        raise ExportError(
            f"the encoder's embedding has {dims[1].dim_value} dimensions; the "
            f"linear head was fitted on {dim}"
        )
    return model.SerializeToString()


def _prune(graph: onnx.GraphProto) -> None:
    """Drop the nodes, initializers and shape records no graph output depends on."""
    needed = {o.name for o in graph.output}
    keep = []
    for node in reversed(graph.node):  # ONNX graphs are topologically sorted
        if needed.intersection(node.output):
            keep.append(node)
            needed.update(node.input)
    keep.reverse()
    del graph.node[:]
    graph.node.extend(keep)
    inits = [i for i in graph.initializer if i.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    infos = [v for v in graph.value_info if v.name in needed]
    del graph.value_info[:]
    graph.value_info.extend(infos)
