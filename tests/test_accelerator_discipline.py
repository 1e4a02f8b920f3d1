"""Accelerator discipline without a GPU: torch's lazy TorchScript backend stands in for an
accelerator. Its tensors live on device "lazy" and compute on the CPU, and, like a GPU's, they
refuse to mix with CPU tensors in an op and refuse `.numpy()`. So a tensor an algorithm, the
evaluation, pretraining or the exporter leaves on the host (or reads from the device without
`.cpu()`) fails here as it would on the first GPU run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from experiments.context import Context
from experiments.hardware import ByteBudgets
from fed_train.algorithms import ALGORITHMS, build_algorithm
from fed_train.algorithms.base import ClientData, TrainingConfig, get_weights
from fed_train.evaluation import client_accuracies
from fed_train.models import build_model
from fed_train.pretrain import PretrainConfig, pretrain
from fed_train.run import RunConfig
from fed_train.simulation import simulate

SPEC = {"kind": "image", "shape": [8, 8, 1]}
CLASSES = 3


@pytest.fixture(scope="module")
def stand_in() -> torch.device:
    """The lazy device, started once per process (it has no way to stop)."""
    try:
        import torch._lazy.ts_backend as ts_backend

        ts_backend.init()
    except (ImportError, RuntimeError) as err:
        pytest.skip(f"torch {torch.__version__} has no lazy TorchScript backend: {err}")
    return torch.device("lazy")


def test_stand_in_refuses_what_a_gpu_refuses(stand_in):
    on_device = torch.ones(3, device=stand_in)
    with pytest.raises(RuntimeError):
        (on_device + torch.eye(3)[0]).cpu()
    with pytest.raises(TypeError, match="numpy"):
        on_device.numpy()


def _clients(device: torch.device) -> list[ClientData]:
    """Three classes in every client, so pFedGP's context always holds two or more."""
    out = []
    for cid in range(3):
        g = torch.Generator().manual_seed(cid)
        x = torch.randn(18, 1, 8, 8, generator=g)
        y = torch.arange(18) % CLASSES
        out.append(
            ClientData(cid, x[:12], y[:12], x[12:15], y[12:15], x[15:], y[15:], unseen=cid == 2).to(
                device
            )
        )
    return out


@pytest.mark.parametrize("method", list(ALGORITHMS))
def test_round_and_evaluation_stay_on_the_device(method, stand_in):
    # one batch per client (pFedGP's context and target halves both hold every class)
    training = TrainingConfig(rounds=1, batch_size=32, lr=0.01, momentum=0.9, milestones=())
    torch.manual_seed(0)
    algorithm = build_algorithm(
        method, lambda: build_model("small-cnn", CLASSES, SPEC).to(stand_in), training
    )
    clients = _clients(stand_in)
    weights = get_weights(build_model("small-cnn", CLASSES, SPEC))
    states: dict = {}
    if algorithm.federated:
        result = simulate(algorithm, clients, training, weights, progress=False)
        weights, states = result.weights, result.states
        assert all(np.isfinite(w).all() for w in weights.values())
    rows = client_accuracies(algorithm, weights, states, clients)
    assert [r["n_test"] for r in rows] == [3, 3, 3]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)


def test_pretraining_with_augmentation_stays_on_the_device(stand_in, tmp_path):
    record = pretrain(
        PretrainConfig(dataset="digits", max_train=300, epochs=1, batch_size=64, augment=True),
        tmp_path / "init",
        progress=False,
        device=stand_in,
    )
    assert record["epochs_run"] == 1 and 0.0 <= record["val_accuracy"] <= 1.0
    state = torch.load(tmp_path / "init" / "model.pt", weights_only=True)
    assert {t.device.type for t in state.values()} == {"cpu"}


def test_export_from_a_run_on_the_device_in_an_experiment_point(stand_in, tmp_path: Path):
    """The hardware experiment's byte-budget point: train and load the run on the device, then
    export ONNX, int8 and bundles from it and score them through the device runtime."""
    config = RunConfig(
        dataset="digits",
        max_train=300,
        clients=4,
        unseen_fraction=0.25,
        val_fraction=0.25,
        checkpoint_every=1,
        training=TrainingConfig(rounds=1, batch_size=16, lr=0.05, momentum=0.9),
    )
    ctx = Context(tmp_path, config, quick=True, progress=False, device=stand_in)
    budgets = ByteBudgets(ctx, tmp_path / "work")
    assert ctx.run().model.classifier.weight.device.type == stand_in.type
    point = budgets.point(0.2)
    assert "error" not in point and len(point["rows"]) == 4
    assert all(0.0 <= r["test_accuracy"] <= 1.0 for r in point["rows"])
