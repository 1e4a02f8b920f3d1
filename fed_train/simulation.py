"""The in-process federated simulation: sample clients, run their updates, aggregate, log and
checkpoint every few rounds so an interrupted run resumes without losing finished rounds."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from fed_train.algorithms.base import Algorithm, ClientData, TrainingConfig, Weights, predict_proba

log = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 2  # the newest two: if the last one is unreadable, the one before still is


@dataclass
class SimulationResult:
    weights: Weights
    states: dict[int, dict[str, Any]] = field(default_factory=dict)
    rounds_done: int = 0


TRAIN_STREAM, AGGREGATE_STREAM, PERSONALIZE_STREAM = 0, 1, 2


def client_seed(seed: int, round_index: int, client_id: int,
                stream: int = TRAIN_STREAM) -> int:
    """One independent stream per (run, purpose, round, client), so a resumed run replays
    exactly and personalization never reuses a training stream."""
    return int(np.random.SeedSequence([seed, stream, round_index, client_id]).generate_state(1)[0])


def _to_tensors(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {str(k): _to_tensors(v) for k, v in obj.items()}
    return obj


def _to_arrays(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.numpy()
    if isinstance(obj, dict):
        return {k: _to_arrays(v) for k, v in obj.items()}
    return obj


def checkpoint_round(path: Path) -> int:
    """The round a checkpoint file holds, from its name (round_0005.pt -> 5)."""
    return int(path.stem.removeprefix("round_"))


def save_checkpoint(path: Path, rounds_done: int, weights: Weights,
                    states: dict[int, dict[str, Any]], keep_every: int | None = None) -> None:
    """Write to a temporary name and rename: a kill mid-write never leaves a torn checkpoint.
    Older checkpoints are deleted except the newest two and, with `keep_every`, those of every
    keep_every-th round (experiments on the global model's quality along training read them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"rounds_done": rounds_done, "weights": _to_tensors(weights),
                "states": {str(k): _to_tensors(v) for k, v in states.items()}}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for stale in sorted(path.parent.glob("round_*.pt"))[:-KEEP_CHECKPOINTS]:
        if keep_every is None or checkpoint_round(stale) % keep_every:
            stale.unlink()


def load_checkpoint(path: Path) -> SimulationResult:
    data = torch.load(path, weights_only=True)
    return SimulationResult(_to_arrays(data["weights"]),
                            {int(k): _to_arrays(v) for k, v in data["states"].items()},
                            int(data["rounds_done"]))


def resume_from(run_dir: Path) -> SimulationResult | None:
    """The newest checkpoint that loads; a torn or corrupt newest file falls back to the one
    before it."""
    for path in sorted((run_dir / "checkpoints").glob("round_*.pt"), reverse=True):
        try:
            state = load_checkpoint(path)
        except (OSError, RuntimeError, KeyError, ValueError) as err:
            log.warning("skipping unreadable checkpoint %s: %s", path, err)
            continue
        log.info("resuming from %s (%d rounds done)", path, state.rounds_done)
        return state
    return None


def _pooled_val_accuracy(algorithm: Algorithm, weights: Weights,
                         clients: list[ClientData]) -> float | None:
    model_of = getattr(algorithm, "global_model", None)
    if model_of is None:
        return None
    model = model_of(weights)
    correct = total = 0
    for c in clients:
        if len(c.y_val):
            correct += int((predict_proba(model, c.x_val).argmax(1) == c.y_val.numpy()).sum())
            total += len(c.y_val)
    return correct / total if total else None


def _truncate_metrics(path: Path, rounds_done: int) -> None:
    """Drop log lines of rounds after the checkpoint we resume from: they will be re-run."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["round"] <= rounds_done]
    path.write_text("".join(line + "\n" for line in kept))


def sample_clients(seed: int, round_index: int, participants: int,
                   participation: float) -> list[int]:
    """The participant indices a round trains, in increasing order; the Flower server draws its
    rounds with this too, so both engines train the same clients."""
    per_round = max(1, int(round(participation * participants)))
    rng = np.random.default_rng([seed, round_index])
    return sorted(int(i) for i in rng.choice(participants, size=per_round, replace=False))


def open_run_log(run_dir: Path, initial_weights: Weights) -> SimulationResult:
    """Where a run stands: its newest checkpoint, with the log lines of later rounds dropped
    (they will be re-run), or round 0."""
    state = resume_from(run_dir) or SimulationResult(initial_weights, {}, 0)
    _truncate_metrics(run_dir / "metrics.jsonl", state.rounds_done)
    return state


def is_checkpoint_round(rounds_done: int, rounds: int, checkpoint_every: int) -> bool:
    return rounds_done % checkpoint_every == 0 or rounds_done == rounds


def log_round(run_dir: Path, row: dict[str, Any], state: SimulationResult, checkpoint: bool,
              keep_every: int | None = None) -> None:
    """The log line goes first: a kill before the checkpoint only re-runs logged rounds, whose
    lines the resume truncates."""
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    if checkpoint:
        save_checkpoint(run_dir / "checkpoints" / f"round_{state.rounds_done:04d}.pt",
                        state.rounds_done, state.weights, state.states, keep_every)


def simulate(algorithm: Algorithm, clients: list[ClientData], training: TrainingConfig,
             initial_weights: Weights, *, seed: int = 0, run_dir: Path | None = None,
             checkpoint_every: int = 5, keep_every: int | None = None,
             progress: bool = True) -> SimulationResult:
    """Run `training.rounds` rounds over the clients that are not held out as unseen.
    `keep_every`: see save_checkpoint."""
    participants = [c for c in clients if not c.unseen]
    if not participants:
        raise ValueError("no training clients: every client is held out as unseen")
    total = sum(c.num_train for c in participants)
    state = (open_run_log(run_dir, initial_weights) if run_dir is not None
             else SimulationResult(initial_weights, {}, 0))
    rounds = range(state.rounds_done, training.rounds)
    for r in tqdm(rounds, desc=algorithm.name, disable=not progress, initial=state.rounds_done,
                  total=training.rounds):
        start = time.perf_counter()
        lr = training.lr_at(r, training.rounds)
        results = []
        for i in sample_clients(seed, r, len(participants), training.participation):
            client = participants[i]
            result = algorithm.client_update(state.weights, client,
                                             state.states.get(client.client_id, {}), lr,
                                             client_seed(seed, r, client.client_id))
            state.states[client.client_id] = result.state
            results.append(result)
        state.weights = algorithm.aggregate(state.weights, results, total,
                                            client_seed(seed, r, 0, AGGREGATE_STREAM))
        state.rounds_done = r + 1
        row: dict[str, Any] = {
            "round": r + 1, "lr": lr, "clients": len(results),
            "train_loss": float(np.average([x.loss for x in results],
                                           weights=[x.num_samples for x in results])),
            "seconds": round(time.perf_counter() - start, 3),
        }
        if run_dir is not None:
            checkpoint = is_checkpoint_round(state.rounds_done, training.rounds,
                                             checkpoint_every)
            if checkpoint:
                row["val_accuracy"] = _pooled_val_accuracy(algorithm, state.weights,
                                                           participants)
            log_round(run_dir, row, state, checkpoint, keep_every)
        log.debug("round %d: %s", r + 1, row)
    return state
