"""Export wall time, clients per minute and the test accuracy of the chosen bundles, for one
version of the exporter: runs `knnper export` (from `--code`, a source tree, by default this
one) on a run with weak-strong budgets drawn for every client of the run, then evaluates the
written bundles through the device runtime with this tree's code. Comparing two source trees
(before / after a change) on the same clients and budgets is a like-for-like comparison.

    python benchmarks/export_speed.py runs/fmnist --label after --clients all \
        --out benchmarks/results/export --work runs/bench/export_speed

Appends one summary row to OUT/speed.csv and the per-client rows to OUT/speed_clients.csv.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from experiments import benchmark_support as C
from export.evaluation import evaluate_export, weighted_mean
from export.exporter import select_ids
from export.profiles import weak_strong_budgets
from fed_train.run import load_run

SUMMARY = tuple(
    (
        "label clients workers search threads_env wall_s cpu_s clients_per_min test_accuracy "
        "protonn_share load_before load_after machine command"
    ).split()
)
PER_CLIENT = tuple(
    (
        "label client_id unseen budget backend recipe total_bytes val_accuracy test_accuracy "
        "test_samples"
    ).split()
)


def _append(path: Path, rows: list[dict], columns: tuple[str, ...]) -> None:
    """Append rows; a file written before a column was added is rewritten with it (blank in
    its old rows), so every row stays under its own header."""
    old: list[dict] = []
    mode = "a" if path.exists() else "w"
    if path.exists():
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if tuple(reader.fieldnames or ()) != columns:
                old, mode = list(reader), "w"
    with open(path, mode, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        if mode == "w":
            writer.writeheader()
        writer.writerows(old + rows)


def parse_args() -> argparse.Namespace:
    p = C.script_parser(__doc__)
    p.add_argument("run", help="run directory written by `knnper train`")
    p.add_argument("--label", required=True, help="name of this measurement (before, after...)")
    p.add_argument("--clients", default="all", help="all, or ids like 0,10,20")
    p.add_argument(
        "--code", type=Path, default=C.REPO, help="source tree whose `knnper export` is timed"
    )
    p.add_argument(
        "--reference", type=int, default=2_000_000, help="weak-strong reference budget in bytes"
    )
    p.add_argument(
        "--delta-c",
        type=float,
        default=0.3,
        help="weak devices get (1/2 - D), strong ones (1/2 + D) of the reference",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="--workers for `knnper export` (None: the version's default)",
    )
    p.add_argument(
        "--pruned-search", action="store_true", help="pass --pruned-search to `knnper export`"
    )
    p.add_argument(
        "--caller-threads",
        action="store_true",
        help="time the command in this environment, as a user runs it, instead of with "
        "OMP_NUM_THREADS=1 (numpy's BLAS then starts a thread per core in every process)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/results/export"),
        help="folder for speed.csv and speed_clients.csv",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=Path("runs/bench/export_speed"),
        help="folder for the bundles and the budget file",
    )
    return p.parse_args()


def export_command(
    args: argparse.Namespace, work: Path, budgets: Path, ids: list[int]
) -> list[str]:
    """The timed `knnper export` of `ids` into WORK/bundles, under the budgets file."""
    command = [
        sys.executable,
        "-m",
        "knnper_cli.main",
        "--threads",
        "1",
        "--no-progress",
        "export",
        str(Path(args.run).resolve()),
        "--out",
        str(work.resolve() / "bundles"),
        "--budgets",
        str(budgets.resolve()),
        "--clients",
        ",".join(map(str, ids)),
    ]
    if args.workers is not None:
        command += ["--workers", str(args.workers)]
    if args.pruned_search:
        command.append("--pruned-search")
    return command


def main() -> None:
    args = parse_args()
    C.setup_logging()
    run = load_run(args.run)
    work = args.work / args.label
    work.mkdir(parents=True, exist_ok=True)
    every = list(range(len(run.partition.clients)))
    budgets_file = args.work / "budgets.json"
    budgets = weak_strong_budgets(every, args.reference, args.delta_c, seed=0)
    budgets_file.write_text(json.dumps({str(k): v.total for k, v in budgets.items()}))
    ids = select_ids(run.partition.unseen, args.clients)
    command = export_command(args, work, budgets_file, ids)
    env = {**os.environ, "PYTHONPATH": str(args.code.resolve())}
    if not args.caller_threads:
        env["OMP_NUM_THREADS"] = "1"
    load = os.getloadavg()[0]
    start, children = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, check=True, env=env, cwd=args.code, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    done = resource.getrusage(resource.RUSAGE_CHILDREN)  # the command and its workers
    cpu = done.ru_utime + done.ru_stime - children.ru_utime - children.ru_stime
    load_after = os.getloadavg()[0]
    rows = evaluate_export(run, work / "bundles")
    per_client = [{**r, "label": args.label} for r in rows]
    summary = {
        "label": args.label,
        "clients": len(rows),
        "workers": args.workers,
        "search": "pruned" if args.pruned_search else "exhaustive",
        "threads_env": env.get("OMP_NUM_THREADS", ""),
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "clients_per_min": round(60 * len(rows) / wall, 2),
        "test_accuracy": round(weighted_mean(rows), 5),
        "protonn_share": round(sum(r["backend"] == "protonn" for r in rows) / len(rows), 3),
        "load_before": round(load, 2),
        "load_after": round(load_after, 2),
        "machine": C.machine_line(C.machine_info()),
        "command": C.command_line(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    _append(args.out / "speed.csv", [summary], SUMMARY)
    _append(args.out / "speed_clients.csv", per_client, PER_CLIENT)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
