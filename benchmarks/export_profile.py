"""Where an export's time goes, stage by stage: `export_run` in this process (one worker, so
every stage runs here), with the exporter's stage functions wrapped to add up their wall-clock
and CPU seconds. Once for one client and once for a fleet (the weak-strong budgets of
benchmarks/export_speed.py: reference 2,000,000 bytes, delta_c 0.3, seed 0; --backend auto).

    flock /tmp/knnper-bench.lock python benchmarks/export_profile.py runs/fmnist \
        --label before --out benchmarks/results/export_profile

Stages nest (the verification inside the writing, ProtoNN's Adam steps inside its candidates):
each row names its parent, and "other" is the total minus the top-level stages. The wrappers
cost a few microseconds a call; the stages' own figures are what they are in a one-worker
export (the command's default runs the sizing in worker processes: export_speed.py times that).
Outputs in OUT: LABEL.csv (one row per scope and stage), LABEL.md, LABEL.json (the run record).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from edge_runtime import bundle as bundle_module
from experiments import benchmark_support as C
from export import client_export, exporter, quantize, sizing
from export.exporter import ExportSettings, apply_knn_choice, export_run, select_ids
from export.journal import ExportJournal
from export.profiles import weak_strong_budgets
from fed_train.knn_choice import load_or_choose
from fed_train.knn_request import KNNRequest
from fed_train.run import LoadedRun, load_run
from protonn.training import ProtoNNClassifier

FLEET = ",".join(str(i) for i in range(0, 100, 5))  # export_speed's 20-client subset

COLUMNS = ("scope", "stage", "parent", "calls", "wall_s", "cpu_s", "wall_share", "load")
TABLE = [
    ("stage", "stage", ""),
    ("parent", "inside", ""),
    ("calls", "calls", ""),
    ("wall_s", "wall s", ".2f"),
    ("cpu_s", "CPU s", ".2f"),
    ("wall_share", "share of the total", ".1%"),
]


class Stages:
    """Wall-clock and CPU seconds per stage, added up over the calls of wrapped functions."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.parent: dict[str, str] = {}
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(
        self, owner: Any, name: str, stage: str | Callable[..., str], parent: str = ""
    ) -> None:
        """Time every call of owner.name as `stage` (or the stage `stage(*args)` names)."""
        own = name in vars(owner)  # an inherited method is wrapped on `owner` and removed after
        original = vars(owner)[name] if own else getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            label = stage(*args, **kwargs) if callable(stage) else stage
            self.parent.setdefault(label, parent)
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.wall[label] += time.perf_counter() - wall
                self.cpu[label] += time.process_time() - cpu
                self.calls[label] += 1

        setattr(owner, name, timed)
        self._undo.append((owner, name, original if own else None))

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._undo.clear()

    def reset(self) -> None:
        for table in (self.wall, self.cpu, self.calls):
            table.clear()


def instrument(stages: Stages) -> None:
    """The stages of an export (issue 49's list), by the functions that do them."""
    sizer = sizing.DatastoreSizer
    stages.wrap(LoadedRun, "clients", "clients' data (run.clients)")
    stages.wrap(exporter, "calibration_inputs", "encoder: calibration inputs")
    stages.wrap(exporter, "export_onnx", "encoder: torch -> ONNX, checked against torch")
    stages.wrap(exporter, "quantize_int8", "encoder: int8 quantization")
    stages.wrap(
        quantize, "check_pair_sums", "quantization check (pair sums)", "encoder: int8 quantization"
    )
    stages.wrap(exporter, "optimize_encoder", "encoder: onnxruntime optimization")
    stages.wrap(exporter, "compare_encoders", "quantization check (int8 vs fp32)")
    stages.wrap(exporter, "model_record", "model record (weights sha256)")
    stages.wrap(exporter, "client_embeddings", "embedding (encoder on each client)")
    stages.wrap(exporter, "_personal_encoder", "personal encoder (linear base)")
    stages.wrap(sizer, "fit", "sizing (all candidates)")
    stages.wrap(
        sizer,
        "_fit_within",
        lambda self, config, *a: f"{config.backend} candidates: fit + measure",
        "sizing (all candidates)",
    )
    stages.wrap(sizer, "_protonn", "protonn candidates: train + measure", "sizing (all candidates)")
    stages.wrap(
        ProtoNNClassifier,
        "partial_fit",
        "ProtoNN training (Adam steps)",
        "protonn candidates: train + measure",
    )
    stages.wrap(
        sizer,
        "_score",
        lambda self, cand, *a: f"{cand.backend} candidates: scoring on validation",
        "sizing (all candidates)",
    )
    stages.wrap(sizing, "measure_nbytes", "measuring bytes (save to a temporary folder)", "*")
    stages.wrap(client_export, "write_bundle", "writing bundles")
    stages.wrap(bundle_module, "read_bundle", "verifying (read_bundle)", "writing bundles")
    stages.wrap(bundle_module, "signature_document", "signing", "writing bundles")
    stages.wrap(bundle_module, "sha256_file", "hashing files", "writing bundles")
    stages.wrap(ExportJournal, "add", "journal")


