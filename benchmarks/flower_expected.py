"""What a `knnper deploy local` run of a given size is expected to reach, measured: FedAvg and
kNN-Per accuracies of the in-process simulation (Flower reaches the same weights bit for bit,
BENCHMARKS.md) at a few sizes of the default settings, with seconds per round of the training
alone. `deploy local` prints the measured size nearest to the user's run.

Writes fed_train/flower/expected.json (shipped with the package; --expected writes elsewhere)
and benchmarks/results/flower/expected.md (--results). Resumable: each size's run directory is
kept in --work.

    python benchmarks/flower_expected.py --dataset digits --clients 5 10 20 --rounds 5 20
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from experiments import benchmark_support as C
from fed_train import defaults
from fed_train.flower.expected import EXPECTED_FILE, MEASURED
from fed_train.run import RunConfig, load_run, train
from fed_train.run_evaluation import evaluate_run

RESULTS = C.REPO / "benchmarks" / "results" / "flower"


def measure(config: RunConfig, work: Path) -> dict:
    path = work / f"{config.dataset}-c{config.clients}-r{config.training.rounds}"
    started = time.perf_counter()
    train(config, path, progress=False)
    seconds = time.perf_counter() - started
    rounds = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    result = evaluate_run(load_run(path), list(MEASURED), progress=False)
    return {
        "config": config.to_dict(),
        "seconds_per_round": round(sum(r["seconds"] for r in rounds) / len(rounds), 3),
        "wall_seconds": round(seconds, 1),
        **{
            f"{m}_{group}": round(100 * result[group][m]["mean"], 1)
            for m in MEASURED
            for group in ("seen", "unseen")
            if m in result[group]
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="digits")
    p.add_argument("--data", default=None)
    p.add_argument("--clients", type=int, nargs="+", default=[5, 10, 20])
    p.add_argument("--rounds", type=int, nargs="+", default=[5, 20])
    p.add_argument("--work", type=Path, default=Path("runs/flower-expected"))
    p.add_argument(
        "--expected",
        type=Path,
        default=EXPECTED_FILE,
        help="the JSON `deploy local` reads (default: the package's own)",
    )
    p.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="folder for expected.md (default: benchmarks/results/flower)",
    )
    args = p.parse_args()
    C.setup_logging()
    C.limit_threads(1)
    start = C.machine_info()
    runs = [
        measure(
            RunConfig(
                dataset=args.dataset,
                data=args.data,
                clients=c,
                training=replace(defaults.TRAINING, rounds=r),
            ),
            args.work,
        )
        for c in args.clients
        for r in args.rounds
    ]
    record = {
        "command": C.command_line(),
        "machine": start,
        "source": "benchmarks/flower_expected.py",
        "runs": runs,
    }
    old = json.loads(args.expected.read_text())["runs"] if args.expected.is_file() else []
    kept = [r for r in old if r["config"]["dataset"] != args.dataset]
    record["runs"] = kept + runs
    C.write_json(args.expected, record)
    rows = [
        {
            "dataset": r["config"]["dataset"],
            "clients": r["config"]["clients"],
            "rounds": r["config"]["training"]["rounds"],
            **{k: v for k, v in r.items() if k != "config"},
        }
        for r in record["runs"]
    ]
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "expected.md").write_text(
        f"`{record['command']}`\n\n{C.machine_line(start)}\n\n"
        + C.markdown_table(rows, [(k, k, "") for k in rows[0]])
        + "\n"
    )
    print((args.results / "expected.md").read_text())


if __name__ == "__main__":
    main()
