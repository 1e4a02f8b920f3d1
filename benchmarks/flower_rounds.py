"""Flower versus the in-process simulation for the same work: one configuration trained by
`knnper train` (the simulation) and by `knnper deploy local` (a SuperLink and one SuperNode per
client on loopback, TLS and SuperNode authentication), compared on time per round, bytes per
round, the final weights and the accuracies (`knnper evaluate` on both run directories, and the
Flower run's own federated evaluation).

Resumable: each engine's run directory resumes from its checkpoints, and a finished one is not
trained again. Writes RESULTS/rounds_TAG.csv (one row per engine and round), RESULTS/TAG.json
(everything, with the command and the machine) and adds TAG's row to RESULTS/summary.csv and
summary.md.

    python benchmarks/flower_rounds.py --tag digits-10 --dataset digits --clients 10 --rounds 5
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments import benchmark_support as C
from fed_train.algorithms.base import get_weights
from fed_train.deploy import LocalFederation, deploy_local
from fed_train.flower.settings import FlowerSettings
from fed_train.knn_request import KNNRequest
from fed_train.run import load_run, train
from fed_train.run_evaluation import evaluate_run

log = logging.getLogger("benchmarks.flower")

MARKDOWN = (
    ("tag", "run", ""),
    ("clients", "clients", ""),
    ("rounds", "rounds", ""),
    ("sim_s_per_round", "simulation s/round", ".1f"),
    ("flower_s_per_round", "Flower s/round", ".1f"),
    ("flower_over_sim", "ratio", ".1f"),
    ("payload_bytes_per_round", "weights bytes/round", ".3g"),
    ("superlink_bytes_per_round", "SuperLink bytes/round", ".3g"),
    ("sim_fedavg_seen", "FedAvg sim %", ".2f"),
    ("flower_fedavg_seen", "FedAvg Flower %", ".2f"),
    ("sim_knnper_seen", "kNN-Per sim %", ".2f"),
    ("federated_knnper_seen", "kNN-Per federated %", ".2f"),
    ("max_abs_weight_diff", "max weight diff", ".3g"),
    ("clientapp_import_cpu_s", "ClientApp import CPU s", ".1f"),
    ("load_before", "load (1 min) before", ".1f"),
    ("load_after", "after", ".1f"),
)


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]


def clientapp_import_cost(repeats: int) -> dict[str, float]:
    """What every ClientApp process pays before it trains: Python, torch, flwr and knnper
    imported afresh (Flower starts one process per message). Median CPU and wall seconds."""
    cpu, wall = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", "import fed_train.flower.client_app"], check=True, cwd=C.REPO
        )
        wall.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return {"cpu_s": float(np.median(cpu)), "wall_s": float(np.median(wall))}


def parse_args() -> argparse.Namespace:
    p = C.flower_parser(__doc__)
    KNNRequest.add_arguments(p)  # kNN-Per's setting, chosen by the federation and by evaluate alike
    p.add_argument(
        "--import-repeats",
        type=int,
        default=3,
        help="fresh processes timing the ClientApp's imports (the median is reported)",
    )
    return p.parse_args()


def train_both(args: argparse.Namespace, sim_dir: Path, flower_dir: Path) -> dict[str, Any]:
    """The same configuration trained by the simulation and by a local Flower federation
    (unless a finished one is there); the Flower run's record (flower.json)."""
    config = C.flower_run_config(args)
    start = time.perf_counter()
    train(config, sim_dir, progress=False)
    log.info("simulation done in %.0f s", time.perf_counter() - start)
    record_path = flower_dir / "flower.json"
    finished = (
        record_path.is_file()
        and json.loads(record_path.read_text()).get("superlink_run", {}).get("status")
        == "finished:completed"
    )
    if not finished:
        start = time.perf_counter()
        settings = FlowerSettings(
            run=config,
            run_dir=str(flower_dir),
            round_timeout=args.round_timeout,
            connect_timeout=600.0,
            knn=KNNRequest.from_args(args),
        )
        deploy_local(settings, LocalFederation(clients=args.clients, startup_timeout=120.0))
        log.info("Flower run done in %.0f s", time.perf_counter() - start)
    return json.loads(record_path.read_text())


def compare_runs(
    args: argparse.Namespace, sim_dir: Path, flower_dir: Path, federated: dict[str, Any]
) -> dict[str, Any]:
    """`knnper evaluate` on both runs, and how far apart they end: the largest difference of
    their final weights, and of a client's kNN-Per accuracy between the Flower run's own
    federated evaluation (`federated`) and `knnper evaluate` on that run."""
    sim_run, flower_run = load_run(sim_dir), load_run(flower_dir)
    knn = KNNRequest.from_args(args)
    sim_eval, flower_eval = (
        evaluate_run(r, ["fedavg", "knnper"], knn=knn, progress=False)
        for r in (sim_run, flower_run)
    )
    sim_w, flower_w = get_weights(sim_run.model), get_weights(flower_run.model)
    by_client = {c["client_id"]: c for c in flower_eval["clients"]}
    return {
        "simulation": sim_eval,
        "flower": flower_eval,
        "weight_diff": max(
            float(np.max(np.abs(sim_w[k].astype(np.float64) - flower_w[k]))) for k in sim_w
        ),
        "client_diff": max(
            abs(c["knnper"] - by_client[c["client_id"]]["knnper"])
            for c in federated["clients"]
            if c["knnper"] is not None
        ),
    }


