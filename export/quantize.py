"""int8 static quantization of the ONNX encoder (onnxruntime, QDQ), calibrated on server-side
training data, with the classifier head kept in float.

The encoder computes the same integers on every CPU (x86 with or without VNNI, ARM with or
without the dot-product instructions, WebAssembly), because nothing in it depends on a kernel:
- Weights are quantized to 7 bits ([-64, 64], onnxruntime's `reduce_range`): onnxruntime's
  uint8 x int8 kernels on AVX2 without VNNI add pairs of products in 16 bits and saturate
  (255 * (127 + 127) > 32767), while VNNI, AMX, ARM and WebAssembly add in 32 bits. With 7-bit
  weights a pair is at most 255 * (64 + 64) = 32640, so no sum saturates anywhere.
- The first layer is quantized too: kept in float (as before), its convolution summed in
  another order on x86 (NCHWc) than on ARM, 1 ulp apart, and the QuantizeLinear after it rounded
  a value the other way (MobileNet-v2-gn: its embedding moved on 63 of 200 inputs under emulated
  ARM). Quantized, the input's QuantizeLinear divides and rounds one value at a time: the same
  everywhere.
- GroupNorm's statistics (an InstanceNormalization, summed in float in the CPU's vector order)
  are computed from the quantized integers, exactly (export/integer_norm.py), in int32 where
  `check_integer_sums` proves every partial sum fits.
- A quantized Add is written as a float Sum between its DequantizeLinear and QuantizeLinear
  nodes: onnxruntime fuses an Add there into QLinearAdd, which computes in float32 on x86 and in
  fixed point on ARM and differs by one step on about 1 output in 10^4; a float sum of two
  dequantized values is one IEEE rounding, and no onnxruntime level fuses a Sum.
`check_integer_path` proves each of these from every encoder written (it refuses an
InstanceNormalization that reads quantized values too).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_static,
)

from export.errors import ExportError
from export.integer_norm import check_integer_sums, integer_group_norms
from export.onnx_export import INPUT_NAME, OUTPUT_NAMES
from fed_train.algorithms.base import ClientData

log = logging.getLogger(__name__)

QUANTIZE_MODES = ("int8", "fp32")
DEFAULT_CALIBRATION_SAMPLES = 256
# weight scheme -> (onnxruntime weight type, reduce_range). "int7" is the one the exporter
# writes; the others are kept to measure it against (benchmarks/int8_scheme.py): "int8" is the
# scheme that saturates on AVX2, "uint8" is exact too (uint8 x uint8 kernels widen to 16 bits).
WEIGHT_SCHEMES = {
    "int7": (QuantType.QInt8, True),
    "uint8": (QuantType.QUInt8, False),
    "int8": (QuantType.QInt8, False),
}
# The largest sum a 16-bit lane holds, and the largest uint8 activation a pair multiplies.
INT16_MAX, UINT8_MAX = 32767, 255
_WEIGHT_READERS = {"Conv", "Gemm", "MatMul", "QLinearConv", "QGemm", "QLinearMatMul"}


class ArrayCalibrationReader(CalibrationDataReader):
    """Feeds a fixed array of prepared inputs to the calibrator in batches."""

    def __init__(self, x: np.ndarray, batch_size: int = 64) -> None:
        self.x = np.ascontiguousarray(x)
        self.batch_size = batch_size
        self.rewind()

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)

    def rewind(self) -> None:
        starts = range(0, len(self.x), self.batch_size)
        self._batches = ({INPUT_NAME: self.x[s : s + self.batch_size]} for s in starts)


def calibration_inputs(
    clients: Sequence[ClientData], n: int = DEFAULT_CALIBRATION_SAMPLES, seed: int = 0
) -> np.ndarray:
    """A seeded sample of `n` prepared inputs from the train splits of the clients that took part
    in training: data the server saw anyway. Never a test split, never an unseen client's data,
    so no number reported later was tuned on what it is measured on."""
    pools = [c.x_train.cpu().numpy() for c in clients if not c.unseen and c.num_train > 0]
    if not pools:
        raise ExportError("no training client has training samples to calibrate the int8 encoder")
    pool = np.concatenate(pools)
    rng = np.random.default_rng(seed)
    take = rng.choice(len(pool), size=min(n, len(pool)), replace=False)
    return pool[np.sort(take)]


def head_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the nodes between the "embedding" output and the "logits" output: the classifier
    head. Static int8 saturates logits outside the calibrated range, so these stay float."""
    producers = {out: node for node in model.graph.node for out in node.output}
    embedding, logits = OUTPUT_NAMES
    head: list[str] = []
    stack, seen = [logits], set()
    while stack:
        tensor = stack.pop()
        node = producers.get(tensor)
        if tensor == embedding or node is None or node.name in seen:
            continue
        seen.add(node.name)
        head.append(node.name)
        stack.extend(node.input)
    # Anything reached that is not downstream of the embedding belongs to the body (a model
    # whose head does not read the embedding would otherwise stay entirely float).
    downstream = _downstream_of(model, embedding)
    return [name for name in head if name in downstream]


