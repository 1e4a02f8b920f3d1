"""Seconds per federated round and samples per second of the project's own trainer (FedAvg's
client updates through `simulate`), clients one after another versus stepped together
(`--client-batch`), on synthetic CIFAR-shaped data: the cases of BENCHMARKS.md's table of the
trainer at scale. Run it on the CPU here and on a GPU with `--device cuda`; every row names the
device it ran on.

A case is MODEL:MODE[:PRECISION], MODE `seq` (one after another) or a number (clients stepped
together). The first round of each case is a warm-up (allocations, cuDNN's choices) and is not
counted. Writes RESULTS/TAG.json (rows, command, machine) and RESULTS/TAG.csv.

    python benchmarks/train_throughput.py --tag cpu-small --cases small-cnn:seq small-cnn:100
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from experiments import benchmark_support as C
from fed_train.accelerator import resolve_device
from fed_train.algorithms import build_algorithm
from fed_train.algorithms.base import ClientData, TrainingConfig, get_weights
from fed_train.models import build_model
from fed_train.simulation import simulate, stepped_batch

log = logging.getLogger("benchmarks.train_throughput")
SPEC = {"kind": "image", "shape": [32, 32, 3]}
CLASSES = 10


@dataclass(frozen=True)
class Case:
    model: str
    client_batch: int  # 1: one after another
    precision: str

    @classmethod
    def parse(cls, text: str) -> Case:
        model, mode, *rest = text.split(":")
        return cls(model, 1 if mode == "seq" else int(mode), rest[0] if rest else "fp32")


def mode_label(client_batch: int) -> str:
    return "seq" if client_batch == 1 else f"together x{client_batch}"


def synthetic_clients(count: int, samples: int, device: torch.device) -> list[ClientData]:
    """Normalised random pixels and labels; the speed of SGD does not depend on their meaning."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(size=(count * samples, 3, 32, 32)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, CLASSES, count * samples))
    empty_x, empty_y = x[:0], y[:0]
    return [
        ClientData(
            i,
            x[i * samples : (i + 1) * samples],
            y[i * samples : (i + 1) * samples],
            empty_x,
            empty_y,
            empty_x,
            empty_y,
        ).to(device)
        for i in range(count)
    ]


def time_case(
    case: Case, clients: list[ClientData], device: torch.device, batch_size: int, rounds: int
) -> tuple[float, int]:
    """Mean seconds of the timed rounds (after one warm-up round), and how many clients
    actually stepped together: 1 where the model cannot (BatchNorm), whatever was asked."""
    training = TrainingConfig(
        rounds=1,
        epochs=1,
        batch_size=batch_size,
        lr=0.01,
        momentum=0.9,
        milestones=(),
        precision=case.precision,
    )

    def model_fn():
        return build_model(case.model, CLASSES, SPEC).to(device)

    torch.manual_seed(0)
    algorithm = build_algorithm("fedavg", model_fn, training)
    weights = get_weights(model_fn())
    together = stepped_batch(algorithm, case.client_batch)
    seconds = []
    for r in range(rounds + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        weights = simulate(
            algorithm,
            clients,
            training,
            weights,
            seed=r,
            progress=False,
            client_batch=case.client_batch,
        ).weights
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        log.info("%s %s round %d: %.2f s", case.model, mode_label(together), r, seconds[-1])
    return float(np.mean(seconds[1:])), together


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--tag", required=True, help="name of the results files")
    p.add_argument(
        "--cases",
        nargs="+",
        default=["small-cnn:seq", "small-cnn:100"],
        help="MODEL:MODE[:PRECISION], MODE seq or a client batch",
    )
    p.add_argument("--clients", type=int, default=100, help="clients per round")
    p.add_argument("--samples", type=int, default=500, help="training samples per client")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="timed rounds (after one warm-up)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--results", default=str(C.REPO / "benchmarks" / "results" / "train_throughput"))
    args = p.parse_args()
    C.setup_logging()
    C.limit_threads(args.threads)
    device = resolve_device(args.device)
    clients = synthetic_clients(args.clients, args.samples, device)
    start_info = C.machine_info()
    rows, sequential = [], {}
    for text in args.cases:
        case = Case.parse(text)
        seconds, together = time_case(case, clients, device, args.batch_size, args.rounds)
        if case.client_batch == 1:
            sequential[(case.model, case.precision)] = seconds
        base = sequential.get((case.model, case.precision))
        rows.append(
            {
                "case": text,
                "model": case.model,
                "mode": mode_label(together),
                "precision": case.precision,
                "device": torch.cuda.get_device_name()
                if device.type == "cuda"
                else f"cpu ({args.threads} threads)",
                "clients": args.clients,
                "samples_per_client": args.samples,
                "batch_size": args.batch_size,
                "rounds_timed": args.rounds,
                "seconds_per_round": seconds,
                "samples_per_s": args.clients * args.samples / seconds,
                "speedup_vs_seq": None if base is None else base / seconds,
            }
        )
    out = Path(args.results)
    C.write_json(
        out / f"{args.tag}.json",
        {
            "command": C.command_line(),
            "machine": start_info,
            "load_after": C.machine_info().get("loadavg_1_5_15"),
            "rows": rows,
        },
    )
    C.write_csv(out / f"{args.tag}.csv", rows)
    print(
        C.markdown_table(
            rows,
            [
                ("case", "case", ""),
                ("mode", "ran", ""),
                ("device", "device", ""),
                ("seconds_per_round", "s/round", ".2f"),
                ("samples_per_s", "samples/s", ",.0f"),
                ("speedup_vs_seq", "vs seq", ".2f"),
            ],
        )
    )


if __name__ == "__main__":
    main()
