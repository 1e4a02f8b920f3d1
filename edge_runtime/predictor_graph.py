"""The one builder of the whole kNN-Per prediction as an ONNX graph: input normalisation, the
encoder, the datastore's posterior and the lambda interpolation. `knnper-edge export-onnx`
(portable.py) and the runtime's single session (predictor.py) both call `build_predictor`, so
the graph a phone runs and the graph the Python runtime runs are the same code.

Written at the protobuf level (onnx_proto), so the device needs no onnx package. The posterior
is computed in float64 after the distances, as the numpy head does (edge_runtime/knn.py), so the
two agree to about 1e-12 on the same distances.

How the datastore's samples enter the graph (`samples`):
- "constant": baked in as initializers (int8 keys are then prepacked by onnxruntime).
- "baked": as "constant", without the "key" output: the runtime's session over a small flat
  store (predictor.BAKED_KEY_BYTES), which stores through its datastore.
- "portable": graph inputs "keys" [n, q] float32 and "labels" [n] int64, the public format of
  `export-onnx --keys-as-inputs` (flat: all stored samples; ProtoNN: its buffer); for an int8
  bundle the float keys meet the query quantised as the integer scan quantises it.
- "stored": graph inputs as the runtime holds them, so nothing is copied and `add` needs no new
  session: flat "keys_t" [p, n] in the stored dtype, "key_norms" [n] float32, "labels" [n]
  uint8 (int64 past 256 classes; int8 keys also "key_offsets" [n] int32); ProtoNN
  "prototypes" B [d, m], "prototype_scores" Z [C, m], "prototype_norms" [m] (float32) and its
  buffer, "keys_t" [d, count] float32 and "labels" [count] int64.

int8 keys are scanned by onnxruntime's integer kernels (MatMulInteger, uint8 x int8): the query
times the per-dimension scale is quantised to integers in [-63, 63] with one symmetric scale per
query (7 bits: see knn.QUERY_LEVELS), rounded and shifted by +64 into uint8 by one
QuantizeLinear (scale 1, zero point 64; MatMulInteger's own zero point stays 0), and 64 x each
key's sum is subtracted from the int32 products, which makes them exactly the integer products
of the quantised query and keys.
`knn.int8_query` is the same quantisation in numpy, the float reference.
"""

from __future__ import annotations

import numpy as np

from . import onnx_proto as P
from .datastores.registry import BACKENDS
from .knn import QUERY_LEVELS, QUERY_SHIFT
from .manifest import Manifest
from .preprocess import InputSpec

OPSET = 17
ENCODER_INPUT = "knnper/encoder_input"
SAMPLE_MODES = ("constant", "baked", "portable", "stored")


def graph_backends() -> list[str]:
    """The datastore backends with an ONNX form (their class's `ONNX_FORM`: an HNSW search,
    for one, is a graph walk, not tensor ops)."""
    return [name for name, cls in BACKENDS.items() if cls.ONNX_FORM is not None]


class _Graph:
    """Nodes, initializers and inputs under construction, with fresh names."""

    def __init__(self, opset: int) -> None:
        self.opset = opset
        self.nodes: list[bytes] = []
        self.initializers: list[bytes] = []
        self.inputs: list[bytes] = []
        self._count = 0

    def name(self, stem: str) -> str:
        self._count += 1
        return f"knnper/{stem}_{self._count}"

    def const(self, value, dtype=np.float32) -> str:
        name = self.name("const")
        self.initializers.append(P.tensor(name, np.asarray(value, dtype)))
        return name

    def input(self, name: str, elem_type: int, shape) -> str:
        self.inputs.append(P.value_info(name, elem_type, shape))
        return name

    def node(self, op: str, inputs: list[str], outputs: int = 1, **attrs):
        names = [self.name(op.lower()) for _ in range(outputs)]
        self.nodes.append(P.node(op, inputs, names, **attrs))
        return names[0] if outputs == 1 else names

    def reduce(self, op: str, x: str, axis: int, keepdims: int = 1) -> str:
        """Reduce* over one axis: axes as an input from the opset that made it one."""
        if op == "ReduceSum" or self.opset >= 18:
            return self.node(op, [x, self.const([axis], np.int64)], keepdims=keepdims)
        return self.node(op, [x], axes=[axis], keepdims=keepdims)

    def cast(self, x: str, to: int) -> str:
        return self.node("Cast", [x], to=to)


