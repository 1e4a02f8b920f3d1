"""The in-process federated simulation: sample clients, run their updates, aggregate, log and
checkpoint every few rounds so an interrupted run resumes without losing finished rounds.

A checkpoint is one line `knnper-checkpoint 1 sha256 <hex>` followed by torch.save's bytes, so
a torn, truncated or bit-flipped file is recognised before torch reads it; resuming falls back
to the previous good checkpoint with a warning and stops with one line when none is good.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_runtime._io import (
    append_bytes,
    memory_limit,
    parse_json,
    read_regular,
    remove_dead_writers_files,
    write_atomic,
    write_bytes_atomic,
)
from edge_runtime.errors import one_line
from edge_runtime.values import is_integer
from fed_train.algorithms.base import (
    Algorithm,
    ClientData,
    ClientResult,
    TrainingConfig,
    Weights,
    predict_proba,
    sub_seed,
)
from fed_train.algorithms.stepped import Cohort
from fed_train.errors import TrainingError
from fed_train.progress import track
from fed_train.torch_files import load_tensors

log = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 2  # the newest two: if the last one is unreadable, the one before still is
# A checkpoint round's write is skipped while writing would take more than this share of the
# time (every client's personal models, at 200 clients, take seconds per round to write);
# writes under CHECKPOINT_FREE_SECONDS are never skipped. The round's log line (and its
# validation accuracy) is written either way, and a resumed run replays the rounds exactly.
CHECKPOINT_SHARE = 0.1
CHECKPOINT_FREE_SECONDS = 1.0
CHECKPOINT_MAGIC = b"knnper-checkpoint 1 sha256 "
MAX_METRICS_BYTES = 256 << 20  # metrics.jsonl: a few hundred bytes per round
_CHECKPOINT_KEYS = {"rounds_done", "weights", "states"}


class CheckpointError(TrainingError):
    """A checkpoint that cannot be resumed from (torn, corrupted, or not one of ours)."""


@dataclass
class SimulationResult:
    weights: Weights
    states: dict[int, dict[str, Any]] = field(default_factory=dict)
    rounds_done: int = 0


TRAIN_STREAM, AGGREGATE_STREAM, PERSONALIZE_STREAM = 0, 1, 2


def client_seed(seed: int, round_index: int, client_id: int, stream: int = TRAIN_STREAM) -> int:
    """One independent stream per (run, purpose, round, client), so a resumed run replays
    exactly and personalization never reuses a training stream."""
    return sub_seed(seed, stream, round_index, client_id)


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


def save_checkpoint(
    path: Path,
    rounds_done: int,
    weights: Weights,
    states: dict[int, dict[str, Any]],
    keep_every: int | None = None,
) -> None:
    """A checksum header line plus torch.save's bytes, written to a unique temporary name,
    fsynced and renamed (write_atomic): a kill mid-write never leaves a torn checkpoint under
    the final name.
    Older checkpoints are deleted except the newest two and, with `keep_every`, those of every
    keep_every-th round (experiments on the global model's quality along training read them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(
        {
            "rounds_done": rounds_done,
            "weights": _to_tensors(weights),
            "states": {str(k): _to_tensors(v) for k, v in states.items()},
        },
        buf,
    )
    payload = buf.getvalue()
    header = CHECKPOINT_MAGIC + hashlib.sha256(payload).hexdigest().encode("ascii") + b"\n"
    write_atomic(path, lambda f: (f.write(header), f.write(payload)))
    for stale in sorted(path.parent.glob("round_*.pt"))[:-KEEP_CHECKPOINTS]:
        if keep_every is None or checkpoint_round(stale) % keep_every:
            stale.unlink()


