"""One ONNX graph for a whole bundle: input normalisation, the encoder, the datastore's posterior
and the lambda interpolation, for devices that run ONNX Runtime but not Python (a phone, a
browser, a board with the C API).

    knnper-edge export-onnx BUNDLE --out predictor.onnx [--keys-as-inputs]

Graph inputs: "input", raw inputs as the bundle's manifest declares them (uint8 images
[N, H, W, C] or int64 token ids [N, L]). Outputs: "probabilities" [N, C] float32, what
`Runtime.predict_proba` gives, and "key" [N, q] float32, what a device stores for an input once
its label is known (the embedding for flat datastores, the projected embedding W z for ProtoNN).

Self-contained by default: keys and labels are initializers. With keys_as_inputs the graph also
takes "keys" [n, q] float32 and "labels" [n] int64 (flat: the stored samples; ProtoNN: its
buffer of samples learned on the device, beside the prototypes baked in), so an app keeps
learning in any language by appending "key" and the label; the bundle's current ones are
written beside the graph (raw little-endian files, see `write_portable`).

Built with onnx's helper; only this export needs the onnx package, never the device path.
HNSW has no ONNX form (a graph walk with data-dependent control flow), so it is refused.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from ._io import read_regular, write_bytes_atomic
from .bundle import ENCODER_FILE, BundleError
from .runtime import Runtime

OPSET = 17
PREFIX = "encoder/"


def build_portable(runtime: Runtime, *, keys_as_inputs: bool = False):
    """The predictor of a loaded (verified) bundle as an onnx.ModelProto."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    manifest = runtime.manifest
    backend = runtime.datastore.backend
    if backend not in ("flat", "protonn"):
        raise BundleError(
            f"bundle {runtime.path}: a {backend} datastore has no ONNX form (an HNSW search is "
            "a graph walk); export the client with a flat or protonn datastore"
        )
    encoder = onnx.load_from_string(_verified_encoder_bytes(runtime))
    g = _Graph(helper, numpy_helper)
    spec = manifest["input"]
    shape = ["N", *spec["shape"]]
    if spec["kind"] == "image":
        g.inputs.append(helper.make_tensor_value_info("input", TensorProto.UINT8, shape))
        prepared = _normalise(g, spec)
    else:
        g.inputs.append(helper.make_tensor_value_info("input", TensorProto.INT64, shape))
        prepared = "input"
    z, logits = _inline_encoder(g, encoder, prepared)
    if backend == "flat":
        key, p_local = _flat(g, runtime, z, keys_as_inputs, TensorProto)
    else:
        key, p_local = _protonn(g, runtime, z, keys_as_inputs, TensorProto)
    p_global = g.node("Softmax", [logits], axis=1)
    lam = float(manifest["lambda"])
    mixed = g.node(
        "Add",
        [g.node("Mul", [p_local, g.const(lam)]), g.node("Mul", [p_global, g.const(1.0 - lam)])],
    )
    g.nodes.append(helper.make_node("Identity", [mixed], ["probabilities"]))
    g.nodes.append(helper.make_node("Identity", [key], ["key"]))
    outputs = [
        helper.make_tensor_value_info(
            "probabilities", TensorProto.FLOAT, ["N", manifest["num_classes"]]
        ),
        helper.make_tensor_value_info("key", TensorProto.FLOAT, ["N", None]),
    ]
    graph = helper.make_graph(g.nodes, "knnper_predictor", g.inputs, outputs, g.initializers)
    opsets = {op.domain: op.version for op in encoder.opset_import}
    opsets[""] = max(opsets.get("", OPSET), OPSET)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid(domain, version) for domain, version in opsets.items()],
        producer_name="knnper-edge export-onnx",
    )
    model.ir_version = max(encoder.ir_version, 8)
    for key_name, value in {
        "knnper.client_id": str(manifest["client_id"]),
        "knnper.recipe": manifest["backend"]["recipe"],
        "knnper.keys_as_inputs": str(bool(keys_as_inputs)).lower(),
    }.items():
        model.metadata_props.add(key=key_name, value=value)
    onnx.checker.check_model(model)
    return model