def _downstream_of(model: onnx.ModelProto, tensor: str) -> set[str]:
    reached, names = {tensor}, set()
    for node in model.graph.node:  # ONNX graphs are topologically sorted
        if reached.intersection(node.input):
            names.add(node.name)
            reached.update(node.output)
    return names


def input_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the nodes that read the graph input directly (the first layer)."""
    return [node.name for node in model.graph.node if INPUT_NAME in node.input]


def float_nodes(model: onnx.ModelProto, *, first_layer: bool = False) -> list[str]:
    """The nodes kept in float: the classifier head (int8 saturated logits outside the
    calibrated range), and with `first_layer` the nodes reading the input, as the exporter
    kept them before its integers had to be the same on every CPU (benchmarks/int8_form.py
    measures both)."""
    return list(dict.fromkeys((input_nodes(model) if first_layer else []) + head_nodes(model)))


def sum_for_quantized_adds(model: onnx.ModelProto) -> int:
    """Turn every Add whose inputs are both dequantized values into a Sum (the same result, one
    IEEE rounding), so that onnxruntime does not fuse it into QLinearAdd, whose integers
    depend on the CPU's kernel. Returns how many were turned."""
    dequantized = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    turned = 0
    for node in model.graph.node:
        if node.op_type == "Add" and all(name in dequantized for name in node.input):
            node.op_type = "Sum"
            turned += 1
    return turned


def shapes_from_integers(model: onnx.ModelProto) -> int:
    """Point every Shape that reads a DequantizeLinear's output at that node's integer input
    (the same shape): onnxruntime would otherwise dequantize a whole tensor to read its shape
    (GroupNorm's Reshape back to [N, C, H, W], once per norm). Returns how many were moved."""
    dequantized = {
        n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear"
    }
    moved = 0
    for node in model.graph.node:
        if node.op_type == "Shape" and node.input[0] in dequantized:
            node.input[0] = dequantized[node.input[0]]
            moved += 1
    return moved


class _DropQuantizerNoise(logging.Filter):
    """Messages onnxruntime's quantizer logs on the root logger that say nothing about our
    graphs: advice to run its shape-inference preprocessing (torch already inferred the
    shapes), and "Expected bias ... to be an initializer" for every GroupNorm, whose
    InstanceNormalization bias torch writes as a Constant node (it stays float, and
    export.integer_norm folds it): one line per norm, 52 for mobilenet-v2-gn."""

    NOISE = ("pre-processing before quantization", "run pre-processing", "Expected bias ")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.NOISE)