def build_predictor(
    manifest: Manifest,
    datastore,
    encoder: bytes,
    *,
    samples: str = "constant",
    probabilities: str = "float32",
) -> bytes:
    """The predictor of a verified bundle's parts as ONNX model bytes.

    Input "input": raw inputs as the manifest declares them (uint8 images [N, H, W, C] or int64
    token ids [N, L]). Outputs: "probabilities" [N, C] (float32 or float64), "key" [N, q]
    float32 (what a device stores for an input once labelled, as `Runtime.add` stores it: the
    embedding for flat fp32/fp16, the embedding re-quantised with the datastore's per-dimension
    scale for flat int8, W z for ProtoNN; not in the "stored" form: the runtime stores through
    its datastore, and onnxruntime runs every node of a graph whichever outputs a call asks
    for), and the encoder's own "embedding" and "logits"."""
    if samples not in SAMPLE_MODES:
        raise ValueError(f"samples must be one of {SAMPLE_MODES}, got {samples!r}")
    if datastore.ONNX_FORM is None:
        raise ValueError(
            f"a {datastore.backend} datastore has no ONNX form; export the client with a "
            f"{' or '.join(graph_backends())} datastore"
        )
    parsed = P.ParsedModel(encoder)
    if len(parsed.inputs) != 1:
        raise ValueError(f"the encoder has {len(parsed.inputs)} inputs, expected one")
    missing = {"embedding", "logits"} - set(parsed.outputs)
    if missing:
        raise ValueError(f"the encoder lacks output(s) {sorted(missing)}")
    opsets = dict(parsed.opsets)
    opsets[""] = max(opsets.get("", OPSET), OPSET)
    g = _Graph(opsets[""])
    spec = manifest.input
    if spec.kind == "image":
        g.input("input", P.UINT8, ["N", *spec.shape])
        _normalise(g, spec)
    else:
        g.input("input", P.INT64, ["N", *spec.shape])
        g.nodes.append(P.node("Identity", ["input"], [ENCODER_INPUT]))
    # the graph's nodes: the input's preparation, the encoder's, then the kNN head's
    head = [P.nodes(g.nodes), *parsed.graph_body((parsed.inputs[0], ENCODER_INPUT))]
    g.nodes = []
    z, logits = "embedding", "logits"
    form = {"keys": _flat, "prototypes": _protonn}[datastore.ONNX_FORM]
    key, p_local = form(g, manifest, datastore, z, samples)
    p_global = g.cast(g.node("Softmax", [logits], axis=1), P.DOUBLE)
    lam = manifest.lam
    terms = [
        g.node("Mul", [p_local, g.const(lam, np.float64)]),
        g.node("Mul", [p_global, g.const(1.0 - lam, np.float64)]),
    ]
    out_type = {"float32": P.FLOAT, "float64": P.DOUBLE}[probabilities]
    if out_type == P.DOUBLE:  # the sum is the output: no node that copies it
        g.nodes.append(P.node("Add", terms, ["probabilities"]))
    else:
        g.nodes.append(P.node("Cast", [g.node("Add", terms)], ["probabilities"], to=out_type))
    classes = int(manifest.num_classes)
    outputs = [P.value_info("probabilities", out_type, ["N", classes])]
    if key is not None:
        g.nodes.append(P.node("Identity", [key], ["key"]))
        outputs.append(P.value_info("key", P.FLOAT, ["N", None]))
    outputs += [
        P.value_info("embedding", P.FLOAT, ["N", int(manifest.embedding_dim)]),
        P.value_info("logits", P.FLOAT, ["N", classes]),
    ]
    graph = P.graph("knnper_predictor", g.nodes, g.inputs, outputs, g.initializers, prefix=head)
    return P.model(
        graph + parsed.functions,
        ir_version=max(parsed.ir_version, 8),
        opsets=opsets,
        producer="knnper-edge predictor",
        metadata={
            "knnper.client_id": str(manifest.client_id),
            "knnper.recipe": manifest.recipe,
            "knnper.samples": samples,
        },
    )


