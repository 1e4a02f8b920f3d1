"""GroupNorm's statistics from the quantized integers, so that the int8 encoder of a GroupNorm
model (mobilenet-v2-gn) rounds the same on every CPU.

torch exports GroupNorm as an InstanceNormalization over [N, groups, -1]; in the quantized
graph it reads a DequantizeLinear. onnxruntime's InstanceNormalization sums its float inputs in
the order of the CPU's vector width: x86 and ARM came out 1 ulp apart on about 40% of its
outputs, and the QuantizeLinear after it then rounded some the other way (the embedding moved
on 8 of 200 inputs under emulated ARM). Here each such node is rewritten from the integers the
DequantizeLinear reads: d = q - zero point, the group's sums of d and d*d (exact in any
order), the mean and the variance from them (the variance's numerator n*S2 - S1^2 in int64,
exact), then (d - mean) / sqrt(var + epsilon / scale^2) * gamma + beta, elementwise, each one
IEEE rounding: the same value as InstanceNormalization's up to float rounding, and the same on
every CPU.

The group's size n is a constant (the encoder's input size is fixed; a Reshape to [N, groups,
n] states it in the graph), so the sums over the group run in int32 where they provably fit
(n * 255^2 <= 2^31 - 1: n <= 33,025; MobileNet-v2-gn's largest group at 32x32 is 9,216), in
int64 past that: int64 sums made the encoder 4x slower than the form before.
`check_integer_sums` proves from the graph that no integer the statistics compute, partial sums
included, leaves its type. gamma and beta are constants (torch gives InstanceNormalization ones
and zeros, which the quantizer routes through a QuantizeLinear and a DequantizeLinear, and
applies GroupNorm's own affine after it), evaluated here by their ONNX definitions; a product
with exactly 1 and a sum with exactly 0 are left out.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from export.errors import ExportError

UINT8_MAX = 255
INTEGER_RANGES = {
    TensorProto.INT32: (-(2**31), 2**31 - 1),
    TensorProto.INT64: (-(2**63), 2**63 - 1),
}
_EIGHT_BITS = {TensorProto.UINT8: (0, 255), TensorProto.INT8: (-128, 127)}


def integer_group_norms(model: onnx.ModelProto) -> int:
    """Rewrite, in place, every InstanceNormalization that reads a per-tensor DequantizeLinear
    over a group of static size with constant gamma and beta (see the module docstring), and
    drop the DequantizeLinear it read if nothing else does. Returns how many were rewritten;
    one left as it was is refused by `export.quantize.check_integer_path`."""
    shapes = _inferred(model)
    producers = {out: node for node in model.graph.node for out in node.output}
    initializers = {i.name: i for i in model.graph.initializer}
    nodes: list[onnx.NodeProto] = []
    rewritten = 0
    for node in model.graph.node:
        rewrite = (
            _from_integers(node, producers, initializers, shapes, model)
            if node.op_type == "InstanceNormalization"
            else None
        )
        nodes.extend(rewrite or [node])
        rewritten += rewrite is not None
    del model.graph.node[:]
    model.graph.node.extend(_read(nodes, model))
    return rewritten


def _inferred(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every tensor's inferred type and shape, by name (constant shapes propagated)."""
    inferred = shape_inference.infer_shapes(model, data_prop=True).graph
    values = [*inferred.value_info, *inferred.input, *inferred.output]
    return {v.name: v.type for v in values}