def write_portable(
    runtime: Runtime, out: str | os.PathLike, *, keys_as_inputs: bool = False
) -> list[Path]:
    """Build a loaded bundle's predictor and write it to `out` atomically; with
    keys_as_inputs also <out>.keys.f32 ([n, q] float32) and <out>.labels.i64 ([n] int64), the
    bundle's current keys and labels. Returns the paths written."""
    out = Path(out)
    if out.suffix != ".onnx":
        raise ValueError(f"--out must end in .onnx, got {out}")
    if not out.parent.is_dir():
        raise ValueError(f"cannot write {out}: {out.parent} is not a directory")
    if out.resolve().is_relative_to(runtime.path.resolve()):
        # over its encoder.onnx (through a link too), or files the bundle does not list
        raise ValueError(f"--out {out} is inside the bundle {runtime.path}; write it elsewhere")
    model = build_portable(runtime, keys_as_inputs=keys_as_inputs)
    written = []
    if keys_as_inputs:
        keys, labels = portable_samples(runtime)
        for path, array in (
            (Path(f"{out}.keys.f32"), keys.astype("<f4")),
            (Path(f"{out}.labels.i64"), labels.astype("<i8")),
        ):
            write_bytes_atomic(path, np.ascontiguousarray(array).tobytes())
            written.append(path)
    write_bytes_atomic(out, model.SerializeToString())
    return [out, *written]


def portable_samples(runtime: Runtime) -> tuple[np.ndarray, np.ndarray]:
    """(keys [n, q] float32, labels [n] int64): what a keys-as-inputs graph takes for this
    bundle now (flat: every stored sample, as the search sees it; ProtoNN: its buffer)."""
    ds = runtime.datastore
    if ds.backend == "flat":
        return ds.keys(), ds.labels_
    return np.ascontiguousarray(ds.buffer_keys_t_.T), ds.buffer_labels_


def _verified_encoder_bytes(runtime: Runtime) -> bytes:
    """encoder.onnx read again, and checked against the manifest's sha256 once more (the file
    could have been replaced since the runtime loaded it)."""
    data = read_regular(runtime.path / ENCODER_FILE, runtime.manifest["budget_bytes"])
    if data is None or hashlib.sha256(data).hexdigest() != runtime.manifest["files"][ENCODER_FILE]:
        raise BundleError(
            f"bundle {runtime.path}: {ENCODER_FILE} changed since it was verified; load it again"
        )
    return data


class _Graph:
    """Nodes and initializers under construction, with fresh names."""

    def __init__(self, helper, numpy_helper) -> None:
        self.helper, self.numpy_helper = helper, numpy_helper
        self.nodes: list = []
        self.initializers: list = []
        self.inputs: list = []
        self._count = 0

    def name(self, stem: str) -> str:
        self._count += 1
        return f"knnper/{stem}_{self._count}"

    def const(self, value, dtype=np.float32) -> str:
        name = self.name("const")
        self.initializers.append(self.numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: int = 1, **attrs):
        names = [self.name(op.lower()) for _ in range(outputs)]
        self.nodes.append(self.helper.make_node(op, inputs, names, **attrs))
        return names[0] if outputs == 1 else names


def _normalise(g: _Graph, spec: dict) -> str:
    """(x / 255 - mean) / std on NCHW float32, the same float32 steps as prepare_input."""
    channels = int(spec["shape"][2])
    x = g.node("Cast", ["input"], to=1)  # FLOAT
    x = g.node("Transpose", [x], perm=[0, 3, 1, 2])
    x = g.node("Div", [x, g.const(255.0)])
    x = g.node("Sub", [x, g.const(np.reshape(spec["mean"], (1, channels, 1, 1)))])
    return g.node("Div", [x, g.const(np.reshape(spec["std"], (1, channels, 1, 1)))])


def _inline_encoder(g: _Graph, encoder, prepared: str) -> tuple[str, str]:
    """The encoder's nodes and initializers, every name prefixed, reading `prepared`."""
    graph = encoder.graph
    initializer_names = {t.name for t in graph.initializer}
    real_inputs = [i.name for i in graph.input if i.name not in initializer_names]
    if len(real_inputs) != 1:
        raise BundleError(f"the encoder has {len(real_inputs)} inputs, expected one")
    rename = {real_inputs[0]: prepared, "": ""}

    def renamed(name: str) -> str:
        return rename.get(name, PREFIX + name)

    for tensor in graph.initializer:
        copy = type(tensor)()
        copy.CopyFrom(tensor)
        copy.name = renamed(tensor.name)
        g.initializers.append(copy)
    for node in graph.node:
        copy = type(node)()
        copy.CopyFrom(node)
        copy.name = PREFIX + node.name if node.name else ""
        copy.input[:] = [renamed(n) for n in node.input]
        copy.output[:] = [renamed(n) for n in node.output]
        if any(a.g.node or a.graphs for a in copy.attribute):
            raise BundleError("the encoder has control-flow subgraphs; they cannot be inlined")
        g.nodes.append(copy)
    return renamed("embedding"), renamed("logits")


