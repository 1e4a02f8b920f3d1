"""An exact-integer reference for the int8 encoder: every quantized operator the exporter's
encoders hold once onnxruntime has fused their QDQ graph (QLinearConv, grouped and depthwise
too; com.microsoft QGemm, QLinearAdd, QLinearMul and QLinearGlobalAveragePool; QuantizeLinear and
DequantizeLinear), each from its definition. Matrix products are int64 sums of the stored
integers, requantized as onnxruntime does (the float32 product of the sum and
x_scale * w_scale / y_scale, rounded half to even, plus the zero point, saturated); the
elementwise and pooling operators take the real values their integers stand for, in float64,
and round the result half to even onto the output's grid.

What onnxruntime computes on the CPU the tests run on is compared with it node by node
(`node_differences`: each quantized node fed onnxruntime's own inputs), so a kernel whose sums
saturate (AVX2's uint8 x int8 pair-add in 16 bits) shows as wrong output integers whatever
happened upstream. `saturating_dot` emulates that pair-add, to show the comparison catches it.
The float operators around them (MaxPool, Flatten, GroupNorm's InstanceNormalization, the float
head) run in onnx.reference, for `reference_outputs` (the whole graph from the input). An
operator outside QUANTIZED_OPS and FLOAT_OPS fails `node_differences`: a new kind of node in an
encoder must be given a reference (or be shown to be float) before the test passes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

# op_type -> the inputs' roles: what `node_differences` checks, each against its definition
QUANTIZED_OPS = (
    "QLinearConv",
    "QGemm",
    "QLinearAdd",
    "QLinearMul",
    "QLinearGlobalAveragePool",
    "QuantizeLinear",
    "DequantizeLinear",
)
# operators with no quantized arithmetic, run by onnx.reference in `reference_outputs`: float
# layers (the float head; a first layer or a GroupNorm kept float in the form written before),
# operators that move integers without arithmetic (Reshape, Flatten, MaxPool pick values), and
# the exact GroupNorm's (export/integer_norm.py): integer sums, then elementwise IEEE operations
FLOAT_OPS = (
    "Conv",
    "Gemm",
    "MaxPool",
    "Flatten",
    "Reshape",
    "Shape",
    "Gather",
    "Unsqueeze",
    "InstanceNormalization",
    "Cast",
    "ReduceSum",
    "Add",
    "Sum",
    "Sub",
    "Mul",
    "Div",
    "Sqrt",
)
INT16 = np.iinfo(np.int16)


def integer_dot(
    a: np.ndarray, a_zp: int, w: np.ndarray, w_zp: np.ndarray, *, saturate_pairs: bool = False
) -> np.ndarray:
    """sum_k (a[m, k] - a_zp) * (w[n, k] - w_zp[n]) in int64, [M, N]. With `saturate_pairs`,
    the raw products a * w are added two by two (k, k+1) in int16 with saturation first, as
    AVX2's vpmaddubsw does, before the zero-point corrections."""
    a, w = a.astype(np.int64), w.astype(np.int64)
    w_zp = np.broadcast_to(np.asarray(w_zp, np.int64).reshape(-1), (w.shape[0],))
    if saturate_pairs:
        k = a.shape[1] + a.shape[1] % 2
        a2, w2 = np.zeros((a.shape[0], k), np.int64), np.zeros((w.shape[0], k), np.int64)
        a2[:, : a.shape[1]], w2[:, : w.shape[1]] = a, w
        pairs = a2[:, None, 0::2] * w2[None, :, 0::2] + a2[:, None, 1::2] * w2[None, :, 1::2]
        raw = np.clip(pairs, INT16.min, INT16.max).sum(axis=2)
    else:
        raw = a @ w.T
    k = a.shape[1]
    return (
        raw
        - a_zp * w.sum(axis=1)[None, :]
        - a.sum(axis=1)[:, None] * w_zp[None, :]
        + k * a_zp * w_zp[None, :]
    )


def requantize(acc: np.ndarray, multiplier: np.ndarray, zero_point: np.ndarray) -> np.ndarray:
    """onnxruntime's requantization of an int32 sum: float32(acc) * multiplier (float32), round
    half to even, + zero point, saturated to the zero point's integer type."""
    info = np.iinfo(zero_point.dtype)
    scaled = acc.astype(np.float32) * multiplier.astype(np.float32)
    q = np.rint(scaled).astype(np.int64) + int(zero_point)
    return np.clip(q, info.min, info.max).astype(zero_point.dtype)