def _read(nodes: list[onnx.NodeProto], model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """`nodes` less the DequantizeLinear nodes nothing reads any more."""
    read = {name for node in nodes for name in node.input} | {o.name for o in model.graph.output}
    return [n for n in nodes if n.op_type != "DequantizeLinear" or n.output[0] in read]


def _constant(name: str, producers: dict, initializers: dict) -> np.ndarray | None:
    """The value of `name` where it is an initializer, a Constant, or a QuantizeLinear or
    DequantizeLinear (per tensor) of constants, computed as ONNX defines them; else None."""
    if name in initializers:
        return numpy_helper.to_array(initializers[name])
    node = producers.get(name)
    if node is not None and node.op_type == "Constant":
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        return None if value is None else numpy_helper.to_array(value)
    if node is None or node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
        return None
    if len(node.input) < 3 or any(a.name == "axis" for a in node.attribute):
        return None
    x, scale, zero_point = (_constant(i, producers, initializers) for i in node.input)
    if x is None or scale is None or zero_point is None or scale.size != 1:
        return None
    scale = np.float32(scale.reshape(()))
    if node.op_type == "DequantizeLinear":
        return (x.astype(np.int32) - zero_point.astype(np.int32)).astype(np.float32) * scale
    limits = np.iinfo(zero_point.dtype)
    rounded = np.rint(x.astype(np.float32) / scale).astype(np.float64) + zero_point
    return np.clip(rounded, limits.min, limits.max).astype(zero_point.dtype)


def _group_shape(type_proto: onnx.TypeProto | None) -> tuple[int, int] | None:
    """(groups, group size) of a [N, groups, n] tensor whose last two sizes are static."""
    if type_proto is None or not type_proto.HasField("tensor_type"):
        return None
    dims = type_proto.tensor_type.shape.dim
    if len(dims) != 3 or not all(d.HasField("dim_value") for d in dims[1:]):
        return None
    return dims[1].dim_value, dims[2].dim_value


def _from_integers(
    norm: onnx.NodeProto, producers: dict, initializers: dict, shapes: dict, model: onnx.ModelProto
) -> list[onnx.NodeProto] | None:
    """The nodes computing `norm`'s output from its DequantizeLinear's integers, or None
    where it does not read one per tensor, or its group size or gamma and beta are unknown."""
    dequantize = producers.get(norm.input[0])
    if dequantize is None or dequantize.op_type != "DequantizeLinear":
        return None
    if len(dequantize.input) < 3 or not dequantize.input[2]:
        return None
    scale = _constant(dequantize.input[1], producers, initializers)
    zero_point = _constant(dequantize.input[2], producers, initializers)
    gamma, beta = (_constant(name, producers, initializers) for name in norm.input[1:])
    group = _group_shape(shapes.get(norm.input[0]))
    if any(v is None for v in (scale, zero_point, gamma, beta, group)) or scale.size != 1:
        return None
    groups, n = group
    fits = n * UINT8_MAX**2 <= INTEGER_RANGES[TensorProto.INT32][1]
    sums = TensorProto.INT32 if fits else TensorProto.INT64
    epsilon = next((a.f for a in norm.attribute if a.name == "epsilon"), 1e-5)
    p = f"{norm.name or norm.output[0]}/integer_norm"
    constants = {
        "zp": np.array(int(zero_point), helper.tensor_dtype_to_np_dtype(sums)),
        "axes": np.array([-1], np.int64),
        "n": np.array(n, np.int64),
        "n_f": np.array(n, np.float32),
        "nn_f": np.array(n * n, np.float32),
        # epsilon on the integers' scale: var(d) * scale^2 + epsilon = scale^2 (var(d) + this)
        "epsilon": np.array(np.float32(epsilon) / np.float32(scale.reshape(())) ** 2, np.float32),
        "gamma": np.asarray(gamma, np.float32).reshape(groups, 1),
        "beta": np.asarray(beta, np.float32).reshape(groups, 1),
    }
    model.graph.initializer.extend(
        numpy_helper.from_array(value, f"{p}/{name}") for name, value in constants.items()
    )
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    wide = fits  # int32 sums: the scalars' arithmetic in int64
    steps: list[tuple[str, list[str], str, dict]] = [
        ("Cast", ["source"], "q", {"to": sums}),
        ("Sub", ["q", "zp"], "d", {}),
        ("ReduceSum", ["d", "axes"], "s1", {"keepdims": 1}),
        ("Mul", ["d", "d"], "dd", {}),
        ("ReduceSum", ["dd", "axes"], "s2", {"keepdims": 1}),
        *(
            [("Cast", ["s1"], "s1_64", {"to": i64}), ("Cast", ["s2"], "s2_64", {"to": i64})]
            if wide
            else []
        ),
        ("Mul", ["n", "s2_64" if wide else "s2"], "ns2", {}),
        ("Mul", ["s1_64" if wide else "s1"] * 2, "s1s1", {}),
        ("Sub", ["ns2", "s1s1"], "numerator", {}),  # n^2 var(d), exact
        ("Cast", ["numerator"], "numerator_f", {"to": f}),
        ("Div", ["numerator_f", "nn_f"], "var", {}),
        ("Add", ["var", "epsilon"], "var_eps", {}),
        ("Sqrt", ["var_eps"], "std", {}),
        ("Cast", ["s1"], "s1_f", {"to": f}),
        ("Div", ["s1_f", "n_f"], "mean", {}),
        ("Cast", ["d"], "d_f", {"to": f}),
        ("Sub", ["d_f", "mean"], "centred", {}),
        ("Div", ["centred", "std"], "normed", {}),
        *([("Mul", ["normed", "gamma"], "scaled", {})] if np.any(gamma != 1) else []),
        *([("Add", [None, "beta"], "shifted", {})] if np.any(beta != 0) else []),
    ]
    return list(_chain(steps, p, dequantize.input[0], norm.output[0]))


def _chain(
    steps: list[tuple[str, list[str | None], str, dict]], p: str, source: str, output: str
) -> Iterable[onnx.NodeProto]:
    """The steps as nodes named under `p`: an input None is the previous step's output,
    "source" is `source`, the last step writes `output`."""
    previous = None
    for index, (op, inputs, name, attrs) in enumerate(steps):
        names = [previous if x is None else source if x == "source" else f"{p}/{x}" for x in inputs]
        out = output if index == len(steps) - 1 else f"{p}/{name}"
        yield helper.make_node(op, names, [out], name=f"{p}/{name}", **attrs)
        previous = out


def check_integer_sums(model: onnx.ModelProto) -> None:
    """Raise unless every integer the graph computes from quantized values (a Cast of an 8-bit
    tensor to int32 or int64, then Sub, Mul, ReduceSum and Casts between integer types) stays
    inside its type: value ranges carried node by node, a ReduceSum over n elements giving n
    times its terms' range widened to 0, where every partial sum lies whatever order a kernel
    adds in. A sum over a size the graph does not state, or an input without a range, is
    refused. Run on the graph as the quantizer and export.integer_norm write it (its types
    are inferred from standard operators)."""
    shapes = _inferred(model)
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    ranges: dict[str, tuple[int, int]] = {}
    for node in model.graph.node:
        kind = _elem_type(shapes.get(node.output[0]))
        if kind not in INTEGER_RANGES:
            continue
        if node.op_type == "Cast" and _elem_type(shapes.get(node.input[0])) in _EIGHT_BITS:
            ranges[node.output[0]] = _EIGHT_BITS[_elem_type(shapes.get(node.input[0]))]
            continue
        if not any(name in ranges for name in node.input):
            continue  # not computed from quantized values (shape arithmetic)
        reach = _range(node, ranges, constants, shapes)
        low, high = INTEGER_RANGES[kind]
        if reach is None:
            raise ExportError(
                f"{node.op_type} {node.name} computes integers from quantized values that the "
                "exporter cannot bound"
            )
        if reach[0] < low or reach[1] > high:
            raise ExportError(
                f"{node.op_type} {node.name} can reach {reach[0] if reach[0] < low else reach[1]}"
                f", past {TensorProto.DataType.Name(kind).lower()}'s range: its sums would wrap"
            )
        ranges[node.output[0]] = reach


def _elem_type(type_proto: onnx.TypeProto | None) -> int | None:
    if type_proto is None or not type_proto.HasField("tensor_type"):
        return None
    return type_proto.tensor_type.elem_type


def _range(
    node: onnx.NodeProto, ranges: dict, constants: dict, shapes: dict
) -> tuple[int, int] | None:
    """The range of `node`'s integer output from its inputs' ranges, or None."""

    def of(name: str) -> tuple[int, int] | None:
        if name in ranges:
            return ranges[name]
        if name in constants and constants[name].size:
            return int(constants[name].min()), int(constants[name].max())
        return None

    if node.op_type == "Cast":
        return of(node.input[0])
    if node.op_type in ("Sub", "Mul"):
        a, b = of(node.input[0]), of(node.input[1])
        if a is None or b is None:
            return None
        if node.op_type == "Sub":
            return a[0] - b[1], a[1] - b[0]
        if node.input[0] == node.input[1]:  # a square
            low = 0 if a[0] <= 0 <= a[1] else min(a[0] ** 2, a[1] ** 2)
            return low, max(a[0] ** 2, a[1] ** 2)
        products = [x * y for x in a for y in b]
        return min(products), max(products)
    if node.op_type == "ReduceSum":
        terms, count = of(node.input[0]), _reduced_count(node, constants, shapes)
        if terms is None or count is None:
            return None
        return count * min(terms[0], 0), count * max(terms[1], 0)
    return None


def _reduced_count(node: onnx.NodeProto, constants: dict, shapes: dict) -> int | None:
    """How many elements one output of a ReduceSum adds, where the graph states it."""
    type_proto = shapes.get(node.input[0])
    if type_proto is None or len(node.input) < 2 or node.input[1] not in constants:
        return None
    dims = type_proto.tensor_type.shape.dim
    count = 1
    for axis in constants[node.input[1]].reshape(-1):
        dim = dims[int(axis) % len(dims)] if -len(dims) <= axis < len(dims) else None
        if dim is None or not dim.HasField("dim_value"):
            return None
        count *= dim.dim_value
    return count
