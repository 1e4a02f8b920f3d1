"""The int8 encoder computes the same integers on every CPU: onnxruntime's output on the CPU the
suite runs on equals an exact-integer recomputation of every quantized operator the exporter's
encoders hold (tests/helpers/int8_reference.py; the small CNN's and a small MobileNet-v2-gn's:
depthwise convolutions, QLinearMul, QLinearGlobalAveragePool), the exporter's 7-bit weights keep
every pair of uint8 x int8 products inside int16, so AVX2's saturating pair-add (emulated here)
cannot change them, and nothing float that rounds by kernel comes before a QuantizeLinear
(`check_integer_path`). .ci/arm runs the same encoders on emulated ARM CPUs."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from edge_runtime.encoder import optimize_encoder
from edge_runtime.preprocess import prepare_input
from export.errors import ExportError
from export.integer_norm import check_integer_sums, integer_group_norms
from export.onnx_export import export_onnx
from export.quantize import (
    INT16_MAX,
    check_integer_path,
    check_pair_sums,
    int8_weights,
    pair_sum_bound,
    quantize_int8,
)
from fed_train.data import load_dataset
from fed_train.models import MobileNetV2, build_model
from tests.helpers.int8_reference import (
    integer_dot,
    node_differences,
    qlinear_add,
    qlinear_conv,
    reference_outputs,
)


@pytest.fixture(scope="module")
def digits():
    dataset = load_dataset("digits", seed=0)
    x = prepare_input(dataset.x_test, dataset.input_spec)
    # real test images, then images at the input's extremes (every activation near 255)
    rng = np.random.default_rng(0)
    extremes = rng.choice([x.min(), x.max()], size=(64, *x.shape[1:])).astype(np.float32)
    return dataset, np.concatenate([x[:256], extremes])


@pytest.fixture(scope="module")
def encoders(digits, tmp_path_factory):
    """The encoder as the exporter writes it (7-bit weights, optimized) and the 8-bit one the
    exporter wrote before, from one trained-looking model (seeded random weights)."""
    dataset, x = digits
    torch.manual_seed(0)
    model = build_model("small-cnn", dataset.num_classes, dataset.input_spec).eval()
    root = tmp_path_factory.mktemp("int8")
    fp32 = root / "fp32.onnx"
    export_onnx(model, x[:16], fp32)
    paths = {}
    for scheme in ("int7", "int8"):
        path = quantize_int8(fp32, root / f"{scheme}.onnx", x[:200], weights=scheme)
        path.write_bytes(optimize_encoder(path.read_bytes()))
        paths[scheme] = path
    return paths


class _SmallMobileNet(MobileNetV2):
    """MobileNet-v2's blocks (depthwise convolutions, residual adds) with GroupNorm, two stages:
    the operators of mobilenet-v2-gn's int8 encoder in a second, not a minute."""

    _SETTINGS = ((1, 16, 1, 1), (2, 16, 2, 1))


def test_quantizing_a_groupnorm_logs_no_bias_warnings(tmp_path, caplog):
    """onnxruntime's quantizer warned "Expected bias ... to be an initializer" once per
    GroupNorm (52 lines for mobilenet-v2-gn); the exporter silences that message while it
    quantizes, and only then: the root logger's filters are as before."""
    torch.manual_seed(0)
    model = _SmallMobileNet(10, 3, embedding_dim=32, norm="group").eval()
    x = np.random.default_rng(0).normal(size=(8, 3, 8, 8)).astype(np.float32)
    export_onnx(model, x, tmp_path / "fp32.onnx")
    filters = list(logging.getLogger().filters)
    with caplog.at_level(logging.WARNING):
        quantize_int8(tmp_path / "fp32.onnx", tmp_path / "int8.onnx", x)
    assert not [r for r in caplog.records if "Expected bias" in r.getMessage()]
    assert logging.getLogger().filters == filters
    with caplog.at_level(logging.WARNING):
        logging.getLogger().warning("Expected bias elsewhere")
    assert [r for r in caplog.records if "Expected bias" in r.getMessage()]


