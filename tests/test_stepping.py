"""Clients stepped together (`--client-batch`) train what the one-after-another path trains,
within float rounding, for every method that uses it; models that cannot fall back."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
import torch

from fed_train.algorithms import build_algorithm
from fed_train.algorithms.base import ClientData, TrainingConfig, get_weights
from fed_train.algorithms.stepping import stepping_blocker
from fed_train.models import MobileNetV2, SmallCNN
from fed_train.simulation import simulate

CLASSES = 4
# momentum and weight decay on, so the stacked optimiser state is exercised too
TRAINING = TrainingConfig(
    rounds=2, epochs=1, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-3, milestones=()
)
# unequal sizes: partial last batches and schedules of different lengths
SIZES = (37, 50, 21, 64)
TOLERANCE = 1e-5


def _clients(sizes: tuple[int, ...] = SIZES) -> list[ClientData]:
    rng = np.random.default_rng(0)
    out = []
    for cid, n in enumerate(sizes):

        def split(m: int) -> tuple[torch.Tensor, torch.Tensor]:
            y = rng.integers(0, CLASSES, m)
            x = rng.normal(size=(m, 1, 8, 8)) + y[:, None, None, None]
            return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)

        out.append(ClientData(cid, *split(n), *split(8), *split(8)))
    return out


def _model() -> SmallCNN:
    return SmallCNN(CLASSES, 1, 8, width=4, embedding_dim=16)


def _run(method: str, client_batch: int, training: TrainingConfig = TRAINING, **hyper):
    torch.manual_seed(0)
    algorithm = build_algorithm(method, _model, training, **hyper)
    start = get_weights(_model())
    return simulate(
        algorithm, _clients(), training, start, seed=3, progress=False, client_batch=client_batch
    )


def _arrays(tree) -> dict[str, np.ndarray]:
    """Every array of a nested state, by path."""
    if isinstance(tree, np.ndarray):
        return {"": tree}
    if isinstance(tree, dict):
        return {f"{k}/{p}": a for k, v in tree.items() for p, a in _arrays(v).items()}
    return {}


def _max_diff(a: dict, b: dict) -> float:
    left, right = _arrays(a), _arrays(b)
    assert left.keys() == right.keys()
    return max(
        (float(np.abs(left[k].astype(np.float64) - right[k]).max()) for k in left), default=0.0
    )


@pytest.mark.parametrize(
    "method, hyper",
    [
        ("fedavg", {}),
        ("fedavg+", {}),
        ("knnper", {}),
        ("fedrep", {"head_epochs": 2}),
        ("ditto", {"lambdas": (10.0, 0.1)}),
        ("apfl", {"alphas": (0.0, 0.3, 0.9)}),
    ],
)
def test_stepped_clients_equal_sequential_after_two_rounds(method, hyper):
    sequential = _run(method, 1, **hyper)
    together = _run(method, 3, **hyper)
    assert _max_diff(sequential.weights, together.weights) < TOLERANCE
    personal = method in ("fedrep", "ditto", "apfl")
    assert bool(_arrays({str(k): v for k, v in together.states.items()})) == personal
    assert (
        _max_diff(
            {str(k): v for k, v in sequential.states.items()},
            {str(k): v for k, v in together.states.items()},
        )
        < TOLERANCE
    )
    # the clients did move: a comparison of two untrained models would prove nothing
    assert _max_diff(sequential.weights, get_weights(_model())) > 1e-3


def test_fixed_step_budget_is_kept_per_client():
    training = replace(TRAINING, steps=3)  # 21 samples: 2 batches per epoch, so 2 epochs
    assert (
        _max_diff(_run("fedavg", 1, training).weights, _run("fedavg", 4, training).weights)
        < TOLERANCE
    )


def test_batchnorm_model_falls_back_to_one_after_another(caplog):
    assert stepping_blocker(MobileNetV2(CLASSES, 1)) is not None
    assert stepping_blocker(MobileNetV2(CLASSES, 1, norm="group")) is None
    assert stepping_blocker(_model()) is None

    def tiny_bn() -> MobileNetV2:
        return MobileNetV2(CLASSES, 1, embedding_dim=8)

    training = replace(TRAINING, rounds=1)
    torch.manual_seed(0)
    start = get_weights(tiny_bn())
    results = []
    for batch in (1, 4):
        torch.manual_seed(0)
        algorithm = build_algorithm("fedavg", tiny_bn, training)
        with caplog.at_level(logging.WARNING):
            results.append(
                simulate(
                    algorithm,
                    _clients((16, 9)),
                    training,
                    start,
                    seed=3,
                    progress=False,
                    client_batch=batch,
                )
            )
    assert "one after another" in caplog.text and "BatchNorm" in caplog.text
    assert _max_diff(results[0].weights, results[1].weights) == 0.0


def test_bf16_precision_trains_close_to_fp32_but_not_equal():
    fp32 = _run("fedavg", 1)
    bf16 = _run("fedavg", 1, replace(TRAINING, precision="bf16"))
    diff = _max_diff(fp32.weights, bf16.weights)
    assert 0.0 < diff < 0.1
    assert (
        _max_diff(bf16.weights, _run("fedavg", 3, replace(TRAINING, precision="bf16")).weights)
        < 1e-2
    )


def _lane_cap(lanes: int) -> str:
    """A KNNPER_LANE_MEMORY that holds `lanes` lanes of this test's model, by the estimate."""
    from fed_train.algorithms.stepping import MEMORY_SHARE, Lane, cross_entropy_loss, lane_bytes

    client = _clients()[0]
    model = _model()
    lane = Lane(dict(model.named_parameters()), {}, client.x_train, client.y_train, [])
    return str(
        int((lanes + 0.5) * lane_bytes(cross_entropy_loss(model), lane, TRAINING) / MEMORY_SHARE)
    )


