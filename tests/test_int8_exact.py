"""The int8 encoder computes the same integers on every CPU: onnxruntime's output on the CPU the
suite runs on equals an exact-integer recomputation (tests/helpers/int8_reference.py), and the
exporter's 7-bit weights keep every pair of uint8 x int8 products inside int16, so AVX2's
saturating pair-add (emulated here) cannot change them."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from edge_runtime.encoder import optimize_encoder
from edge_runtime.preprocess import prepare_input
from export.errors import ExportError
from export.onnx_export import export_onnx
from export.quantize import INT16_MAX, check_pair_sums, int8_weights, pair_sum_bound, quantize_int8
from fed_train.data import load_dataset
from fed_train.models import build_model
from tests.helpers.int8_reference import (
    integer_dot,
    node_differences,
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


def test_every_quantized_node_equals_the_exact_integers_on_this_cpu(encoders, digits):
    """Measured exact (0 steps, 0 outputs differing) on AVX-512 VNNI; the bound left for
    another CPU's float32 requantization is one step on a tiny share of outputs."""
    report = node_differences(encoders["int7"], digits[1])
    assert set(report) == {"/features/features.3/Conv", "/hidden/hidden.1/Gemm"}
    for node, diff in report.items():
        assert diff["max_steps"] <= 1 and diff["share_differing"] <= 1e-3, (node, diff)


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
    assert len(weights) == 2
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