def summary_row(
    args: argparse.Namespace,
    rounds: list[dict[str, Any]],
    record: dict[str, Any],
    compared: dict[str, Any],
    imports: dict[str, float],
    load_before: float,
) -> dict[str, Any]:
    """TAG's row of summary.csv: time and bytes per round, accuracies, differences, costs."""
    flower_rounds = [r for r in rounds if r["engine"] == "flower"]
    sim_s = float(np.mean([r["seconds"] for r in rounds if r["engine"] == "simulation"]))
    flower_s = float(np.mean([r["seconds"] for r in flower_rounds]))
    traffic = record["superlink_run"]["network-traffic"]["total-bytes"]
    sim_eval, flower_eval = compared["simulation"], compared["flower"]
    return {
        "tag": args.tag,
        "dataset": args.dataset,
        "clients": args.clients,
        "rounds": args.rounds,
        "max_train": args.max_train,
        "sim_s_per_round": sim_s,
        "flower_s_per_round": flower_s,
        "flower_over_sim": flower_s / sim_s,
        "payload_bytes_per_round": float(
            np.mean([r["bytes_down"] + r["bytes_up"] for r in flower_rounds])
        ),
        "superlink_bytes_total": traffic,
        # queries and the evaluation travel too: the whole run's traffic over its rounds
        "superlink_bytes_per_round": traffic / args.rounds,
        "sim_fedavg_seen": 100 * sim_eval["seen"]["fedavg"]["mean"],
        "flower_fedavg_seen": 100 * flower_eval["seen"]["fedavg"]["mean"],
        "sim_knnper_seen": 100 * sim_eval["seen"]["knnper"]["mean"],
        "flower_knnper_seen": 100 * flower_eval["seen"]["knnper"]["mean"],
        "federated_knnper_seen": 100 * record["evaluation"]["seen"]["knnper"]["mean"],
        "max_abs_weight_diff": compared["weight_diff"],
        "max_abs_knnper_client_diff": compared["client_diff"],
        "clientapp_import_cpu_s": imports["cpu_s"],
        "clientapp_import_wall_s": imports["wall_s"],
        "load_before": load_before,
        "load_after": C.load_average(),
    }


def update_summary(results: Path, summary: dict[str, Any]) -> None:
    """Replace this tag's row in RESULTS/summary.csv (the other tags' rows kept as they are)
    and rewrite summary.md from all of them."""
    summary_path = results / "summary.csv"
    rows = []
    if summary_path.is_file():
        with open(summary_path) as f:
            rows = [r for r in csv.DictReader(f) if r["tag"] != summary["tag"]]
    rows.append(summary)
    C.write_csv(summary_path, rows, list(summary))  # this row's columns: the schema
    # the other tags' rows as written, with their types (this one, last, as measured)
    table = [*C.read_csv(summary_path, text_columns=("tag", "dataset"))[:-1], summary]
    (results / "summary.md").write_text(C.markdown_table(table, MARKDOWN) + "\n")


def main() -> None:
    args = parse_args()
    # `timeout` sends SIGTERM: let it unwind like Ctrl-C, so deploy stops every process it started
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    C.setup_logging()
    C.limit_threads(1)
    load_before = C.load_average()
    work = args.work / args.tag
    sim_dir, flower_dir = work / "simulation", work / "flower"
    record = train_both(args, sim_dir, flower_dir)
    compared = compare_runs(args, sim_dir, flower_dir, record["evaluation"])
    imports = clientapp_import_cost(args.import_repeats)
    rounds = [
        {"engine": engine, **row}
        for engine, run_dir in (("simulation", sim_dir), ("flower", flower_dir))
        for row in _rows(run_dir)
    ]
    C.write_csv(
        args.results / f"rounds_{args.tag}.csv",
        rounds,
        ("engine", "round", "clients", "seconds", "bytes_down", "bytes_up", "train_loss", "lr"),
    )
    summary = summary_row(args, rounds, record, compared, imports, load_before)
    C.write_json(
        args.results / f"{args.tag}.json",
        {
            "command": C.command_line(),
            "machine": C.machine_info(),
            "summary": summary,
            "simulation_evaluation": compared["simulation"],
            "flower_evaluation": compared["flower"],
            "federated_evaluation": record["evaluation"],
            "superlink_run": record["superlink_run"],
        },
    )
    update_summary(args.results, summary)
    print(C.markdown_table([summary], MARKDOWN))


if __name__ == "__main__":
    main()
