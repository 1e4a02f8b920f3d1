"""`knnper demo`: the whole pipeline on scikit-learn's digits in about a minute. Train FedAvg on
a heterogeneous partition, evaluate FedAvg, Local and kNN-Per on the server, export bundles for
a weak and a strong device class, and run the written bundles through the device runtime.

The partition is the one where kNN-Per's gain over FedAvg was clearest on validation among those
tried (benchmarks/demo_partition.py, results in benchmarks/results/demo/): on digits with a mild
Dirichlet split the global model is already near its ceiling and local memory adds nothing."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime._io import write_text_atomic
from export.evaluation import evaluate_export, weighted_mean
from export.exporter import ExportSettings, apply_knn_choice, build_encoder, export_run
from export.profiles import uniform_budgets
from fed_train import defaults
from fed_train.knn_choice import load_or_choose
from fed_train.knn_request import KNNRequest
from fed_train.knn_setting import KNNChoice
from fed_train.run import LoadedRun, RunConfig, load_run, train
from fed_train.run_config import EVAL_METHODS
from fed_train.run_evaluation import evaluate_run

DEMO_PARTITION = {"partition": "pathological", "classes_per_client": 2}
# Room for the datastore on top of the encoder, as a share of the largest client's full float32
# flat datastore: a weak device holds an eighth of it, a strong one all of it.
DEVICE_CLASSES = {"weak": 1 / 8, "strong": 1.0}


@dataclass
class DemoSize:
    """How big the demo is; the test runs a smaller one through the same code. Digits clients
    hold about 60 samples, two SGD steps an epoch at the shared batch size: with the shared
    20 rounds of 1 epoch FedAvg stays near chance (15-41% validation accuracy,
    benchmarks/results/demo), so the demo trains 40 rounds of 5 local epochs (about 400 steps),
    with the shared learning rate, momentum, batch size and schedule."""

    clients: int = 20
    rounds: int = 40
    local_epochs: int = 5


def demo_config(size: DemoSize, seed: int = 0) -> RunConfig:
    """Digits on the demo partition with the shared optimisation defaults."""
    return RunConfig(
        dataset="digits",
        clients=size.clients,
        seed=seed,
        **DEMO_PARTITION,
        checkpoint_every=defaults.CHECKPOINT_EVERY,
        training=replace(defaults.TRAINING, rounds=size.rounds, epochs=size.local_epochs),
    )


def device_budgets(run: LoadedRun, encoder_bytes: int) -> dict[str, int]:
    """One budget per device class: the encoder plus a share of the largest client's full
    float32 datastore (embedding_dim x 4 bytes per key)."""
    largest = max(len(split.train) for split in run.partition.clients)
    full = largest * int(run.model.embedding_dim) * 4
    return {name: encoder_bytes + int(share * full) for name, share in DEVICE_CLASSES.items()}


def run_demo(
    out: Path,
    size: DemoSize | None = None,
    *,
    seed: int = 0,
    progress: bool = True,
    workers: int = 1,
    knn: KNNRequest | None = None,
) -> tuple[list[dict[str, Any]], KNNChoice]:
    """Train, evaluate, export for each device class, evaluate the bundles: the table's rows
    and kNN-Per's configuration, chosen once on validation and run by the server and every
    bundle alike.

    Parameters
    ----------
    out : the demo's folder: the run, evaluation.json and one bundles-<device> folder per
        device class.
    size : clients, rounds and local epochs (`DemoSize`); None is the documented demo.
    seed : the run's and the export's seed.
    progress : a bar on a terminal, a line every 30 s in a log.
    workers : processes that export bundles in parallel.
    knn : kNN-Per's setting and any values pinned (`KNNRequest`); None tunes it on
        validation.

    Returns
    -------
    rows : one dict per table row (the server's FedAvg, Local and kNN-Per, then each device
        class's bundles).
    choice : kNN-Per's configuration (`KNNChoice`) the server and bundles ran.
    """
    size = size or DemoSize()
    out = Path(out)
    train(demo_config(size, seed), out, progress=progress)
    run = load_run(out)
    clients = run.clients()
    choice = load_or_choose(
        run.run_dir,
        run.model,
        clients,
        knn or KNNRequest(),
        seed=run.config.seed,
        progress=progress,
    )
    server = evaluate_run(run, EVAL_METHODS, knn=knn, progress=progress)
    write_text_atomic(out / "evaluation.json", json.dumps(server, indent=2))
    rows = [
        _server_row(name, server, method)
        for name, method in (("FedAvg", "fedavg"), ("Local", "local"), ("kNN-Per", "knnper"))
    ]
    settings = apply_knn_choice(ExportSettings(seed=seed), choice)
    encoder_dir = out / "encoder"
    encoder_dir.mkdir(parents=True, exist_ok=True)
    encoder = build_encoder(run, encoder_dir, settings, clients)
    ids = list(range(len(clients)))
    for i, (device, budget) in enumerate(device_budgets(run, encoder.nbytes).items()):
        bundles = out / f"bundles-{device}"
        export_run(
            run,
            bundles,
            uniform_budgets(ids, budget),
            settings,
            encoder=encoder,
            progress=progress,
            workers=workers,
            warn_extras=i == 0,  # the same space each time: its warning once
        )
        rows.append(_device_row(device, budget, evaluate_export(run, bundles)))
    shutil.rmtree(encoder_dir)
    return rows, choice


def _server_row(name: str, result: dict[str, Any], method: str) -> dict[str, Any]:
    return {
        "method": name,
        "where": "server",
        "budget": None,
        "bundle_bytes": None,
        "seen": result["seen"][method]["mean"],
        "unseen": result["unseen"][method]["mean"] if method in result["unseen"] else None,
    }


def _device_row(device: str, budget: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    seen = [r for r in rows if not r["unseen"]]
    unseen = [r for r in rows if r["unseen"]]
    return {
        "method": "kNN-Per",
        "where": f"{device} device (runtime)",
        "budget": budget,
        "bundle_bytes": float(np.mean([r["total_bytes"] for r in rows])),
        "seen": weighted_mean(seen),
        "unseen": weighted_mean(unseen) if unseen else None,
    }


def format_demo_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: method, where it runs, budget and mean bundle size, seen / unseen accuracy."""

    def kb(value: float | None) -> str:
        return "-" if value is None else f"{value / 1000:.0f} kB"

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f}"

    lines = [
        "| method | where | budget | bundle (mean) | seen acc % | unseen acc % |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['method']} | {r['where']} | {kb(r['budget'])} | {kb(r['bundle_bytes'])} | "
        f"{pct(r['seen'])} | {pct(r['unseen'])} |"
        for r in rows
    ]
    return "\n".join(lines)