@pytest.fixture(scope="module")
def mobilenet(tmp_path_factory):
    torch.manual_seed(0)
    model = _SmallMobileNet(10, 3, embedding_dim=32, norm="group").eval()
    x = np.random.default_rng(0).normal(size=(48, 3, 8, 8)).astype(np.float32)
    x[40:] = np.sign(x[40:]) * 4  # past the calibrated range: saturating activations
    root = tmp_path_factory.mktemp("mobilenet")
    export_onnx(model, x[:8], root / "fp32.onnx")
    path = quantize_int8(root / "fp32.onnx", root / "int8.onnx", x[:32])
    (root / "int8.raw.onnx").write_bytes(path.read_bytes())  # as quantize_int8 wrote it
    path.write_bytes(optimize_encoder(path.read_bytes()))
    return path, x, root


def _assert_exact(report: dict) -> None:
    """Measured exact (0 steps, 0 outputs differing) on AVX-512 VNNI; the bound left for
    another CPU's float32 requantization is one step on a tiny share of outputs."""
    for node, diff in report.items():
        assert diff["max_steps"] <= 1 and diff["share_differing"] <= 1e-3, (node, diff)


def test_every_quantized_node_equals_the_exact_integers_on_this_cpu(encoders, digits):
    report = node_differences(encoders["int7"], digits[1])
    kinds = {diff["op_type"] for diff in report.values()}
    assert kinds == {"QuantizeLinear", "QLinearConv", "QGemm", "DequantizeLinear"}
    assert {"/features/features.0/Conv", "/features/features.3/Conv"} <= set(report)
    _assert_exact(report)


def test_every_operator_of_a_mobilenet_gn_encoder_equals_the_exact_integers(mobilenet):
    """Every node is either checked against its integer definition or has no quantized
    arithmetic (node_differences raises on any other); the depthwise convolutions, GroupNorm's
    affine QLinearMul and the pooling are among the checked."""
    path, x, root = mobilenet
    report = node_differences(path, x)
    kinds = {diff["op_type"] for diff in report.values()}
    assert {"QLinearConv", "QLinearMul", "QLinearGlobalAveragePool", "QuantizeLinear"} <= kinds
    groups = [a.i for n in onnx.load(path).graph.node for a in n.attribute if a.name == "group"]
    assert max(groups) > 1  # depthwise
    _assert_exact(report)
    check_integer_path(onnx.load(root / "int8.raw.onnx"))


def test_groupnorm_sums_run_in_int32_and_leave_nothing_unread(mobilenet):
    """The exact GroupNorm sums in int32 (int64 made mobilenet-v2-gn's encoder 4x slower),
    drops the DequantizeLinear it no longer reads, and a Shape reads the integers rather than
    a whole dequantized tensor."""
    _, _, root = mobilenet
    model = onnx.load(root / "int8.raw.onnx")
    sums = [n for n in model.graph.node if n.op_type == "ReduceSum"]
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True).graph.value_info
    types = {v.name: v.type.tensor_type.elem_type for v in inferred}
    assert sums and {types[n.output[0]] for n in sums} == {onnx.TensorProto.INT32}
    read = {name for n in model.graph.node for name in n.input} | {"embedding", "logits"}
    dequantize = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert all(n.output[0] in read for n in dequantize)
    dequantized = {n.output[0] for n in dequantize}
    assert not [n for n in model.graph.node if n.op_type == "Shape" and n.input[0] in dequantized]
    check_integer_sums(model)


