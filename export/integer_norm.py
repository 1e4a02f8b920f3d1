"""GroupNorm's statistics from the quantized integers, so that the int8 encoder of a GroupNorm
model (mobilenet-v2-gn) rounds the same on every CPU.

torch exports GroupNorm as an InstanceNormalization over [N, groups, -1]; in the quantized
graph it reads a DequantizeLinear. onnxruntime's InstanceNormalization sums its float inputs in
the order of the CPU's vector width: x86 and ARM came out 1 ulp apart on about 40% of its
outputs, and the QuantizeLinear after it then rounded some the other way (the embedding moved
on 8 of 200 inputs under emulated ARM). Here each such node is rewritten from the integers the
DequantizeLinear reads: d = q - zero point (int64), the group's sums of d and d*d (exact in any
order), the mean and the variance from them (the variance's numerator n*S2 - S1^2 exact), then
(d - mean) / sqrt(var + epsilon / scale^2) * gamma + beta, elementwise, each one IEEE rounding:
the same value as InstanceNormalization's up to float rounding, and the same on every CPU.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def integer_group_norms(model: onnx.ModelProto) -> int:
    """Rewrite, in place, every InstanceNormalization that reads a per-tensor DequantizeLinear
    (see the module docstring). Returns how many were rewritten."""
    producers = {out: node for node in model.graph.node for out in node.output}
    initializers = {i.name: i for i in model.graph.initializer}
    nodes: list[onnx.NodeProto] = []
    rewritten = 0
    for node in model.graph.node:
        source = producers.get(node.input[0]) if node.op_type == "InstanceNormalization" else None
        scale = _scalar(initializers, source.input[1]) if _is_dequantize(source) else None
        if scale is None or len(source.input) < 3 or not source.input[2]:
            nodes.append(node)
            continue
        epsilon = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        nodes.extend(_from_integers(node, source, scale, epsilon, model))
        rewritten += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return rewritten


def _is_dequantize(node: onnx.NodeProto | None) -> bool:
    return node is not None and node.op_type == "DequantizeLinear"


def _scalar(initializers: dict, name: str) -> float | None:
    if name not in initializers:
        return None
    value = numpy_helper.to_array(initializers[name])
    return float(value) if value.size == 1 else None


def _from_integers(
    norm: onnx.NodeProto,
    dequantize: onnx.NodeProto,
    scale: float,
    epsilon: float,
    model: onnx.ModelProto,
) -> list[onnx.NodeProto]:
    """The nodes computing `norm`'s output from `dequantize`'s integers."""
    p = f"{norm.name or norm.output[0]}/integer_norm"
    constants = {
        f"{p}/axes": np.array([-1], np.int64),
        f"{p}/last": np.array(-1, np.int64),
        f"{p}/one": np.array([1], np.int64),
        # epsilon on the integers' scale: var(d) * scale^2 + epsilon = scale^2 (var(d) + this)
        f"{p}/epsilon": np.array(np.float32(epsilon) / np.float32(scale) ** 2, np.float32),
    }
    model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in constants.items())
    q, zero_point = dequantize.input[0], dequantize.input[2]
    _, gamma, beta = norm.input
    f, i = TensorProto.FLOAT, TensorProto.INT64

    def node(op: str, inputs: list[str], name: str, **attrs) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [f"{p}/{name}"], name=f"{p}/{name}", **attrs)

    return [
        node("Cast", [q], "q", to=i),
        node("Cast", [zero_point], "zp", to=i),
        node("Sub", [f"{p}/q", f"{p}/zp"], "d"),
        node("ReduceSum", [f"{p}/d", f"{p}/axes"], "s1", keepdims=1),
        node("Mul", [f"{p}/d", f"{p}/d"], "dd"),
        node("ReduceSum", [f"{p}/dd", f"{p}/axes"], "s2", keepdims=1),
        node("Shape", [f"{p}/d"], "shape"),
        node("Gather", [f"{p}/shape", f"{p}/last"], "n"),
        node("Mul", [f"{p}/n", f"{p}/s2"], "ns2"),
        node("Mul", [f"{p}/s1", f"{p}/s1"], "s1s1"),
        node("Sub", [f"{p}/ns2", f"{p}/s1s1"], "numerator"),  # n^2 var(d), exact
        node("Mul", [f"{p}/n", f"{p}/n"], "nn"),
        node("Cast", [f"{p}/numerator"], "numerator_f", to=f),
        node("Cast", [f"{p}/nn"], "nn_f", to=f),
        node("Div", [f"{p}/numerator_f", f"{p}/nn_f"], "var"),
        node("Cast", [f"{p}/s1"], "s1_f", to=f),
        node("Cast", [f"{p}/n"], "n_f", to=f),
        node("Div", [f"{p}/s1_f", f"{p}/n_f"], "mean"),
        node("Cast", [f"{p}/d"], "d_f", to=f),
        node("Sub", [f"{p}/d_f", f"{p}/mean"], "centred"),
        node("Add", [f"{p}/var", f"{p}/epsilon"], "var_eps"),
        node("Sqrt", [f"{p}/var_eps"], "std"),
        node("Div", [f"{p}/centred", f"{p}/std"], "normed"),
        node("Unsqueeze", [gamma, f"{p}/one"], "gamma"),
        node("Unsqueeze", [beta, f"{p}/one"], "beta"),
        node("Mul", [f"{p}/normed", f"{p}/gamma"], "scaled"),
        helper.make_node("Add", [f"{p}/scaled", f"{p}/beta"], list(norm.output), name=f"{p}/out"),
    ]
