"""The GPU against the CPU, within stated tolerances: `pytest -m gpu tests/test_gpu.py` on a
machine with CUDA (skipped without one; the rest of the suite hides GPUs, see conftest.py).

Tolerances, and why: one FedAvg round in fp32 differs from the CPU only in summation order
(cuDNN's algorithms; TF32 is switched off here): 1e-4 absolute on any weight. Clients stepped
together on the GPU take the same mini-batches as one after another on the CPU: the same 1e-4.
pFedGP's posterior is computed in float64: 1e-8. bf16 autocast rounds the forward pass: its
training loss within 5e-2 of fp32's on the CPU. Export reads a CPU copy of the model, so the
ONNX encoder of a model on the GPU is the CPU's byte for byte."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from export.onnx_export import export_onnx
from fed_train.algorithms import build_algorithm
from fed_train.algorithms.base import ClientData, TrainingConfig, Weights, get_weights
from fed_train.algorithms.pfedgp import gp_posterior
from fed_train.models import build_model
from fed_train.simulation import simulate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device (GPUs are hidden unless -m gpu)"
    ),
]

SPEC = {"kind": "image", "shape": [32, 32, 3]}
CLASSES = 10
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def no_tf32() -> Iterator[None]:
    """TF32 products keep 10 mantissa bits: not the comparison the tolerances state."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def clients(device: torch.device, count: int = 4) -> list[ClientData]:
    """Unequal sizes, so stepped lanes end at different steps."""
    rng = np.random.default_rng(0)
    out = []
    for cid in range(count):
        n = 40 + 8 * cid
        x = torch.from_numpy(rng.normal(size=(n, 3, 32, 32)).astype(np.float32))
        y = torch.from_numpy(rng.integers(0, CLASSES, n))
        out.append(ClientData(cid, x, y, x[:4], y[:4], x[:4], y[:4]).to(device))
    return out


def training(precision: str = "fp32") -> TrainingConfig:
    return TrainingConfig(
        rounds=1, batch_size=16, lr=0.05, momentum=0.9, milestones=(), precision=precision
    )


def start(model: str) -> Weights:
    torch.manual_seed(0)
    return get_weights(build_model(model, CLASSES, SPEC))


def fedavg_round(device: torch.device, model: str, client_batch: int = 1) -> Weights:
    algorithm = build_algorithm(
        "fedavg", lambda: build_model(model, CLASSES, SPEC).to(device), training()
    )
    return simulate(
        algorithm,
        clients(device),
        training(),
        start(model),
        progress=False,
        client_batch=client_batch,
    ).weights


def max_diff(a: Weights, b: Weights) -> float:
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)


@pytest.mark.parametrize("client_batch", [1, 4])
@pytest.mark.parametrize("model", ["small-cnn", "mobilenet-v2-gn"])
def test_a_fedavg_round_on_the_gpu_matches_the_cpu(model, client_batch):
    assert max_diff(fedavg_round(CPU, model), fedavg_round(CUDA, model, client_batch)) <= 1e-4


def test_bf16_loss_on_the_gpu_is_near_fp32_on_the_cpu():
    losses = {}
    for device, precision in ((CPU, "fp32"), (CUDA, "bf16")):
        algorithm = build_algorithm(
            "fedavg",
            lambda d=device: build_model("small-cnn", CLASSES, SPEC).to(d),
            training(precision),
        )
        losses[precision] = algorithm.client_update(
            start("small-cnn"), clients(device)[0], {}, 0.05, 0
        ).loss
    assert abs(losses["bf16"] - losses["fp32"]) <= 5e-2


def test_pfedgp_posterior_on_the_gpu_matches_the_cpu():
    g = torch.Generator().manual_seed(0)
    z = torch.nn.functional.normalize(torch.randn(50, 16, generator=g, dtype=torch.float64))
    y = torch.arange(50) % 5
    cpu = gp_posterior(z[:40], y[:40], z[40:], 5)
    cuda = gp_posterior(z[:40].to(CUDA), y[:40].to(CUDA), z[40:].to(CUDA), 5)
    for a, b in zip(cpu, cuda, strict=True):
        assert float((a - b.cpu()).abs().max()) <= 1e-8


def test_encoder_exported_from_a_model_on_the_gpu_is_the_cpus(tmp_path: Path):
    torch.manual_seed(0)
    model = build_model("small-cnn", CLASSES, SPEC).eval()
    x = np.random.default_rng(0).normal(size=(8, 3, 32, 32)).astype(np.float32)
    export_onnx(model, x, tmp_path / "cpu.onnx")
    export_onnx(model.to(CUDA), x, tmp_path / "cuda.onnx")
    assert (tmp_path / "cpu.onnx").read_bytes() == (tmp_path / "cuda.onnx").read_bytes()
    assert next(model.parameters()).device.type == "cuda"  # the caller's model stays there
