"""Clients of a round stepped together (`--client-batch N`): one vmap of grad over their stacked
parameters and optimiser state, so an accelerator runs N small per-client batches as one launch
instead of N. Small per-client batches leave a GPU launch-bound: a short script stepping 100
small CNNs this way ran a round 25x faster on an H100 (quoted in BENCHMARKS.md; this trainer has
not met a GPU yet). On 2 CPU cores it was 3x slower (grouped convolutions; BENCHMARKS.md), so one
after another stays the default.

A lane is one model being trained: a client's copy of the global model, or one of its personal
models (Ditto, APFL). Each lane takes exactly the mini-batches and SGD-with-momentum updates that
`local_sgd` gives it for the same seed: batches shorter than the batch size are padded and masked
out of the loss, and a lane whose schedule has ended (a client with fewer samples) keeps its
parameters and momentum unchanged while the others step on.

Lanes are independent, so they are stepped in chunks that fit the accelerator's free memory
(or KNNPER_LANE_MEMORY, a byte count such as 2GB, where set): each lane's bytes are estimated
from the tensors one forward pass saves for backward, and a chunk that still runs out of memory
is halved and stepped again from its inputs (stepping is a pure function of them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from edge_runtime.byte_count import parse_byte_count
from fed_train.accelerator import autocast
from fed_train.algorithms.base import finite_mean_loss
from fed_train.training_config import TrainingConfig

log = logging.getLogger(__name__)

LANE_MEMORY_ENV = "KNNPER_LANE_MEMORY"
# of the free memory, what the lanes may plan to use: the rest covers the allocator's
# fragmentation and temporaries the estimate does not see
MEMORY_SHARE = 0.7

Params = dict[str, torch.Tensor]
# (parameters of one lane, a batch of inputs, their labels) -> (objective, reported), each one
# value per sample: the gradient follows the objective, the mean loss reports the second
LossFn = Callable[[Params, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (stacked parameters of some lanes, which lanes of the whole list they are) -> parameters
AfterStep = Callable[[Params, slice], Params]


@dataclass
class Lane:
    """One model's starting point, the parameters held still (FedRep's head while its body
    trains), its data and its mini-batch schedule (`batch_schedule`'s index arrays)."""

    trainable: Params
    fixed: Params
    x: torch.Tensor
    y: torch.Tensor
    schedule: list[np.ndarray]


def stepping_blocker(model: nn.Module) -> str | None:
    """Why `model` cannot be stepped together with copies of itself, or None when it can."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return (
                "its BatchNorm layers keep running statistics per model (mobilenet-v2-gn "
                "is the variant that can)"
            )
        if isinstance(module, nn.RNNBase):
            return "torch.func has no batching rule for its LSTM (it would loop, no faster)"
    return None


def cross_entropy_loss(model: nn.Module) -> LossFn:
    """The loss `local_sgd` takes, per sample."""

    def loss(params: Params, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_sample = nn.functional.cross_entropy(
            functional_call(model, params, (x,)), y, reduction="none"
        )
        return per_sample, per_sample

    return loss


def _stack(dicts: list[Params]) -> Params:
    return {name: torch.stack([d[name] for d in dicts]) for name in dicts[0]} if dicts else {}


def _batches(
    lanes: list[Lane], batch_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """All lanes' data once (lanes that share a client share its rows), and for every step the
    rows each lane reads and the mask of real (not padding) samples: [steps, lanes, batch]."""
    offsets: dict[int, int] = {}
    xs, ys, start = [], [], 0
    for lane in lanes:
        if id(lane.x) not in offsets:
            offsets[id(lane.x)] = start
            xs.append(lane.x)
            ys.append(lane.y)
            start += len(lane.y)
    steps = max(len(lane.schedule) for lane in lanes)
    rows = np.zeros((steps, len(lanes), batch_size), dtype=np.int64)
    mask = np.zeros((steps, len(lanes), batch_size), dtype=np.float32)
    for j, lane in enumerate(lanes):
        base = offsets[id(lane.x)]
        rows[:, j, :] = base
        for s, idx in enumerate(lane.schedule):
            rows[s, j, : len(idx)] = base + idx
            mask[s, j, : len(idx)] = 1.0
    return (
        torch.cat(xs),
        torch.cat(ys),
        torch.from_numpy(rows).to(device),
        torch.from_numpy(mask).to(device),
    )


def _step_chunk(
    loss_fn: LossFn,
    lanes: list[Lane],
    training: TrainingConfig,
    lr: float,
    after_step: AfterStep | None,
    which: slice,
) -> tuple[list[Params], list[float]]:
    """`step_together` for lanes that fit in memory together: `which` of the whole list."""
    device = lanes[0].x.device
    x_all, y_all, rows, mask = _batches(lanes, training.batch_size, device)
    params = _stack([lane.trainable for lane in lanes])
    fixed = _stack([lane.fixed for lane in lanes])
    momentum = {name: torch.zeros_like(p) for name, p in params.items()}

    def lane_loss(
        trainable: Params, held: Params, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast(device, training.precision):
            objective, reported = loss_fn({**trainable, **held}, x, y)
        count = m.sum().clamp(min=1.0)
        return (objective.float() * m).sum() / count, (reported.float() * m).sum() / count

    step = vmap(grad_and_value(lane_loss, has_aux=True))
    objective_total = torch.zeros(len(lanes), dtype=torch.float64, device=device)
    reported_total = torch.zeros_like(objective_total)
    for s in range(rows.shape[0]):
        m = mask[s]
        counts = m.sum(1)
        active = counts > 0
        grads, (objective, reported) = step(params, fixed, x_all[rows[s]], y_all[rows[s]], m)
        updated = {}
        for name, p in params.items():
            g = grads[name]
            if training.weight_decay:
                g = g + training.weight_decay * p
            if training.momentum:
                g = training.momentum * momentum[name] + g
                momentum[name] = _where(active, g, momentum[name])
            updated[name] = p - lr * g
        if after_step is not None:
            updated = after_step(updated, which)
        params = {name: _where(active, updated[name], p) for name, p in params.items()}
        objective_total += objective.double() * counts.double()
        reported_total += reported.double() * counts.double()
    counts = [sum(len(idx) for idx in lane.schedule) for lane in lanes]
    for total, count in zip(objective_total.cpu(), counts, strict=True):
        finite_mean_loss(total, count, lr)
    losses = [
        finite_mean_loss(total, count, lr)
        for total, count in zip(reported_total.cpu(), counts, strict=True)
    ]
    return [{name: p[j] for name, p in params.items()} for j in range(len(lanes))], losses


def step_together(
    loss_fn: LossFn,
    lanes: list[Lane],
    training: TrainingConfig,
    lr: float,
    after_step: AfterStep | None = None,
) -> tuple[list[Params], list[float]]:
    """Train every lane by SGD (momentum and weight decay as torch.optim.SGD applies them) over
    its own schedule; returns each lane's trained parameters and mean reported loss. A NaN or
    infinite loss in any lane raises TrainingDiverged, as `local_sgd` does. Lanes go in chunks
    that fit in memory (see the module's docstring)."""
    if not lanes:
        return [], []
    device = lanes[0].x.device
    memory = lane_memory(device)
    chunk = len(lanes)
    if memory is not None:
        per_lane = lane_bytes(loss_fn, lanes[0], training)
        chunk = max(1, min(len(lanes), int(MEMORY_SHARE * memory // per_lane)))
        log.info(
            "stepping %d lanes in chunks of %d (%.0f MiB free, about %.0f MiB per lane)",
            len(lanes),
            chunk,
            memory / 2**20,
            per_lane / 2**20,
        )
    trained: list[Params] = []
    losses: list[float] = []
    while len(trained) < len(lanes):
        which = slice(len(trained), min(len(lanes), len(trained) + chunk))
        part = lanes[which]
        try:
            params, part_losses = _step_chunk(loss_fn, part, training, lr, after_step, which)
        except torch.cuda.OutOfMemoryError:
            if chunk == 1:
                raise
            chunk = max(1, len(part) // 2)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            log.warning(
                "out of memory stepping %d lanes together: retrying %d at a time", len(part), chunk
            )
            continue
        trained += params
        losses += part_losses
    return trained, losses


def lane_memory(device: torch.device) -> int | None:
    """Bytes the lanes may use: KNNPER_LANE_MEMORY where set, else the accelerator's free
    memory; None on the CPU (stepped lanes there are bounded by the client batch only)."""
    text = os.environ.get(LANE_MEMORY_ENV)
    if text:
        return parse_byte_count(text)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return None


@contextmanager
def _counting_saved(total: list[int]) -> Iterator[None]:
    """Add up the bytes of every tensor autograd saves for backward inside the block."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def lane_bytes(loss_fn: LossFn, lane: Lane, training: TrainingConfig) -> int:
    """One lane's memory at one step, estimated: its parameters four times over (the stacked
    copy, gradient, momentum and update) and what a forward pass saves for backward at the
    batch size, from two probes (one sample and two: the per-sample part and the fixed part)."""
    params = {n: p.detach().requires_grad_() for n, p in lane.trainable.items()}
    saved = []
    for n in (1, 2):
        total = [0]
        with _counting_saved(total), autocast(lane.x.device, training.precision):
            loss_fn({**params, **lane.fixed}, lane.x[:n], lane.y[:n])
        saved.append(total[0])
    per_sample = max(0, saved[1] - saved[0])
    fixed = max(0, saved[0] - per_sample)
    param_bytes = sum(p.numel() * p.element_size() for p in lane.trainable.values())
    return 4 * param_bytes + fixed + training.batch_size * per_sample


def _where(active: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.where(active.view(-1, *([1] * (new.dim() - 1))), new, old)


def as_params(weights: dict[str, np.ndarray], names: list[str], device: torch.device) -> Params:
    """The named entries of plain weights as tensors on `device`."""
    return {name: torch.from_numpy(np.asarray(weights[name])).to(device) for name in names}


def as_weights(params: Params) -> dict[str, np.ndarray]:
    return {name: p.detach().cpu().numpy() for name, p in params.items()}