def _normalise(g: _Graph, spec: InputSpec) -> None:
    """(x / 255 - mean) / std on NCHW float32, the same float32 steps as prepare_input."""
    channels = spec.shape[2]
    x = g.cast("input", P.FLOAT)
    x = g.node("Transpose", [x], perm=[0, 3, 1, 2])
    x = g.node("Div", [x, g.const(255.0)])
    x = g.node("Sub", [x, g.const(np.reshape(spec.mean, (1, channels, 1, 1)))])
    std = g.const(np.reshape(spec.std, (1, channels, 1, 1)))
    g.nodes.append(P.node("Div", [x, std], [ENCODER_INPUT]))


def _row_norms(g: _Graph, x: str, axis: int) -> str:
    return g.reduce("ReduceSum", g.node("Mul", [x, x]), axis)


def _nearest(g: _Graph, minus_twice_dots: str, q_norms: str, key_norms: str, k: int):
    """(squared distances [N, k'], their columns), nearest first, k' = min(k, n): distances
    max(-2 q.k + ||k||^2 + ||q||^2, 0), summed in the numpy head's order. Only what orders the
    keys passes over all n of them: the -2 is taken by the query (or the int8 scale) before the
    products (scaling by a power of two is exact), and ||q||^2 and the clamp, which leave the
    order as it is, are applied to the k nearest."""
    partial = g.node("Add", [minus_twice_dots, key_norms])
    n = g.node("Shape", [partial], start=1, end=2)  # Shape's own slice (opset 15 on)
    k_n = g.node("Min", [n, g.const([k], np.int64)])
    partial_k, idx = g.node("TopK", [partial, k_n], outputs=2, largest=0, sorted=1)
    return g.node("Relu", [g.node("Add", [partial_k, q_norms])]), idx


def _query_over_scale(g: _Graph, q: str, scale: np.ndarray) -> tuple[str, str]:
    """(q * scale / s [N, p] float32 in [-63, 63], s [N, 1]): knn.int8_query in the graph,
    up to its rounding (half to even, as Round and QuantizeLinear both round)."""
    qs = g.node("Mul", [q, g.const(scale[None, :])])
    peak = g.reduce("ReduceMax", g.node("Abs", [qs]), 1)
    s = g.node(
        "Where",
        [
            g.node("Greater", [peak, g.const(0.0)]),
            g.node("Div", [peak, g.const(float(QUERY_LEVELS))]),
            g.const(1.0),
        ],
    )
    return g.node("Div", [qs, s]), s


def _int8_products(g: _Graph, q: str, keys_t: str, key_offsets: str, scale: np.ndarray) -> str:
    """-2 q . (keys_t * scale) [N, n] float32 through MatMulInteger; see the module docstring."""
    ratio, s = _query_over_scale(g, q, scale)
    # rounded, shifted and cast in one node (Round, Add and Cast took 10 us more at batch 1:
    # benchmarks/results/runtime/last_mib/int8_head/quantize_linear.txt)
    shifted = g.node("QuantizeLinear", [ratio, g.const(1.0), g.const(QUERY_SHIFT, np.uint8)])
    products = g.node("MatMulInteger", [shifted, keys_t])
    # the shift's share, QUERY_SHIFT x each key's sum, held by the datastore: no n-long
    # product (time and an intermediate of n int32s) on every call
    exact = g.node("Sub", [products, key_offsets])
    return g.node("Mul", [g.cast(exact, P.FLOAT), g.node("Mul", [s, g.const(-2.0)])])


def _minus_twice(g: _Graph, query: str) -> str:
    return g.node("Mul", [query, g.const(-2.0)])


def _portable_samples(g: _Graph) -> tuple[str, str]:
    g.input("keys", P.FLOAT, ["n", None])
    g.input("labels", P.INT64, ["n"])
    return g.node("Transpose", ["keys"], perm=[1, 0]), "labels"