def load_checkpoint(path: Path) -> SimulationResult:
    """Verify the checksum, then read with weights_only=True and check the structure;
    CheckpointError (one line) names what is wrong."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path} {why}")

    try:
        data = read_regular(path, memory_limit())
    except OSError as err:
        raise bad(f"cannot be read: {err.strerror}") from None
    if data is None:
        raise bad("is larger than half of this machine's memory")
    header, newline, payload = data.partition(b"\n")
    if not newline or not header.startswith(CHECKPOINT_MAGIC):
        raise bad("has no checksum header (empty, torn, or not written by knnper)")
    if hashlib.sha256(payload).hexdigest().encode("ascii") != header[len(CHECKPOINT_MAGIC) :]:
        raise bad("does not match its checksum (corrupted)")
    try:
        raw = load_tensors(payload, memory_limit())
    except Exception as err:  # torch raises several types for unreadable data
        raise bad(f"cannot be read safely: {one_line(err, first_line=True)}") from None
    if not isinstance(raw, dict) or set(raw) != _CHECKPOINT_KEYS:
        raise bad(f"must hold {sorted(_CHECKPOINT_KEYS)}, got {_keys_or_type(raw)}")
    rounds, weights, states = raw["rounds_done"], raw["weights"], raw["states"]
    if not is_integer(rounds) or rounds < 0:
        raise bad(f"has rounds_done {rounds!r}, not a round count")
    if (
        not isinstance(weights, dict)
        or not weights
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items())
    ):
        raise bad("has weights that are not a name -> tensor mapping")
    if not isinstance(states, dict) or not all(
        isinstance(k, str) and k.lstrip("-").isdigit() and isinstance(v, dict)
        for k, v in states.items()
    ):
        raise bad("has client states that are not a client id -> state mapping")
    return SimulationResult(
        _to_arrays(weights), {int(k): _to_arrays(v) for k, v in states.items()}, rounds
    )


def _keys_or_type(value: Any) -> str:
    return repr(sorted(map(str, value))) if isinstance(value, dict) else type(value).__name__


def _check_weights(path: Path, weights: Weights, like: Weights) -> None:
    """A checkpoint's weights fit the run's model (names and shapes) and are finite: a
    resealed one must not carry NaN into model.pt or fail deep inside training."""
    shapes = {name: tuple(value.shape) for name, value in weights.items()}
    if shapes != {name: tuple(value.shape) for name, value in like.items()}:
        raise CheckpointError(f"checkpoint {path} holds weights of another model")
    if not all(np.isfinite(value).all() for value in weights.values()):
        raise CheckpointError(f"checkpoint {path} holds NaN or infinite weights")


def resume_from(run_dir: Path, like: Weights | None = None) -> SimulationResult | None:
    """The newest good checkpoint, falling back past bad ones with a warning; None when there
    are none, CheckpointError when there are some and none is good. `like`: the run's
    initial weights, whose names and shapes a good checkpoint's weights have."""
    remove_dead_writers_files(run_dir / "checkpoints")
    paths = sorted((run_dir / "checkpoints").glob("round_*.pt"), reverse=True)
    problems = []
    for path in paths:
        try:
            state = load_checkpoint(path)
            if checkpoint_round(path) != state.rounds_done:
                raise CheckpointError(f"checkpoint {path} holds round {state.rounds_done}")
            if like is not None:
                _check_weights(path, state.weights, like)
        except (CheckpointError, ValueError) as err:  # ValueError: a name that is no round
            log.warning("%s; trying the one before", err)
            problems.append(str(err))
            continue
        if problems:
            log.warning(
                "resuming from the previous good checkpoint %s (%d rounds done)",
                path,
                state.rounds_done,
            )
        else:
            log.info("resuming from %s (%d rounds done)", path, state.rounds_done)
        return state
    if paths:
        raise CheckpointError(
            f"no good checkpoint to resume from: {problems[0]}; remove "
            f"{run_dir / 'checkpoints'} to train from the start"
        )
    return None


def _pooled_val_accuracy(
    algorithm: Algorithm, weights: Weights, clients: list[ClientData]
) -> float | None:
    model_of = getattr(algorithm, "global_model", None)
    if model_of is None:
        return None
    model = model_of(weights)
    correct = total = 0
    for c in clients:
        if len(c.y_val):
            correct += int((predict_proba(model, c.x_val).argmax(1) == c.y_val.cpu().numpy()).sum())
            total += len(c.y_val)
    return correct / total if total else None