def _row_norms(g: _Graph, x: str, axis: int) -> str:
    return g.node("ReduceSum", [g.node("Mul", [x, x]), g.const([axis], np.int64)], keepdims=1)


def _squared_distances(g: _Graph, q: str, keys_t: str) -> str:
    """max(||q||^2 - 2 q keys_t + ||key||^2, 0) for queries [N, r] and keys [r, n]."""
    dots = g.node("MatMul", [q, keys_t])
    sq = g.node(
        "Add",
        [
            g.node("Sub", [_row_norms(g, q, 1), g.node("Mul", [dots, g.const(2.0)])]),
            _row_norms(g, keys_t, 0),
        ],
    )
    return g.node("Relu", [sq])


def _samples_input(g: _Graph, TensorProto) -> tuple[str, str]:
    helper = g.helper
    g.inputs.append(helper.make_tensor_value_info("keys", TensorProto.FLOAT, ["n", None]))
    g.inputs.append(helper.make_tensor_value_info("labels", TensorProto.INT64, ["n"]))
    return g.node("Transpose", ["keys"], perm=[1, 0]), "labels"


def _flat(g: _Graph, runtime: Runtime, z: str, keys_as_inputs: bool, TensorProto):
    ds = runtime.datastore
    if keys_as_inputs:
        keys_t, labels = _samples_input(g, TensorProto)
    else:
        keys_t = g.node("Cast", [g.const(ds.keys_t_, ds.keys_t_.dtype)], to=1)
        if ds.scale_ is not None:
            keys_t = g.node("Mul", [keys_t, g.const(ds.scale_[:, None])])
        labels = g.const(ds.labels_, np.int64)
    sq = _squared_distances(g, z, keys_t)
    n = g.node("Slice", [g.node("Shape", [sq]), g.const([1], np.int64), g.const([2], np.int64)])
    k = g.node("Min", [n, g.const([int(runtime.manifest["k"])], np.int64)])
    sq_k, idx = g.node("TopK", [sq, k], outputs=2, largest=0, sorted=1)
    scale = 1.0 / (runtime.manifest["embedding_dim"] * runtime.manifest["sigma"])
    weights = g.node("Softmax", [g.node("Mul", [sq_k, g.const(-scale)])], axis=1)
    onehot = g.node(
        "OneHot",
        [
            g.node("Gather", [labels, idx]),
            g.const(runtime.num_classes, np.int64),
            g.const([0.0, 1.0]),
        ],
        axis=-1,
    )
    p_local = g.node(
        "ReduceSum",
        [
            g.node("Mul", [onehot, g.node("Unsqueeze", [weights, g.const([2], np.int64)])]),
            g.const([1], np.int64),
        ],
        keepdims=0,
    )
    return z, p_local


def _protonn(g: _Graph, runtime: Runtime, z: str, keys_as_inputs: bool, TensorProto):
    ds = runtime.datastore
    wz = g.node("MatMul", [z, g.const(ds.W_.T)])
    if keys_as_inputs:
        buffer_t, labels = _samples_input(g, TensorProto)
        onehot = g.node(
            "OneHot",
            [labels, g.const(runtime.num_classes, np.int64), g.const([0.0, ds.buffer_weight_])],
            axis=-1,
        )
        prototypes = g.node("Concat", [g.const(ds.B_), buffer_t], axis=1)
        scores_t = g.node("Concat", [g.const(ds.Z_.T), onehot], axis=0)
    else:
        B_all, Z_all = ds.prototypes()
        prototypes, scores_t = g.const(B_all), g.const(Z_all.T)
    sq = _squared_distances(g, wz, prototypes)
    nearest = g.node("ReduceMin", [sq], axes=[1], keepdims=1)
    shifted = g.node("Relu", [g.node("Sub", [sq, nearest])])
    kernel = g.node("Exp", [g.node("Mul", [shifted, g.const(-(ds.gamma_**2))])])
    scores = g.node("Relu", [g.node("MatMul", [kernel, scores_t])])
    total = g.node("ReduceSum", [scores, g.const([1], np.int64)], keepdims=1)
    p_local = g.node(
        "Where",
        [
            g.node("Greater", [total, g.const(0.0)]),
            g.node("Div", [scores, total]),
            g.const(1.0 / runtime.num_classes),
        ],
    )
    return wz, p_local