def int8_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The int8 weight tensors of the quantized matrix products (Conv, Gemm, MatMul, in QDQ form
    or fused), by initializer name, shaped [output channels, ...]. A Gemm with transB=0 stores
    its weight [K, N]; it is transposed here so that rows are output channels."""
    initializers = {i.name: i for i in model.graph.initializer}
    dequantized = {
        n.output[0]: n.input[0]
        for n in model.graph.node
        if n.op_type == "DequantizeLinear" and n.input[0] in initializers
    }
    found: dict[str, np.ndarray] = {}
    for node in model.graph.node:
        if node.op_type not in _WEIGHT_READERS:
            continue
        weight = node.input[3] if node.op_type.startswith("Q") else node.input[1]
        name = dequantized.get(weight, weight)
        if name not in initializers or initializers[name].data_type != onnx.TensorProto.INT8:
            continue
        w = numpy_helper.to_array(initializers[name]).astype(np.int64)
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        if node.op_type in ("Gemm", "QGemm") and not trans_b or "MatMul" in node.op_type:
            w = w.T
        found[name] = w.reshape(len(w), -1)
    return found


def pair_sum_bound(weights: np.ndarray) -> int:
    """The largest sum of two uint8 x int8 products a kernel can add in one 16-bit lane for
    these weights [output channels, K]: 255 times the two largest |w| of any output channel,
    whichever two of its K weights a kernel pairs."""
    top2 = -np.sort(-np.abs(weights), axis=1)[:, :2]
    return int(UINT8_MAX * top2.sum(axis=1).max())


def check_integer_path(model: onnx.ModelProto) -> None:
    """Raise unless the encoder's integers are defined the same on every CPU: no pair of
    uint8 x int8 products can leave int16 (`check_pair_sums`), no integer sum of GroupNorm's
    statistics can leave its type (`check_integer_sums`), the graph input is quantized by
    the first node that reads it (a float layer before the first QuantizeLinear would round by
    its kernel's summation order), and no Add or QLinearAdd sums quantized values (onnxruntime
    fuses one into QLinearAdd, which rounds by kernel)."""
    check_pair_sums(model)
    check_integer_sums(model)
    readers = [node for node in model.graph.node if INPUT_NAME in node.input]
    if [node.op_type for node in readers] != ["QuantizeLinear"]:
        raise ExportError(
            "the encoder's input is read by "
            f"{', '.join(f'{n.op_type} {n.name}' for n in readers)}, not quantized first: a "
            "float first layer rounds differently on other CPUs"
        )
    dequantized = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    for node in model.graph.node:
        if node.op_type == "InstanceNormalization" and node.input[0] in dequantized:
            raise ExportError(
                f"InstanceNormalization {node.name} sums dequantized values in float, in an "
                "order that depends on the CPU (compute it from the integers: "
                "export.integer_norm)"
            )
        if node.op_type == "QLinearAdd" or (
            node.op_type == "Add" and all(name in dequantized for name in node.input)
        ):
            raise ExportError(
                f"{node.op_type} {node.name} adds quantized values: onnxruntime's QLinearAdd "
                "rounds differently on x86 and ARM (write it as a float Sum)"
            )


def check_pair_sums(model: onnx.ModelProto) -> None:
    """Raise unless no pair of uint8 x int8 products in the encoder can leave the int16 range,
    so its integers are the same on every CPU whatever its kernels' accumulator width."""
    for name, w in int8_weights(model).items():
        bound = pair_sum_bound(w)
        if bound > INT16_MAX:
            raise ExportError(
                f"int8 weights {name} can sum a pair of products to {bound}, past "
                f"{INT16_MAX}: AVX2 kernels would saturate (quantize with 7-bit "
                "weights)"
            )


def quantize_int8(
    fp32_path: str | Path,
    out_path: str | Path,
    calibration: np.ndarray,
    *,
    keep_float: bool = True,
    weights: str = "int7",
    previous_form: bool = False,
) -> Path:
    """Static QDQ quantization: uint8 activations, per-channel weights in `weights`'s scheme
    (see WEIGHT_SCHEMES; int8 activations ran about 1.4x slower). With `keep_float`, the
    classifier head stays float (see `float_nodes`). The encoder is checked by
    `check_integer_path`; one in the form written before (`previous_form`: a float first
    layer, QLinearAdd, GroupNorm's float statistics; benchmarks/int8_form.py measures both) by
    `check_pair_sums` alone; one with the "int8" scheme, which saturates, not at all."""
    fp32_path, out_path = Path(fp32_path), Path(out_path)
    if weights not in WEIGHT_SCHEMES:
        raise ValueError(f"weights must be one of {sorted(WEIGHT_SCHEMES)}, got {weights!r}")
    weight_type, reduce_range = WEIGHT_SCHEMES[weights]
    if len(calibration) == 0:
        raise ExportError("int8 quantization needs at least one calibration sample")
    model = onnx.load(fp32_path)
    for i, node in enumerate(model.graph.node):
        if not node.name:  # nodes_to_exclude works by name; give every node one
            node.name = f"node_{i}"
    exclude = float_nodes(model, first_layer=previous_form) if keep_float else []
    out_path.parent.mkdir(parents=True, exist_ok=True)
    noise = _DropQuantizerNoise()
    with tempfile.TemporaryDirectory(prefix="knnper-quant-") as tmp:
        src = Path(tmp) / "fp32.onnx"
        onnx.save(model, src)
        logging.getLogger().addFilter(noise)
        try:
            quantize_static(
                str(src),
                str(out_path),
                ArrayCalibrationReader(calibration),
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                activation_type=QuantType.QUInt8,
                weight_type=weight_type,
                reduce_range=reduce_range,
                calibrate_method=CalibrationMethod.MinMax,
                nodes_to_exclude=exclude,
            )
        except Exception as err:  # onnxruntime raises several types
            raise ExportError(f"int8 quantization failed: {err}") from err
        finally:
            logging.getLogger().removeFilter(noise)
    quantized = onnx.load(out_path)
    if not previous_form:
        integer_group_norms(quantized)
        sum_for_quantized_adds(quantized)
        shapes_from_integers(quantized)
        onnx.save(quantized, out_path)
    if weights != "int8":
        (check_pair_sums if previous_form else check_integer_path)(quantized)
    log.info(
        "quantized %s -> %s (%d -> %d bytes, kept float: %s)",
        fp32_path.name,
        out_path.name,
        fp32_path.stat().st_size,
        out_path.stat().st_size,
        exclude,
    )
    return out_path
