"""Flower's floor under knnper's rounds: the same federation, configuration and weights as
flower_rounds.py, but every SuperNode runs an empty ClientApp (benchmarks/flower_floor: it
imports flwr only and echoes the weights). Its seconds per round are Flower's own cost (a
process per message, polling, transport); flower_rounds.py's minus these are ours.

Writes RESULTS/floor_TAG.json (per-round seconds, the command and the machine).

    python benchmarks/flower_floor.py --tag digits-10 --dataset digits --clients 10 --rounds 3
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path

import numpy as np

from experiments import benchmark_support as C
from fed_train.deploy import LocalFederation, deploy_local
from fed_train.flower.settings import FlowerSettings

log = logging.getLogger("benchmarks.flower_floor")
APP_DIR = Path(__file__).resolve().parent / "flower_floor"


def main() -> None:
    p = C.flower_parser(__doc__)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` stops the federation
    C.setup_logging()
    load_before = C.load_average()
    run_dir = args.work / args.tag / "floor"
    settings = FlowerSettings(
        run=C.flower_run_config(args),
        run_dir=str(run_dir),
        round_timeout=args.round_timeout,
        connect_timeout=600.0,
    )
    start = time.perf_counter()
    deploy_local(
        settings, LocalFederation(clients=args.clients, startup_timeout=120.0, app_dir=APP_DIR)
    )
    log.info("floor run done in %.0f s", time.perf_counter() - start)
    rounds = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    summary = {
        "tag": args.tag,
        "clients": args.clients,
        "rounds": args.rounds,
        "floor_s_per_round": float(np.mean([r["seconds"] for r in rounds])),
        "load_before": load_before,
        "load_after": C.load_average(),
    }
    C.write_json(
        args.results / f"floor_{args.tag}.json",
        {
            "command": C.command_line(),
            "machine": C.machine_info(),
            "summary": summary,
            "rounds": rounds,
        },
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