def _flat(g: _Graph, manifest: Manifest, ds, z: str, samples: str) -> tuple[str | None, str]:
    int8 = ds.dtype == "int8"
    narrow_labels = samples == "stored" and ds.labels_.dtype != np.int64
    if samples == "portable":
        keys_t, labels = _portable_samples(g)
        key_norms = _row_norms(g, keys_t, 0)
        query = z
        if int8:  # float keys k * scale meet the query as the integer scan quantises it
            ratio, s = _query_over_scale(g, z, ds.scale_)
            quantised = g.node("Round", [ratio])
            query = g.node("Div", [g.node("Mul", [quantised, s]), g.const(ds.scale_[None, :])])
        dots = g.node("MatMul", [_minus_twice(g, query), keys_t])
    else:
        if samples == "stored":
            stored_type = {"fp32": P.FLOAT, "fp16": P.FLOAT16, "int8": P.INT8}[ds.dtype]
            keys_t = g.input("keys_t", stored_type, [int(ds.embedding_dim_), "n"])
            key_norms = g.input("key_norms", P.FLOAT, ["n"])
            labels = g.input("labels", P.tensor_type(ds.labels_.dtype), ["n"])
            key_offsets = g.input("key_offsets", P.INT32, ["n"]) if int8 else None
        else:
            keys_t = g.const(ds.keys_t_, ds.keys_t_.dtype)
            key_norms = g.const(ds.key_norms_)
            labels = g.const(ds.labels_, np.int64)
            key_offsets = g.const(ds.key_offsets_, np.int32) if int8 else None
        if int8:
            dots = _int8_products(g, z, keys_t, key_offsets, ds.scale_)
        elif ds.dtype == "fp16":
            dots = g.node("MatMul", [_minus_twice(g, z), g.cast(keys_t, P.FLOAT)])
        else:
            dots = g.node("MatMul", [_minus_twice(g, z), keys_t])
    sq_k, idx = _nearest(g, dots, _row_norms(g, z, 1), key_norms, int(manifest.k))
    scale = 1.0 / (manifest.embedding_dim * manifest.sigma)
    key = None if samples in ("stored", "baked") else z  # fp32: stored as given
    if key is not None and int8:
        key = _int8_key(g, z, ds.scale_)
    elif key is not None and ds.dtype == "fp16":
        key = _fp16_key(g, z)
    weights = g.node(
        "Softmax", [g.node("Mul", [g.cast(sq_k, P.DOUBLE), g.const(-scale, np.float64)])], axis=1
    )
    neighbour_labels = g.node("Gather", [labels, idx])
    if narrow_labels:  # a datastore holds one byte a label where the classes fit
        neighbour_labels = g.cast(neighbour_labels, P.INT64)
    # each neighbour's weight in its label's column, 0 elsewhere (the weights of a one-hot
    # product, bit for bit, with no casts or products)
    hits = _label_hits(g, neighbour_labels, int(manifest.num_classes))
    weighted = g.node(
        "Where",
        [hits, g.node("Unsqueeze", [weights, g.const([2], np.int64)]), g.const(0.0, np.float64)],
    )
    return key, g.reduce("ReduceSum", weighted, 1, keepdims=0)


def _one_hot(g: _Graph, labels: str, classes: int, on_value: float) -> str:
    """labels [...] -> [..., classes] float32 with on_value at each label, 0 elsewhere.
    Equal against 0..classes-1 rather than OneHot: onnxruntime 1.23 (the newest for Python
    3.10) dies with SIGFPE on a OneHot of zero labels, which an empty ProtoNN buffer feeds."""
    return g.node("Mul", [g.cast(_label_hits(g, labels, classes), P.FLOAT), g.const(on_value)])


def _label_hits(g: _Graph, labels: str, classes: int) -> str:
    """labels [...] int64 -> [..., classes] bool, true at each label."""
    return g.node(
        "Equal",
        [
            g.node("Unsqueeze", [labels, g.const([-1], np.int64)]),
            g.const(np.arange(classes), np.int64),
        ],
    )


def _int8_key(g: _Graph, z: str, scale: np.ndarray) -> str:
    """The key `add` stores for z in an int8 datastore, as the float keys the search sees:
    clip(round(z / scale), -127, 127) * scale with the datastore's per-dimension scale (fixed
    when the keys were first quantised), so an app appending it matches `Runtime.add`."""
    scale_const = g.const(scale[None, :])
    levels = g.node("Round", [g.node("Div", [z, scale_const])])
    clipped = g.node("Clip", [levels, g.const(-127.0), g.const(127.0)])
    return g.node("Mul", [clipped, scale_const])