def _truncate_metrics(path: Path, rounds_done: int) -> None:
    """Drop log lines of rounds after the checkpoint we resume from: they will be re-run. A
    torn last line (a kill mid-write) is dropped too; any other unreadable line stops the
    resume with one line naming the file."""
    if not path.exists():
        return
    try:
        raw = read_regular(path, MAX_METRICS_BYTES)
        if raw is None:
            raise ValueError(f"it is over {MAX_METRICS_BYTES} bytes")
        lines = raw.decode("utf-8").splitlines()
    except (OSError, ValueError) as err:  # a pipe, a device, not UTF-8, too large
        raise CheckpointError(
            f"{path} cannot be read: {one_line(err, first_line=True)}; "
            "restore or delete it to resume"
        ) from None
    kept = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = parse_json(line.encode("utf-8"), strict=False)
            round_done = row["round"]
            if not is_integer(round_done):
                raise TypeError
        except (ValueError, TypeError, KeyError):
            if number == len(lines):
                log.warning("%s: dropping a torn last line (an interrupted write)", path)
                continue
            raise CheckpointError(
                f"{path} line {number} is not a round's JSON record with an "
                "integer 'round'; fix or delete that line to resume"
            ) from None
        if round_done <= rounds_done:
            kept.append(line)
    write_bytes_atomic(path, "".join(line + "\n" for line in kept).encode("utf-8"))


def sample_clients(
    seed: int, round_index: int, participants: int, participation: float
) -> list[int]:
    """The participant indices a round trains, in increasing order; the Flower server draws its
    rounds with this too, so both engines train the same clients."""
    per_round = max(1, int(round(participation * participants)))
    rng = np.random.default_rng([seed, round_index])
    return sorted(int(i) for i in rng.choice(participants, size=per_round, replace=False))


def open_run_log(run_dir: Path, initial_weights: Weights) -> SimulationResult:
    """Where a run stands: its newest checkpoint, with the log lines of later rounds dropped
    (they will be re-run), or round 0."""
    state = resume_from(run_dir, initial_weights) or SimulationResult(initial_weights, {}, 0)
    _truncate_metrics(run_dir / "metrics.jsonl", state.rounds_done)
    return state


def is_checkpoint_round(rounds_done: int, rounds: int, checkpoint_every: int) -> bool:
    return rounds_done % checkpoint_every == 0 or rounds_done == rounds


def log_round(
    run_dir: Path,
    row: dict[str, Any],
    state: SimulationResult,
    checkpoint: bool,
    keep_every: int | None = None,
) -> None:
    """The log line goes first: a kill before the checkpoint only re-runs logged rounds, whose
    lines the resume truncates."""
    append_bytes(run_dir / "metrics.jsonl", (json.dumps(row) + "\n").encode("utf-8"))
    if checkpoint:
        save_checkpoint(
            run_dir / "checkpoints" / f"round_{state.rounds_done:04d}.pt",
            state.rounds_done,
            state.weights,
            state.states,
            keep_every,
        )


def stepped_batch(algorithm: Algorithm, client_batch: int) -> int:
    """How many clients step together: `client_batch`, or 1 with a one-line note when the
    algorithm or its model cannot."""
    if client_batch <= 1:
        return 1
    blocker = getattr(algorithm, "stepping_blocker", None)
    why = (
        "its clients' updates do not step together"
        if blocker is None or not hasattr(algorithm, "client_updates")
        else blocker()
    )
    if why is not None:
        log.warning(
            "%s: clients train one after another, not %d together: %s",
            algorithm.name,
            client_batch,
            why,
        )
        return 1
    return client_batch


def _participants(clients: list[ClientData]) -> list[ClientData]:
    """The clients that train: every one not held out as unseen (refused if none is)."""
    participants = [c for c in clients if not c.unseen]
    if not participants:
        raise ValueError("no training clients: every client is held out as unseen")
    return participants


def train_clients(
    algorithm: Algorithm,
    state: SimulationResult,
    sampled: list[ClientData],
    lr: float,
    seed: int,
    round_index: int,
    client_batch: int,
) -> list[ClientResult]:
    """One round's client updates from `state`'s weights, `client_batch` clients stepped
    together at a time; each client's new state is kept in `state`."""
    results = []
    for first in range(0, len(sampled), client_batch):
        chunk = sampled[first : first + client_batch]
        states = [state.states.get(c.client_id, {}) for c in chunk]
        seeds = [client_seed(seed, round_index, c.client_id) for c in chunk]
        if client_batch > 1:
            done = algorithm.client_updates(state.weights, Cohort(chunk, states, seeds), lr)
        else:
            done = [algorithm.client_update(state.weights, chunk[0], states[0], lr, seeds[0])]
        for client, result in zip(chunk, done, strict=True):
            state.states[client.client_id] = result.state
        results.extend(done)
    return results


