"""Checkpoints that a crash, a full disk or a flipped bit damaged: resuming verifies each one's
checksum before torch reads it, falls back to the previous good checkpoint with a warning, and
stops with one clear line when none is good."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fed_train.algorithms.fedavg import FedAvg
from fed_train.simulation import (
    CheckpointError,
    load_checkpoint,
    resume_from,
    save_checkpoint,
    simulate,
)
from tests.helpers.federation import TRAINING, initial_weights, make_clients, model_fn

WEIGHTS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
STATES = {0: {"personal": np.zeros(2, np.float32)}, 3: {}}


def _payload_start(path: Path) -> int:
    return path.read_bytes().index(b"\n") + 1


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[(_payload_start(path) + len(data)) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _with_header(path: Path, obj) -> None:
    """A file torch.save wrote, under a valid checksum header (what only a bug could make)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getvalue()
    header = b"knnper-checkpoint 1 sha256 " + hashlib.sha256(payload).hexdigest().encode()
    path.write_bytes(header + b"\n" + payload)


DAMAGED = {
    "zero bytes": (lambda p: p.write_bytes(b""), "has no checksum header"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-100]), "does not match its checksum"),
    "flipped byte": (_flip_byte, "does not match its checksum"),
    "bare torch.save": (lambda p: torch.save({"weights": {}}, p), "has no checksum header"),
    "bare tensor": (lambda p: _with_header(p, torch.zeros(3)), "got Tensor"),
    "wrong keys": (lambda p: _with_header(p, {"model": {}}), "got ['model']"),
    "weights not tensors": (
        lambda p: _with_header(p, {"rounds_done": 4, "weights": {"w": [1]}, "states": {}}),
        "weights that are not a name -> tensor mapping",
    ),
    "wrong round": (
        lambda p: _with_header(
            p, {"rounds_done": 9, "weights": {"w": torch.ones(1)}, "states": {}}
        ),
        "holds round 9",
    ),
}


def _two_checkpoints(run_dir: Path) -> Path:
    save_checkpoint(run_dir / "checkpoints" / "round_0002.pt", 2, WEIGHTS, STATES)
    newest = run_dir / "checkpoints" / "round_0004.pt"
    save_checkpoint(newest, 4, {k: v + 1 for k, v in WEIGHTS.items()}, STATES)
    return newest


def test_checkpoint_round_trips(tmp_path):
    path = tmp_path / "round_0004.pt"
    save_checkpoint(path, 4, WEIGHTS, STATES)
    back = load_checkpoint(path)
    assert back.rounds_done == 4 and sorted(back.states) == [0, 3]
    for name, value in WEIGHTS.items():
        np.testing.assert_array_equal(back.weights[name], value)
    assert path.read_bytes().startswith(b"knnper-checkpoint 1 sha256 ")


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_damaged_newest_checkpoint_falls_back_to_the_previous_with_a_warning(
    case, tmp_path, caplog
):
    newest = _two_checkpoints(tmp_path)
    damage, message = DAMAGED[case]
    damage(newest)
    with caplog.at_level(logging.WARNING, logger="fed_train.simulation"):
        state = resume_from(tmp_path)
    assert state.rounds_done == 2
    np.testing.assert_array_equal(state.weights["w"], WEIGHTS["w"])
    assert message in caplog.text and "previous good checkpoint" in caplog.text


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_no_good_checkpoint_is_one_clear_line(case, tmp_path):
    newest = _two_checkpoints(tmp_path)
    damage, message = DAMAGED[case]
    damage(newest)
    (tmp_path / "checkpoints" / "round_0002.pt").write_bytes(b"")
    with pytest.raises(CheckpointError) as info:
        resume_from(tmp_path)
    text = str(info.value)
    assert "\n" not in text and text.startswith("no good checkpoint to resume from")
    assert message in text and "to train from the start" in text


def test_no_checkpoints_is_a_fresh_start(tmp_path):
    assert resume_from(tmp_path) is None


def test_simulation_resumes_from_the_previous_good_checkpoint(tmp_path):
    clients = make_clients(4)
    training = TRAINING.__class__(**{**TRAINING.__dict__, "rounds": 4})
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    reference = simulate(
        FedAvg(model_fn, training),
        clients,
        training,
        initial_weights(),
        seed=0,
        run_dir=tmp_path / "a",
        checkpoint_every=2,
        progress=False,
    )
    run = tmp_path / "b"
    simulate(
        FedAvg(model_fn, training),
        clients,
        training,
        initial_weights(),
        seed=0,
        run_dir=run,
        checkpoint_every=2,
        progress=False,
    )
    _flip_byte(run / "checkpoints" / "round_0004.pt")
    again = simulate(
        FedAvg(model_fn, training),
        clients,
        training,
        initial_weights(),
        seed=0,
        run_dir=run,
        checkpoint_every=2,
        progress=False,
    )
    assert again.rounds_done == 4
    for name, value in reference.weights.items():
        np.testing.assert_array_equal(again.weights[name], value)
    rounds = [json.loads(line)["round"] for line in (run / "metrics.jsonl").open()]
    assert rounds == [1, 2, 3, 4]
    load_checkpoint(run / "checkpoints" / "round_0004.pt")  # rewritten whole


def test_slow_checkpoint_writes_are_spaced_out_and_the_run_is_unchanged(tmp_path, monkeypatch):
    """Ditto's personal models in every checkpoint: where writing one takes longer than a tenth
    of the training since the last, the write waits (the log line and validation accuracy do
    not), the last round is always written, and the weights and states are the same."""
    from fed_train import simulation
    from fed_train.algorithms.ditto import Ditto

    clients = make_clients(4)
    training = TRAINING.__class__(**{**TRAINING.__dict__, "rounds": 4})

    def ditto():
        return Ditto(model_fn, training, lambdas=(0.1,))

    for run in ("a", "b"):
        (tmp_path / run).mkdir()
    reference = simulate(
        ditto(),
        clients,
        training,
        initial_weights(),
        seed=0,
        run_dir=tmp_path / "a",
        checkpoint_every=1,
        progress=False,
    )
    real_save = simulation.save_checkpoint
    written = []

    def slow_save(path, rounds_done, *args, **kwargs):
        written.append(rounds_done)
        time.sleep(0.3)
        return real_save(path, rounds_done, *args, **kwargs)

    monkeypatch.setattr(simulation, "save_checkpoint", slow_save)
    monkeypatch.setattr(simulation, "CHECKPOINT_FREE_SECONDS", 0.1)
    spaced = simulate(
        ditto(),
        clients,
        training,
        initial_weights(),
        seed=0,
        run_dir=tmp_path / "b",
        checkpoint_every=1,
        progress=False,
    )
    assert written[0] == 1 and written[-1] == 4 and len(written) < 4
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").open()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert all(r["val_accuracy"] is not None for r in rows)
    for name, value in reference.weights.items():
        np.testing.assert_array_equal(spaced.weights[name], value)
    for cid, state in reference.states.items():
        for lam, personal in state["personal"].items():
            for name, value in personal.items():
                np.testing.assert_array_equal(spaced.states[cid]["personal"][lam][name], value)