def _sum_of_squares(n: int, size: str | int) -> onnx.ModelProto:
    """int32 (q - 7)^2 summed over the last axis of a uint8 [1, 1, n] input (`size`: its
    stated length, or a name where the graph does not state it)."""
    nodes = [
        onnx.helper.make_node("Cast", ["q"], ["qi"], name="cast", to=onnx.TensorProto.INT32),
        onnx.helper.make_node("Sub", ["qi", "zp"], ["d"], name="d"),
        onnx.helper.make_node("Mul", ["d", "d"], ["dd"], name="dd"),
        onnx.helper.make_node("ReduceSum", ["dd", "axes"], ["s2"], name="s2"),
    ]
    inits = [
        onnx.numpy_helper.from_array(np.array(7, np.int32), "zp"),
        onnx.numpy_helper.from_array(np.array([-1], np.int64), "axes"),
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "g",
        [onnx.helper.make_tensor_value_info("q", onnx.TensorProto.UINT8, [1, 1, size])],
        [onnx.helper.make_tensor_value_info("s2", onnx.TensorProto.INT32, None)],
        inits,
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def test_the_check_proves_int32_sums_or_refuses_them():
    """(q - 7)^2 is at most 248^2 = 61504: 34,916 of them fit int32, 34,917 can wrap; a sum
    over a length the graph does not state cannot be bounded."""
    check_integer_sums(_sum_of_squares(34_916, 34_916))
    with pytest.raises(ExportError, match=r"ReduceSum s2 can reach 2147535168, past int32"):
        check_integer_sums(_sum_of_squares(34_917, 34_917))
    with pytest.raises(ExportError, match="ReduceSum s2 computes integers .* cannot bound"):
        check_integer_sums(_sum_of_squares(10, "n"))


def test_the_check_refuses_what_rounds_by_kernel(mobilenet):
    """The form written before (float first layer, QLinearAdd, GroupNorm's float statistics)
    fails `check_integer_path`, and so does an encoder with one quantized Add put back."""
    _, x, root = mobilenet
    before = quantize_int8(root / "fp32.onnx", root / "before.onnx", x[:32], previous_form=True)
    with pytest.raises(ExportError, match="read by Conv .*, not quantized first"):
        check_integer_path(onnx.load(before))
    model = onnx.load(root / "int8.raw.onnx")
    next(n for n in model.graph.node if n.op_type == "Sum").op_type = "Add"
    model.graph.ClearField("value_info")
    with pytest.raises(ExportError, match="adds quantized values"):
        check_integer_path(model)


def test_qlinear_add_rounds_by_kernel():
    """Why the exporter writes a quantized Add as a float Sum: onnxruntime's QLinearAdd is
    fixed point on ARM (the reference follows it) and float32 on x86, and they part on values
    near a half step: this sum is 169.5001 steps, the fixed point gives 169, x86 gave 170."""
    args = (np.uint8(215), 0.04655174, np.uint8(135), np.uint8(0), 1.0, np.uint8(0))
    real = (215 - 135) * np.float64(np.float32(0.04655174)) / np.float64(np.float32(0.02197131))
    assert 169.5 < real < 169.5002
    assert qlinear_add(*args, np.float32(0.02197131), np.uint8(0)) == 169


def _integer_norm(q, scale, zero_point, gamma, beta, epsilon=1e-5) -> np.ndarray:
    """export.integer_norm's definition in numpy: exact integer statistics, then one float32
    rounding per step."""
    d = q.astype(np.int64) - int(zero_point)
    n = d.shape[-1]
    s1, s2 = d.sum(-1, keepdims=True), (d * d).sum(-1, keepdims=True)
    f = np.float32
    var = (n * s2 - s1 * s1).astype(f) / f(n * n)
    std = np.sqrt(var + f(f(epsilon) / f(scale) ** 2))
    normed = (d.astype(f) - s1.astype(f) / f(n)) / std
    return normed * gamma.reshape(-1, 1) + beta.reshape(-1, 1)


@pytest.mark.parametrize("shape", [(3, 4, 50), (1, 2, 40_000)])
def test_groupnorm_from_the_integers_equals_instance_normalization(shape):
    """export.integer_norm's rewrite computes what InstanceNormalization computes on the
    dequantized values, to float rounding, and exactly its own definition: with int32 sums
    for a small group, int64 past 33,025 elements."""
    rng = np.random.default_rng(0)
    q = rng.integers(0, 256, size=shape, dtype=np.uint8)
    groups, n = shape[1:]
    scale, zero_point = np.float32(0.037), np.uint8(119)
    gamma = rng.normal(size=groups).astype(np.float32)
    beta = rng.normal(size=groups).astype(np.float32)
    inits = [
        onnx.numpy_helper.from_array(np.asarray(v), name)
        for name, v in (("s", scale), ("z", zero_point), ("g", gamma), ("b", beta))
    ]
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("DequantizeLinear", ["q", "s", "z"], ["x"], name="dq"),
            onnx.helper.make_node(
                "InstanceNormalization", ["x", "g", "b"], ["y"], name="norm", epsilon=1e-5
            ),
        ],
        "g",
        [onnx.helper.make_tensor_value_info("q", onnx.TensorProto.UINT8, [None, groups, n])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        inits,
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])

    def run(m: onnx.ModelProto) -> np.ndarray:
        session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, {"q": q})[0]

    expected = run(model)
    assert integer_group_norms(model) == 1
    assert "InstanceNormalization" not in {n.op_type for n in model.graph.node}
    wide = next(n for n in model.graph.node if n.op_type == "Cast").attribute[0].i
    assert wide == (onnx.TensorProto.INT32 if n <= 33_025 else onnx.TensorProto.INT64)
    check_integer_sums(model)
    got = run(model)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(got, _integer_norm(q, scale, zero_point, gamma, beta))