def test_lanes_beyond_the_memory_cap_step_in_chunks_to_the_same_models(monkeypatch, caplog):
    """Ditto: 3 clients' global lanes and 2 personal lanes each, 9 lanes in chunks of 2 (its
    proximal step reads each chunk's own lanes' pull)."""
    sequential = _run("ditto", 1, lambdas=(10.0, 0.1))
    monkeypatch.setenv("KNNPER_LANE_MEMORY", _lane_cap(2))
    with caplog.at_level(logging.INFO, logger="fed_train.algorithms.stepping"):
        together = _run("ditto", 3, lambdas=(10.0, 0.1))
    assert "stepping 9 lanes in chunks of 2" in caplog.text
    assert _max_diff(sequential.weights, together.weights) < TOLERANCE
    assert (
        _max_diff(
            {str(k): v for k, v in sequential.states.items()},
            {str(k): v for k, v in together.states.items()},
        )
        < TOLERANCE
    )


def test_a_chunk_out_of_memory_is_halved_and_retried(monkeypatch, caplog):
    """A device that holds two lanes while the estimate says all fit: the first chunks run out
    of memory, are halved, and the run ends with the models it would have had."""
    from fed_train.algorithms import stepping

    sequential = _run("apfl", 1, alphas=(0.0, 0.9))
    real = stepping._step_chunk
    tried = []

    def two_lanes_fit(loss_fn, lanes, *args):
        tried.append(len(lanes))
        if len(lanes) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (a two-lane device)")
        return real(loss_fn, lanes, *args)

    monkeypatch.setattr(stepping, "_step_chunk", two_lanes_fit)
    monkeypatch.setenv("KNNPER_LANE_MEMORY", "1TB")
    with caplog.at_level(logging.INFO, logger="fed_train.algorithms.stepping"):
        together = _run("apfl", 4, alphas=(0.0, 0.9))
    assert "out of memory stepping" in caplog.text and max(tried) > 2
    assert _max_diff(sequential.weights, together.weights) < TOLERANCE
    assert (
        _max_diff(
            {str(k): v for k, v in sequential.states.items()},
            {str(k): v for k, v in together.states.items()},
        )
        < TOLERANCE
    )