def _fp16_key(g: _Graph, z: str) -> str:
    """The key `add` stores for z in an fp16 datastore: z clipped to float16's range and
    rounded to float16, as float32."""
    limit = float(np.finfo(np.float16).max)
    clipped = g.node("Clip", [z, g.const(-limit), g.const(limit)])
    return g.cast(g.cast(clipped, P.FLOAT16), P.FLOAT)


def _protonn(g: _Graph, manifest: Manifest, ds, z: str, samples: str) -> tuple[str | None, str]:
    """ProtoNN's posterior. The prototypes and the buffer of added samples are scored as two
    parts whose squared distances meet only to find the nearest: nothing as large as the
    prototypes is concatenated on a call."""
    classes = int(manifest.num_classes)
    wz = g.node("MatMul", [z, g.const(ds.W_.T)])
    wz_norms = g.cast(_row_norms(g, wz, 1), P.DOUBLE)
    if samples in ("constant", "baked"):
        B_all, Z_all = ds.prototypes()
        norms = np.einsum("ij,ij->j", B_all, B_all)  # as ProtoNNDatastore sums them
        parts = [(g.const(B_all), g.const(norms), g.const(Z_all), True)]
    else:
        if samples == "stored":
            d, m = (int(s) for s in ds.B_.shape)
            prototypes = g.input("prototypes", P.FLOAT, [d, m])
            scores_by_class = g.input("prototype_scores", P.FLOAT, [classes, m])
            norms = g.input("prototype_norms", P.FLOAT, [m])
            buffer_t = g.input("keys_t", P.FLOAT, [d, "n"])
            labels = g.input("labels", P.INT64, ["n"])
        else:
            prototypes, scores_by_class = g.const(ds.B_), g.const(ds.Z_)
            norms = g.const(ds.prototype_norms_)
            buffer_t, labels = _portable_samples(g)
        onehot = _one_hot(g, labels, classes, ds.buffer_weight_)
        parts = [
            (prototypes, norms, scores_by_class, True),
            (buffer_t, _row_norms(g, buffer_t, 0), onehot, False),
        ]
    sq_parts = []
    for keys_t, key_norms, _, _ in parts:
        twice = g.node(
            "Mul", [g.cast(g.node("MatMul", [wz, keys_t]), P.DOUBLE), g.const(2.0, np.float64)]
        )
        sq_parts.append(
            g.node("Add", [g.node("Sub", [wz_norms, twice]), g.cast(key_norms, P.DOUBLE)])
        )
    sq = sq_parts[0] if len(sq_parts) == 1 else g.node("Concat", sq_parts, axis=1)
    nearest = g.reduce("ReduceMin", sq, 1)
    shifted = g.node("Relu", [g.node("Sub", [sq, nearest])])
    kernel = g.node("Exp", [g.node("Mul", [shifted, g.const(-(ds.gamma_**2), np.float64)])])
    kernel = g.cast(kernel, P.FLOAT)
    if len(parts) == 1:
        scores = g.node("Gemm", [kernel, parts[0][2]], transB=1)
    else:
        m = g.const([int(ds.B_.shape[1])], np.int64)
        axis = g.const([1], np.int64)
        k_prototypes = g.node("Slice", [kernel, g.const([0], np.int64), m, axis])
        k_buffer = g.node("Slice", [kernel, m, g.const([np.iinfo(np.int64).max], np.int64), axis])
        scores = g.node(
            "Add",
            [
                g.node("Gemm", [k_prototypes, parts[0][2]], transB=1),
                g.node("MatMul", [k_buffer, parts[1][2]]),
            ],
        )
    scores = g.node("Relu", [g.cast(scores, P.DOUBLE)])
    total = g.reduce("ReduceSum", scores, 1)
    p_local = g.node(
        "Where",
        [
            g.node("Greater", [total, g.const(0.0, np.float64)]),
            g.node("Div", [scores, total]),
            g.const(1.0 / classes, np.float64),
        ],
    )
    return (None if samples in ("stored", "baked") else wz), p_local