def test_the_whole_encoder_equals_the_exact_reference(encoders, digits):
    x = digits[1]
    session = ort.InferenceSession(str(encoders["int7"]), providers=["CPUExecutionProvider"])
    z, logits = session.run(["embedding", "logits"], {"input": x})
    z_ref, logits_ref = reference_outputs(encoders["int7"], x)
    step = float(
        onnx.numpy_helper.to_array(
            next(
                i
                for i in onnx.load(encoders["int7"]).graph.initializer
                if i.name == "embedding_scale"
            )
        )
    )
    assert np.abs(z - z_ref).max() <= step * 1.001  # measured 0 on AVX-512 VNNI
    assert np.mean(np.abs(z - z_ref) > 0) <= 1e-3
    assert np.abs(logits - logits_ref).max() < 1e-4


def test_exported_weights_keep_every_pair_sum_in_int16(encoders):
    weights = int8_weights(onnx.load(encoders["int7"]))
    assert len(weights) == 3
    assert max(map(pair_sum_bound, weights.values())) == 255 * 128 <= INT16_MAX
    check_pair_sums(onnx.load(encoders["int7"]))


def test_the_check_refuses_8_bit_weights(encoders):
    with pytest.raises(ExportError, match=r"pair of products to 64770, past 32767"):
        check_pair_sums(onnx.load(encoders["int8"]))


def _worst_inputs(w: np.ndarray) -> np.ndarray:
    """For each output channel, the uint8 input that adds its positive weights at 255: the
    largest pair sums those weights allow."""
    return np.where(w > 0, 255, 0).astype(np.uint8)


@pytest.mark.parametrize("scheme, saturates", [("int7", False), ("int8", True)])
def test_an_avx2_pair_add_changes_only_8_bit_sums(encoders, scheme, saturates):
    """Emulating vpmaddubsw (pairs of products added in int16, saturated) on the encoder's own
    weights, fed the inputs that push its pair sums highest."""
    for w in int8_weights(onnx.load(encoders[scheme])).values():
        a = _worst_inputs(w)
        exact = integer_dot(a, 0, w, np.zeros(len(w)))
        avx2 = integer_dot(a, 0, w, np.zeros(len(w)), saturate_pairs=True)
        assert np.any(exact != avx2) == saturates


def test_the_comparison_fails_on_a_saturating_kernel():
    """The reference's comparison can fail: a convolution whose pairs of 127 weights meet 255
    inputs comes out of a saturating kernel several quantization steps off."""
    w = np.full((2, 1, 3, 3), 127, np.int8)
    x = np.full((1, 1, 4, 4), 255, np.uint8)
    args = (
        x,
        0.01,
        np.uint8(0),
        w,
        np.full(2, 0.01, np.float32),
        np.zeros(2, np.int8),
        1.0,
        np.uint8(0),
    )
    exact = qlinear_conv(*args, pads=[1, 1, 1, 1])
    avx2 = qlinear_conv(*args, pads=[1, 1, 1, 1], saturate_pairs=True)
    assert np.abs(exact.astype(int) - avx2.astype(int)).max() > 1