def _channel_scale(x_scale, w_scale, y_scale, alpha: float = 1.0) -> np.ndarray:
    return (
        (
            np.float32(alpha)
            * np.float32(x_scale)
            * np.asarray(w_scale, np.float32)
            / np.float32(y_scale)
        )
        .astype(np.float32)
        .reshape(-1)
    )


def _im2col(
    x: np.ndarray,
    kernel: tuple[int, int],
    pads: list[int],
    strides: list[int],
    dilations: list[int],
    pad_value: int,
) -> tuple[np.ndarray, int, int]:
    """[N, C, H, W] -> ([N * OH * OW, C * KH * KW], OH, OW), in ONNX's weight order."""
    n, c, h, w = x.shape
    kh, kw = kernel
    xp = np.pad(
        x.astype(np.int64),
        ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])),
        constant_values=pad_value,
    )
    oh = (h + pads[0] + pads[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (w + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    cols = np.empty((n, oh, ow, c, kh, kw), np.int64)
    for i in range(kh):
        for j in range(kw):
            hs, ws = i * dilations[0], j * dilations[1]
            patch = xp[
                :, :, hs : hs + strides[0] * oh : strides[0], ws : ws + strides[1] * ow : strides[1]
            ]
            cols[:, :, :, :, i, j] = patch.transpose(0, 2, 3, 1)
    return cols.reshape(n * oh * ow, c * kh * kw), oh, ow


def qlinear_conv(
    x,
    x_scale,
    x_zp,
    w,
    w_scale,
    w_zp,
    y_scale,
    y_zp,
    bias=None,
    *,
    pads=None,
    strides=None,
    dilations=None,
    group=1,
    saturate_pairs: bool = False,
) -> np.ndarray:
    """ONNX QLinearConv (2-D; grouped and depthwise too) with exact integer sums."""
    if x.ndim != 4:
        raise NotImplementedError("the reference covers 2-D convolutions")
    pads, strides = list(pads or [0, 0, 0, 0]), list(strides or [1, 1])
    dilations = list(dilations or [1, 1])
    # padding holds the zero point: it stands for real zero, as onnxruntime pads it
    cols, oh, ow = _im2col(x, w.shape[2:], pads, strides, dilations, int(x_zp))
    w = w.reshape(len(w), -1)
    if group == 1:
        acc = integer_dot(cols, int(x_zp), w, w_zp, saturate_pairs=saturate_pairs)
    else:
        acc = _grouped_dot(cols, int(x_zp), w, w_zp, group)
    if bias is not None:
        acc = acc + bias.astype(np.int64)[None, :]
    y = requantize(acc, _channel_scale(x_scale, w_scale, y_scale)[None, :], y_zp)
    return y.reshape(x.shape[0], oh, ow, -1).transpose(0, 3, 1, 2)


def _grouped_dot(
    cols: np.ndarray, x_zp: int, w: np.ndarray, w_zp: np.ndarray, group: int
) -> np.ndarray:
    """integer_dot per group: cols [M, C*KH*KW] (channel-major, so a group's columns are
    contiguous) and w [outputs, C/group*KH*KW] -> [M, outputs], group g's outputs g-th."""
    m, outputs = cols.shape[0], len(w)
    a = cols.reshape(m, group, -1) - x_zp
    zp = np.broadcast_to(np.asarray(w_zp, np.int64).reshape(-1), (outputs,))
    wq = (w.astype(np.int64) - zp[:, None]).reshape(group, outputs // group, -1)
    return np.einsum("mgk,gok->mgo", a, wq).reshape(m, outputs)


def _on_grid(real: np.ndarray, scale, zero_point: np.ndarray) -> np.ndarray:
    """Real values onto a quantized grid: round half to even of real / scale (float64), plus
    the zero point, saturated to its integer type."""
    info = np.iinfo(zero_point.dtype)
    q = np.rint(real / np.float64(scale)).astype(np.int64) + int(zero_point)
    return np.clip(q, info.min, info.max).astype(zero_point.dtype)


def _real(q: np.ndarray, scale, zero_point) -> np.ndarray:
    return (q.astype(np.int64) - int(zero_point)) * np.float64(scale)


def qlinear_add(a, a_scale, a_zp, b, b_scale, b_zp, c_scale, c_zp) -> np.ndarray:
    """com.microsoft QLinearAdd as onnxruntime defines it on x86 and Arm alike (MLAS): in fixed
    point, each input's scale ratio to C's a 22-bit integer multiplier at a shared shift, the
    int32 sum rounded half away from zero by that shift; in float32 (each real value, their sum
    over C's scale, rounded half to even) where the ratios do not fit that form."""
    ratio_a = np.float32(a_scale) / np.float32(c_scale)
    ratio_b = np.float32(b_scale) / np.float32(c_scale)
    da = a.astype(np.int64) - int(a_zp)
    db = b.astype(np.int64) - int(b_zp)
    fixed = _fixed_point(ratio_a, ratio_b)
    if fixed is None:
        value = (np.float32(a_scale) * da.astype(np.float32)) + (
            np.float32(b_scale) * db.astype(np.float32)
        )
        q = np.rint((value / np.float32(c_scale)).astype(np.float32)).astype(np.int64)
    else:
        shift, mult_a, mult_b = fixed
        acc = da * mult_a + db * mult_b
        acc = acc - (acc < 0)  # half away from zero once the rounding shift adds half
        q = (acc + (1 << (shift - 1))) >> shift
    info = np.iinfo(c_zp.dtype)
    return np.clip(q + int(c_zp), info.min, info.max).astype(c_zp.dtype)


def _fixed_point(ratio_a: np.float32, ratio_b: np.float32) -> tuple[int, int, int] | None:
    """MLAS's QLinearAdd parameters (shift, multiplier A, multiplier B), or None for its float
    fallback: ratios in [2^-14, 2^8), the greater one's multiplier in [2^21, 2^22)."""
    if not all(2.0**-14 <= r < 2.0**8 for r in (ratio_a, ratio_b)):
        return None
    exponent = int(np.frexp(max(ratio_a, ratio_b))[1]) - 1
    shift = 21 - exponent
    if not 13 <= shift <= 31:
        return None
    mult_a, mult_b = (
        int(np.rint(np.float32(r) * np.float32(2.0**shift))) for r in (ratio_a, ratio_b)
    )
    if mult_a >= 1 << 22 or mult_b >= 1 << 22 or max(mult_a, mult_b) < 1 << 21:
        return None
    return shift, mult_a, mult_b


def qlinear_mul(a, a_scale, a_zp, b, b_scale, b_zp, c_scale, c_zp) -> np.ndarray:
    """com.microsoft QLinearMul: the product of the two real values, onto C's grid."""
    return _on_grid(_real(a, a_scale, a_zp) * _real(b, b_scale, b_zp), c_scale, c_zp)


def qlinear_global_average_pool(x, x_scale, x_zp, y_scale, y_zp, *, channels_last: int = 0):
    """com.microsoft QLinearGlobalAveragePool: the mean real value per channel (exact integer
    sum), onto Y's grid, spatial dimensions kept as 1."""
    axes = tuple(range(1, x.ndim - 1)) if channels_last else tuple(range(2, x.ndim))
    total = (x.astype(np.int64) - int(x_zp)).sum(axis=axes, keepdims=True)
    count = int(np.prod([x.shape[a] for a in axes]))
    return _on_grid(total * np.float64(x_scale) / count, y_scale, y_zp)


def quantize_linear(x, y_scale, y_zp) -> np.ndarray:
    """ONNX QuantizeLinear (per tensor): float32 x / scale, rounded half to even, plus the zero
    point, saturated."""
    info = np.iinfo(y_zp.dtype)
    q = np.rint(np.float32(x) / np.float32(y_scale)).astype(np.int64) + int(y_zp)
    return np.clip(q, info.min, info.max).astype(y_zp.dtype)


def dequantize_linear(x, x_scale, x_zp=None, *, axis: int = 1) -> np.ndarray:
    """ONNX DequantizeLinear: (x - zero point) * scale in float32, per tensor or per axis."""
    shape = [1] * x.ndim
    if np.ndim(x_scale):
        shape[axis] = -1
    scale = np.asarray(x_scale, np.float32).reshape(shape)
    zp = np.zeros(1, np.int64) if x_zp is None else np.asarray(x_zp, np.int64).reshape(shape)
    return ((x.astype(np.int64) - zp).astype(np.float32) * scale).astype(np.float32)


def qgemm(
    a,
    a_scale,
    a_zp,
    b,
    b_scale,
    b_zp,
    c=None,
    y_scale=None,
    y_zp=None,
    *,
    trans_a: int = 0,
    trans_b: int = 0,
    alpha: float = 1.0,
    saturate_pairs: bool = False,
) -> np.ndarray:
    """com.microsoft QGemm with exact integer sums; a float output when y_scale is None."""
    a = a.T if trans_a else a
    b = b if trans_b else b.T  # rows: output channels
    acc = integer_dot(a, int(a_zp), b, b_zp, saturate_pairs=saturate_pairs)
    if c is not None:
        acc = acc + c.astype(np.int64)[None, :]
    if y_scale is None:
        return acc.astype(np.float32) * _channel_scale(a_scale, b_scale, 1.0, alpha)[None, :]
    return requantize(acc, _channel_scale(a_scale, b_scale, y_scale, alpha)[None, :], y_zp)


class QLinearConv(OpRun):
    def _run(
        self,
        x,
        x_scale,
        x_zero_point,
        w,
        w_scale,
        w_zero_point,
        y_scale,
        y_zero_point,
        B=None,
        auto_pad=None,
        dilations=None,
        group=None,
        kernel_shape=None,
        pads=None,
        strides=None,
    ):
        return (
            qlinear_conv(
                x,
                x_scale,
                x_zero_point,
                w,
                w_scale,
                w_zero_point,
                y_scale,
                y_zero_point,
                B,
                pads=pads or self.pads,
                strides=strides or self.strides,
                dilations=dilations or self.dilations,
                group=group or self.group,
            ),
        )


class QGemm(OpRun):
    op_domain = "com.microsoft"

    def _run(
        self,
        A,
        a_scale,
        a_zero_point,
        B,
        b_scale,
        b_zero_point,
        C=None,
        y_scale=None,
        y_zero_point=None,
        alpha=None,
        transA=None,
        transB=None,
    ):
        return (
            qgemm(
                A,
                a_scale,
                a_zero_point,
                B,
                b_scale,
                b_zero_point,
                C,
                y_scale,
                y_zero_point,
                trans_a=transA if transA is not None else self.transA,
                trans_b=transB if transB is not None else self.transB,
                alpha=alpha if alpha is not None else self.alpha,
            ),
        )


class _QLinearBinary(OpRun):
    op_domain = "com.microsoft"

    def _run(self, a, a_scale, a_zp, b, b_scale, b_zp, c_scale, c_zp):
        return (self.function(a, a_scale, a_zp, b, b_scale, b_zp, c_scale, c_zp),)


class QLinearAdd(_QLinearBinary):
    function = staticmethod(qlinear_add)


class QLinearMul(_QLinearBinary):
    function = staticmethod(qlinear_mul)


class QLinearGlobalAveragePool(OpRun):
    op_domain = "com.microsoft"

    def _run(self, x, x_scale, x_zp, y_scale, y_zp, channels_last=None):
        last = channels_last if channels_last is not None else self.channels_last
        return (qlinear_global_average_pool(x, x_scale, x_zp, y_scale, y_zp, channels_last=last),)


def reference_outputs(model_path: str | Path, x: np.ndarray) -> list[np.ndarray]:
    """The graph's outputs, quantized operators exact, the rest by onnx.reference (which
    implements (De)QuantizeLinear from opset 19 on: the graph's ops mean the same there)."""
    model = onnx.load(str(model_path))
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, 19)
    evaluator = ReferenceEvaluator(
        model, new_ops=[QLinearConv, QGemm, QLinearAdd, QLinearMul, QLinearGlobalAveragePool]
    )
    return evaluator.run(None, {evaluator.input_names[0]: x})


def _exact_node(node: onnx.NodeProto, inputs: list[np.ndarray | None]) -> np.ndarray:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "QLinearConv":
        return qlinear_conv(
            *inputs,
            pads=attrs.get("pads"),
            strides=attrs.get("strides"),
            dilations=attrs.get("dilations"),
            group=attrs.get("group", 1),
        )
    if node.op_type == "QGemm":
        return qgemm(
            *inputs,
            trans_a=attrs.get("transA", 0),
            trans_b=attrs.get("transB", 0),
            alpha=attrs.get("alpha", 1.0),
        )
    if node.op_type == "QLinearGlobalAveragePool":
        return qlinear_global_average_pool(*inputs, channels_last=attrs.get("channels_last", 0))
    if node.op_type == "DequantizeLinear":
        return dequantize_linear(*inputs, axis=attrs.get("axis", 1))
    if node.op_type == "QuantizeLinear" and (len(inputs) < 3 or inputs[2] is None):
        return quantize_linear(inputs[0], inputs[1], np.uint8(0))
    return {
        "QLinearAdd": qlinear_add,
        "QLinearMul": qlinear_mul,
        "QuantizeLinear": quantize_linear,
    }[node.op_type](*inputs)


# op_type -> (the positions of its integer data inputs' zero points, its output's zero point:
# None for a float output, "uint8" where a QuantizeLinear may leave it out)
_ZERO_POINTS = {
    "QLinearConv": ((2,), 7),
    "QGemm": ((2,), 8),
    "QLinearAdd": ((2, 5), 7),
    "QLinearMul": ((2, 5), 7),
    "QLinearGlobalAveragePool": ((2,), 4),
    "QuantizeLinear": ((), 2),
    "DequantizeLinear": ((2,), None),
}


def _output_type(node: onnx.NodeProto, elem: dict[str, int]) -> int:
    _, out_zp = _ZERO_POINTS[node.op_type]
    if out_zp is None or len(node.input) <= out_zp or not node.input[out_zp]:
        # QGemm without y_scale gives float; QuantizeLinear without a zero point gives uint8
        return (
            onnx.TensorProto.UINT8 if node.op_type == "QuantizeLinear" else onnx.TensorProto.FLOAT
        )
    return elem[node.input[out_zp]]


def node_differences(model_path: str | Path, x: np.ndarray) -> dict[str, dict]:
    """For each quantized node: onnxruntime's output (on this CPU, the graph as saved, no
    further optimization) against the exact integers computed from onnxruntime's own inputs
    to that node: the largest difference in quantization steps (a float output's in its own
    units, which a DequantizeLinear's scale makes steps) and the share of outputs that differ
    at all. A node that is neither quantized nor float (QUANTIZED_OPS, FLOAT_OPS) raises."""
    model = onnx.load(str(model_path))
    unknown = sorted({n.op_type for n in model.graph.node} - set(QUANTIZED_OPS) - set(FLOAT_OPS))
    if unknown:
        raise NotImplementedError(f"no exact reference for {unknown}: add one, or list it float")
    init = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    quantized = [n for n in model.graph.node if n.op_type in QUANTIZED_OPS]
    elem = {i.name: i.data_type for i in model.graph.initializer}
    wanted: dict[str, int] = {}
    for node in quantized:
        # a data input's type is its zero point's; a QuantizeLinear's input is float
        data_zps, _ = _ZERO_POINTS[node.op_type]
        for position in data_zps:
            wanted[node.input[position - 2]] = elem[node.input[position]]
        if node.op_type == "QuantizeLinear":
            wanted[node.input[0]] = onnx.TensorProto.FLOAT
        wanted[node.output[0]] = _output_type(node, elem)
    present = {o.name for o in model.graph.output} | {i.name for i in model.graph.input}
    for name, data_type in wanted.items():
        if name not in present and name not in init:
            model.graph.output.append(helper.make_tensor_value_info(name, data_type, None))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    feeds = {session.get_inputs()[0].name: x}
    values = dict(zip(names, session.run(None, feeds), strict=True))
    values.update(init)
    values.update(feeds)
    report = {}
    for node in quantized:
        inputs = [values[name] if name else None for name in node.input]
        exact = _exact_node(node, inputs).astype(np.float64)
        got = values[node.output[0]].astype(np.float64)
        diff = np.abs(got - exact)
        if node.op_type == "DequantizeLinear":
            diff = diff / np.abs(np.asarray(inputs[1], np.float64)).max()
        report[node.name] = {
            "op_type": node.op_type,
            "max_steps": float(diff.max()),
            "share_differing": float(np.mean(diff > 0)),
            "outputs": int(diff.size),
        }
    return report