class _CheckpointPace:
    """Logs each round into the run directory and writes the checkpoints of its checkpoint
    rounds, skipping one whose write would cost more than CHECKPOINT_SHARE of the training
    since the last write (never a cheap one, the last round's, or a kept one)."""

    def __init__(self, rounds: int, checkpoint_every: int, keep_every: int | None) -> None:
        self.rounds, self.every, self.keep_every = rounds, checkpoint_every, keep_every
        self.write_seconds = self.trained_seconds = 0.0  # the last write; training since it

    def is_checkpoint(self, rounds_done: int) -> bool:
        return is_checkpoint_round(rounds_done, self.rounds, self.every)

    def log(self, run_dir: Path, row: dict[str, Any], state: SimulationResult) -> None:
        done = state.rounds_done
        self.trained_seconds += row["seconds"]
        write = self.is_checkpoint(done) and (
            self.write_seconds < CHECKPOINT_FREE_SECONDS
            or done == self.rounds
            or self.trained_seconds * CHECKPOINT_SHARE >= self.write_seconds
            or (self.keep_every is not None and done % self.keep_every == 0)
        )
        begun = time.perf_counter()
        log_round(run_dir, row, state, write, self.keep_every)
        if write:
            self.write_seconds, self.trained_seconds = time.perf_counter() - begun, 0.0


def simulate(
    algorithm: Algorithm,
    clients: list[ClientData],
    training: TrainingConfig,
    initial_weights: Weights,
    *,
    seed: int = 0,
    run_dir: Path | None = None,
    checkpoint_every: int = 5,
    keep_every: int | None = None,
    progress: bool = True,
    client_batch: int = 1,
) -> SimulationResult:
    """Run `training.rounds` rounds over the clients that are not held out as unseen,
    resuming from `run_dir`'s last checkpoint when it has one.

    Parameters
    ----------
    algorithm : the federated algorithm (`build_algorithm`).
    clients : every client's data (`ClientData`); unseen ones are skipped.
    training : rounds, participation, learning rate and its schedule (`TrainingConfig`).
    initial_weights : the server's weights before round 1.
    seed : seeds client sampling, local steps and aggregation; a rerun with the same seed
        repeats the run.
    run_dir : where metrics.jsonl and checkpoints/ go; None keeps everything in memory.
    checkpoint_every : rounds between checkpoints (the last round is always saved).
    keep_every : checkpoints of every keep_every-th round are kept beside the newest two
        (see save_checkpoint); None keeps only the newest two.
    progress : a bar on a terminal, a line every 30 s in a log.
    client_batch : up to this many sampled clients step together
        (fed_train.algorithms.stepping) when the algorithm and model allow it.

    Returns
    -------
    SimulationResult : the final weights, each client's state and the rounds done.
    """
    participants = _participants(clients)
    total = sum(c.num_train for c in participants)
    state = (
        open_run_log(run_dir, initial_weights)
        if run_dir is not None
        else SimulationResult(initial_weights, {}, 0)
    )
    client_batch = stepped_batch(algorithm, client_batch)
    pace = _CheckpointPace(training.rounds, checkpoint_every, keep_every)
    for r in track(
        range(state.rounds_done, training.rounds),
        total=training.rounds,
        initial=state.rounds_done,
        desc=algorithm.name,
        unit="round",
        enabled=progress,
    ):
        start = time.perf_counter()
        lr = training.lr_at(r, training.rounds)
        sampled = [
            participants[i]
            for i in sample_clients(seed, r, len(participants), training.participation)
        ]
        results = train_clients(algorithm, state, sampled, lr, seed, r, client_batch)
        state.weights = algorithm.aggregate(
            state.weights, results, total, client_seed(seed, r, 0, AGGREGATE_STREAM)
        )
        state.rounds_done = r + 1
        row: dict[str, Any] = {
            "round": r + 1,
            "lr": lr,
            "clients": len(results),
            "train_loss": float(
                np.average([x.loss for x in results], weights=[x.num_samples for x in results])
            ),
            "seconds": round(time.perf_counter() - start, 3),
        }
        if run_dir is not None:
            if pace.is_checkpoint(state.rounds_done):
                row["val_accuracy"] = _pooled_val_accuracy(algorithm, state.weights, participants)
            pace.log(run_dir, row, state)
        log.debug("round %d: %s", r + 1, row)
    return state