def profile_export(
    run: LoadedRun, clients: str, settings: ExportSettings, budgets: dict, stages: Stages
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One in-process export of `clients` into a fresh folder: its stage rows and report."""
    stages.reset()
    load = C.load_average()
    with tempfile.TemporaryDirectory(prefix="knnper-export-profile-") as out:
        wall, cpu = time.perf_counter(), time.process_time()
        report = export_run(run, out, budgets, settings, clients=clients, progress=False, workers=1)
        total_wall, total_cpu = time.perf_counter() - wall, time.process_time() - cpu
    scope = f"{len(report['clients'])} client(s)"
    rows = [
        {
            "scope": scope,
            "stage": stage,
            "parent": stages.parent[stage],
            "calls": stages.calls[stage],
            "wall_s": stages.wall[stage],
            "cpu_s": stages.cpu[stage],
        }
        for stage in stages.wall
    ]
    top = [r for r in rows if not r["parent"]]
    for stage, wall_s, cpu_s in (
        (
            "other (total minus the top-level stages)",
            total_wall - sum(r["wall_s"] for r in top),
            total_cpu - sum(r["cpu_s"] for r in top),
        ),
        ("total (export_run, one worker)", total_wall, total_cpu),
    ):
        rows.append(
            {"scope": scope, "stage": stage, "parent": "", "calls": 1}
            | {"wall_s": wall_s, "cpu_s": cpu_s}
        )
    for r in rows:
        r["wall_share"] = r["wall_s"] / total_wall
        r["load"] = load
    return rows, report


def main() -> None:
    p = C.script_parser(__doc__)
    p.add_argument("run", help="run directory written by `knnper train`")
    p.add_argument("--label", required=True, help="name of this profile (before, after...)")
    p.add_argument("--one", default="0", help="the client of the one-client profile")
    p.add_argument("--fleet", default=FLEET, help="the fleet's clients (ids like 0,5,10)")
    p.add_argument("--reference", type=int, default=2_000_000, help="weak-strong reference")
    p.add_argument("--delta-c", type=float, default=0.3, help="weak-strong delta_c")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/export_profile"))
    p.add_argument(
        "--caller-threads",
        action="store_true",
        help="leave numpy's BLAS threads as the process starts with them, as `knnper export "
        "--threads 1` does (torch keeps one thread), instead of one",
    )
    args = p.parse_args()
    if args.caller_threads:
        started, machine = time.time(), C.machine_info()
        C.setup_logging()
        torch.set_num_threads(1)
        args.out.mkdir(parents=True, exist_ok=True)
    else:
        started, machine = C.start_benchmark(args.out, threads=1)
    wall, cpu = time.perf_counter(), time.process_time()
    run = load_run(args.run)
    load_s = (time.perf_counter() - wall, time.process_time() - cpu)
    every = list(range(len(run.partition.clients)))
    budgets = weak_strong_budgets(every, args.reference, args.delta_c, seed=0)
    choice = load_or_choose(run.run_dir, run.model, run.clients(), KNNRequest(), seed=0)
    settings = apply_knn_choice(ExportSettings(), choice)
    select_ids(run.partition.unseen, args.fleet)  # a bad id fails before anything is timed
    stages = Stages()
    instrument(stages)
    rows: list[dict[str, Any]] = []
    backends: dict[str, int] = {}
    try:
        for clients in (args.one, args.fleet):
            scope_rows, report = profile_export(run, clients, settings, budgets, stages)
            rows += scope_rows
            for r in report["clients"]:
                backends[r["backend"]] = backends.get(r["backend"], 0) + (clients == args.fleet)
    finally:
        stages.restore()
    end = C.machine_info()
    blocks = [
        f"load_run: {load_s[0]:.2f} s wall, {load_s[1]:.2f} s CPU (before either export; "
        "not in the tables). Backends chosen in the fleet: "
        + ", ".join(f"{b} {n}" for b, n in sorted(backends.items()))
        + ". Load average at each export's start: "
        + ", ".join(f"{r['scope']} {r['load']:.2f}" for r in rows if r["stage"].startswith("total"))
    ]
    for scope in dict.fromkeys(r["scope"] for r in rows):
        blocks.append(
            f"### {scope}\n\n" + C.markdown_table([r for r in rows if r["scope"] == scope], TABLE)
        )
    head = C.report_head(
        f"Export profile ({args.label})",
        machine,
        end,
        "One worker, in process"
        + (", numpy's BLAS threads as the process started" if args.caller_threads else "")
        + "; wall and CPU seconds per stage, nested stages inside their "
        "parent's time ('*': inside whichever stage called it).",
    )
    C.write_results(
        args,
        started,
        C.report_text(head, *blocks),
        report=f"{args.label}.md",
        record=f"{args.label}.json",
        tables={f"{args.label}.csv": (rows, COLUMNS)},
        machine=machine,
        machine_end=end,
        load_run_s=load_s,
        median_load=statistics.median(r["load"] for r in rows),
        caller_threads=args.caller_threads,
        backends=json.loads(json.dumps(backends)),
    )


if __name__ == "__main__":
    main()
