"""torch -> ONNX export and int8 quantization of the encoder."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from export.errors import ExportError
from export.onnx_export import compare_with_torch, export_onnx, run_onnx
from export.quantize import calibration_inputs, float_nodes, quantize_int8
from fed_train.algorithms.base import ClientData
from fed_train.models import build_model

DIGITS_SPEC = {"kind": "image", "shape": [8, 8, 1], "dtype": "uint8", "mean": [0.3], "std": [0.4]}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("small-cnn", 10, DIGITS_SPEC).eval()


@pytest.fixture(scope="module")
def inputs():
    return np.random.default_rng(0).normal(size=(64, 1, 8, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def fp32_file(model, inputs, tmp_path_factory):
    path = tmp_path_factory.mktemp("onnx") / "encoder.fp32.onnx"
    export_onnx(model, inputs[:16], path)
    return path


def test_onnx_matches_torch_within_1e_4(model, inputs, fp32_file):
    assert compare_with_torch(model, fp32_file, inputs) <= 1e-4


def test_onnx_has_embedding_and_logits_outputs_and_a_dynamic_batch(model, fp32_file):
    proto = onnx.load(fp32_file)
    assert [i.name for i in proto.graph.input] == ["input"]
    assert [o.name for o in proto.graph.output] == ["embedding", "logits"]
    for batch in (1, 7):
        z, logits = run_onnx(fp32_file, np.zeros((batch, 1, 8, 8), np.float32))
        assert z.shape == (batch, model.embedding_dim) and logits.shape == (batch, 10)


def test_token_model_exports_too(tmp_path):
    spec = {"kind": "tokens", "shape": [80], "dtype": "int64", "vocab_size": 20}
    lstm = build_model("char-lstm", 20, spec).eval()
    x = np.random.default_rng(0).integers(0, 20, size=(3, 80))
    assert export_onnx(lstm, x, tmp_path / "lstm.onnx") <= 1e-4


def test_export_refuses_when_onnx_disagrees_with_torch(model, inputs, tmp_path, monkeypatch):
    monkeypatch.setattr("export.onnx_export.compare_with_torch", lambda *a: 0.5)
    with pytest.raises(ExportError, match="differs from torch by 0.5"):
        export_onnx(model, inputs[:4], tmp_path / "bad.onnx")


def test_export_refuses_an_empty_example(model, tmp_path):
    with pytest.raises(ExportError, match="non-empty example"):
        export_onnx(model, np.zeros((0, 1, 8, 8), np.float32), tmp_path / "x.onnx")


def test_int8_is_smaller_and_keeps_the_head_float(fp32_file, inputs, tmp_path):
    int8 = quantize_int8(fp32_file, tmp_path / "encoder.onnx", inputs)
    # The digits CNN is tiny (23k weights, the head float): 92 KB -> 36 KB measured.
    assert fp32_file.stat().st_size / int8.stat().st_size > 2.3
    assert float_nodes(onnx.load(fp32_file)) == ["/classifier/Gemm"]
    before = float_nodes(onnx.load(fp32_file), first_layer=True)  # the form written before
    assert before == ["/features/features.0/Conv", "/classifier/Gemm"]
    quantized = onnx.load(int8)
    assert any(n.op_type == "QuantizeLinear" for n in quantized.graph.node)
    weights = {i.name for i in quantized.graph.initializer}
    assert "model.classifier.weight" in weights  # float, not "..._quantized"
    assert "model.hidden.1.weight_quantized" in weights
    z0, l0 = run_onnx(fp32_file, inputs)
    z1, l1 = run_onnx(int8, inputs)
    cosine = (z0 * z1).sum(1) / (np.linalg.norm(z0, axis=1) * np.linalg.norm(z1, axis=1))
    assert cosine.min() > 0.99
    assert [o.name for o in quantized.graph.output] == ["embedding", "logits"]


def _client(cid: int, value: float, unseen: bool, n: int = 5) -> ClientData:
    def full(v: float) -> torch.Tensor:
        return torch.full((n, 1, 2, 2), v)

    labels = torch.zeros(n, dtype=torch.int64)
    return ClientData(
        cid, full(value), labels, full(value + 0.1), labels, full(value + 0.5), labels, unseen
    )


def test_calibration_uses_only_training_clients_train_splits():
    clients = [_client(0, 1.0, False), _client(1, 2.0, True), _client(2, 3.0, False)]
    x = calibration_inputs(clients, n=100, seed=0)
    assert set(np.unique(x).tolist()) == {1.0, 3.0}  # no val (+.1), test (+.5), unseen (2.0)
    assert len(calibration_inputs(clients, n=4, seed=0)) == 4
    with pytest.raises(ExportError, match="no training client"):
        calibration_inputs([clients[1]], n=10)
