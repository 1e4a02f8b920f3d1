"""What a table will cost, said before its first job: a table at its documented scale trains for
hours, and a reader should know that before it starts, not from a bar after the first job.

Time: each training run's local SGD steps (the config's rounds, participation, epochs or steps
and the clients' sizes), times the seconds of one SGD step of the model timed here on a real
batch, times the method's `job_cost` (its training in FedAvg runs, which the algorithm declares),
spread over the workers. Evaluation and kNN-Per's configuration search come on top. Disk: each
run keeps two checkpoints, each at least the model's weights; methods with per-client state
(personal models, heads) add to that, so the figure is a lower bound (on digits, 20 clients:
FedAvg's run took 0.19 MB, its bound; APFL's 15 MB)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fed_train.algorithms.base import ClientData, TrainingConfig, cross_entropy, make_optimizer
from fed_train.progress import duration

KEPT_PER_RUN = 2  # a table's run keeps its two newest checkpoints (simulation.save_checkpoint)
_TIMED_STEPS = 3


@dataclass(frozen=True)
class TableEstimate:
    """A table's remaining training, before it starts.

    Parameters
    ----------
    runs : training runs left to do (cached ones excluded).
    fedavg_runs : their summed `job_cost`, in FedAvg runs.
    seconds : the wall time of that training on `workers` workers.
    min_bytes : the disk the runs take at least (their checkpoints' weights, no per-client
        state).
    workers : the worker processes the runs are spread over.
    """

    runs: int
    fedavg_runs: float
    seconds: float
    min_bytes: int
    workers: int

    def line(self) -> str:
        """One line for the terminal and the log."""
        return (
            f"bench table: {self.runs} training run(s) left, {self.fedavg_runs:g} FedAvg runs "
            f"of work: about {duration(self.seconds)} of training on {self.workers} worker(s) "
            f"(estimated from a timed SGD step; evaluation comes on top), at least "
            f"{_at_least(self.min_bytes)} of disk"
        )


def _at_least(nbytes: int) -> str:
    """Bytes in MB or GB, rounded down (a lower bound stays one)."""
    if nbytes >= 10**9:
        return f"{math.floor(nbytes / 10**8) / 10:g} GB"
    return f"{math.floor(nbytes / 10**5) / 10:g} MB"


def fedavg_steps(client_sizes: Sequence[int], training: TrainingConfig) -> float:
    """Expected local SGD steps of one FedAvg run over clients of these training sizes."""
    per_round = sum(
        training.steps
        if training.steps is not None
        else training.epochs * math.ceil(n / training.batch_size)
        for n in client_sizes
        if n > 0
    )
    return training.rounds * training.participation * per_round


def wall_seconds(job_costs: Sequence[float], run_seconds: float, workers: int) -> float:
    """The wall time of jobs of these costs (in FedAvg runs of `run_seconds` each) on `workers`
    processes: their total shared out, but never less than the longest job."""
    if not job_costs:
        return 0.0
    total = sum(job_costs) * run_seconds
    return max(total / min(workers, len(job_costs)), max(job_costs) * run_seconds)


def time_sgd_step(model: nn.Module, client: ClientData, training: TrainingConfig) -> float:
    """Seconds of one SGD step of `model` on a batch of `client`'s training data (the median of
    a few, after one untimed step)."""
    x = client.x_train[: training.batch_size]
    y = client.y_train[: training.batch_size]
    opt = make_optimizer(model.parameters(), training, training.lr)
    model.train()
    times = []
    for _ in range(_TIMED_STEPS + 1):
        start = time.perf_counter()
        opt.zero_grad()
        cross_entropy(model, x, y).backward()
        opt.step()
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    timed = sorted(times[1:])
    return timed[len(timed) // 2]


def weights_bytes(model: nn.Module) -> int:
    """The bytes of the model's saved weights (parameters and buffers)."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def estimate_table(
    job_costs: Sequence[float],
    clients: Sequence[ClientData],
    training: TrainingConfig,
    model_fn: Callable[[], nn.Module],
    workers: int,
) -> TableEstimate:
    """The estimate for the jobs left (their `job_cost`s), timing the model on the clients' data.

    Parameters
    ----------
    job_costs : each remaining training run's cost, in FedAvg runs.
    clients : the table's clients; those held out as unseen do not train.
    training : the shared training settings.
    model_fn : builds the table's model (timed on the first training client's data).
    workers : worker processes running the jobs.
    """
    training_clients = [c for c in clients if not c.unseen and c.num_train > 0]
    if not job_costs or not training_clients:
        return TableEstimate(0, 0.0, 0.0, 0, workers)
    threads = torch.get_num_threads()
    # the table's own draws must not see this probe; a worker process trains on one thread
    with torch.random.fork_rng(devices=[]):
        try:
            if workers > 1:
                torch.set_num_threads(1)
            model = model_fn()
            step = time_sgd_step(model, training_clients[0], training)
        finally:
            torch.set_num_threads(threads)
    run_seconds = step * fedavg_steps([c.num_train for c in training_clients], training)
    return TableEstimate(
        len(job_costs),
        round(sum(job_costs), 2),
        wall_seconds(job_costs, run_seconds, workers),
        len(job_costs) * KEPT_PER_RUN * weights_bytes(model),
        workers,
    )
