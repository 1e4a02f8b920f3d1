"""An exact-integer reference for the int8 encoder: its quantized operators (QLinearConv and
com.microsoft QGemm, as onnxruntime fuses the exporter's QDQ graph) recomputed with int64 sums
of the stored integers, then requantized as onnxruntime does (the float32 product of the sum and
x_scale * w_scale / y_scale, rounded half to even, plus the zero point, saturated).

What onnxruntime computes on the CPU the tests run on is compared with it node by node
(`node_differences`: each quantized node fed onnxruntime's own inputs), so a kernel whose sums
saturate (AVX2's uint8 x int8 pair-add in 16 bits) shows as wrong output integers whatever
happened upstream. `saturating_dot` emulates that pair-add, to show the comparison catches it.
The float operators around them (the float first Conv, MaxPool, Flatten, the float head) run in
onnx.reference, for `reference_outputs` (the whole graph from the input).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

QUANTIZED_OPS = ("QLinearConv", "QGemm")
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
    """ONNX QLinearConv (2-D, group 1) with exact integer sums."""
    if group != 1 or x.ndim != 4:
        raise NotImplementedError("the reference covers 2-D convolutions with group 1")
    pads, strides = list(pads or [0, 0, 0, 0]), list(strides or [1, 1])
    dilations = list(dilations or [1, 1])
    # padding holds the zero point: it stands for real zero, as onnxruntime pads it
    cols, oh, ow = _im2col(x, w.shape[2:], pads, strides, dilations, int(x_zp))
    acc = integer_dot(cols, int(x_zp), w.reshape(len(w), -1), w_zp, saturate_pairs=saturate_pairs)
    if bias is not None:
        acc = acc + bias.astype(np.int64)[None, :]
    y = requantize(acc, _channel_scale(x_scale, w_scale, y_scale)[None, :], y_zp)
    return y.reshape(x.shape[0], oh, ow, -1).transpose(0, 3, 1, 2)


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


def reference_outputs(model_path: str | Path, x: np.ndarray) -> list[np.ndarray]:
    """The graph's outputs, quantized operators exact, the rest by onnx.reference (which
    implements (De)QuantizeLinear from opset 19 on: the graph's ops mean the same there)."""
    model = onnx.load(str(model_path))
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, 19)
    evaluator = ReferenceEvaluator(model, new_ops=[QLinearConv, QGemm])
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
    return qgemm(
        *inputs,
        trans_a=attrs.get("transA", 0),
        trans_b=attrs.get("transB", 0),
        alpha=attrs.get("alpha", 1.0),
    )


def node_differences(model_path: str | Path, x: np.ndarray) -> dict[str, dict[str, float]]:
    """For each quantized node: onnxruntime's output (on this CPU, the graph as saved, no
    further optimization) against the exact integers computed from onnxruntime's own inputs
    to that node: the largest difference in quantization steps and the share of outputs that
    differ at all."""
    model = onnx.load(str(model_path))
    init = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    quantized = [n for n in model.graph.node if n.op_type in QUANTIZED_OPS]
    elem = {i.name: i.data_type for i in model.graph.initializer}
    wanted: dict[str, int] = {}
    for node in quantized:
        # a data input's type is its zero point's; the output's is the output zero point's
        wanted[node.input[0]] = elem[node.input[2]]
        if node.op_type == "QGemm" and len(node.input) > 8 and node.input[8]:
            wanted[node.output[0]] = elem[node.input[8]]
        elif node.op_type == "QLinearConv":
            wanted[node.output[0]] = elem[node.input[7]]
        else:
            wanted[node.output[0]] = onnx.TensorProto.FLOAT
    present = {o.name for o in model.graph.output}
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
    values = dict(zip(names, session.run(None, {session.get_inputs()[0].name: x}), strict=True))
    values.update(init)
    report = {}
    for node in quantized:
        inputs = [values[name] if name else None for name in node.input]
        exact = _exact_node(node, inputs).astype(np.float64)
        got = values[node.output[0]].astype(np.float64)
        diff = np.abs(got - exact)
        report[node.name] = {
            "max_steps": float(diff.max()),
            "share_differing": float(np.mean(diff > 0)),
            "outputs": int(diff.size),
        }
    return report
