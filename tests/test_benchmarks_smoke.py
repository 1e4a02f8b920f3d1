"""Every script under benchmarks/ runs: each prints its --help (found by glob, so a new script is
covered without a new test), and each with a smallest real case runs it end to end from a
folder outside the repository. The edge-runtime benchmarks' smoke runs also check their tables
and plot (slow-marked, they need Fashion-MNIST)."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from experiments.device_experiments import SHIFT
from fed_train.data import DEFAULT_PATHS
from fed_train.flower.expected import EXPECTED_FILE
from knnper_cli.main import main
from tests.helpers.scripts import run_as_main

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))

needs_fashion_mnist = pytest.mark.skipif(
    not DEFAULT_PATHS["fashion-mnist"].is_dir(),
    reason="Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)",
)


@dataclass(frozen=True)
class Case:
    """A script's smallest real case: its arguments, with {out} a fresh folder, {run} a finished
    one-round digits run and {copy} a copy of the committed experiment results (a script that
    rewrites results in place works on that)."""

    args: tuple[str, ...]
    slow: bool = False
    module: str | None = None  # an optional dependency the case needs
    dataset: str | None = None  # a data set the case needs installed (DEFAULT_PATHS)


CASES: dict[str, Case] = {
    "check_figures.py": Case(()),
    "table_margins.py": Case(("--check",)),
    "rule_pairs.py": Case(("--check",)),
    "split_public.py": Case(("--dataset", "digits", "--client-train", "500", "--out", "{out}")),
    "load_checks.py": Case(("--sizes", "100", "--reps", "1", "--out", "{out}")),
    "upgrade_device.py": Case(("--smoke", "--out", "{out}")),
    "upgrade_kills.py": Case(("--smoke", "--out", "{out}"), slow=True),
    "upgrade_protonn.py": Case(("--smoke", "--out", "{out}"), slow=True),
    "train_throughput.py": Case(
        (
            "--tag",
            "smoke",
            "--clients",
            "2",
            "--samples",
            "8",
            "--rounds",
            "1",
            "--threads",
            "1",
            "--cases",
            "small-cnn:seq",
            "small-cnn:2",
            "--results",
            "{out}",
        ),
        slow=True,
    ),
    "int8_scheme.py": Case(("{run}", "--out", "{out}", "--reps", "5", "--warmup", "2"), slow=True),
    "int8_form.py": Case(
        ("{run}", "--out", "{out}", "--reps", "5", "--warmup", "2", "--test-limit", "50"), slow=True
    ),
    "int8_query_accuracy.py": Case(
        ("--clients", "2", "--rounds", "1", "--out", "{out}"), slow=True
    ),
    "demo_partition.py": Case(
        ("--rounds", "1", "--out", "{out}", "--work", "{out}/work"), slow=True
    ),
    "collect_fair_table.py": Case(("{run}", "--name", "smoke", "--out", "{out}"), slow=True),
    "export_speed.py": Case(
        # two clients, one export process (no worker processes importing torch again)
        ("{run}", "--label", "smoke", "--clients", "0,1", "--workers", "1")
        + ("--out", "{out}", "--work", "{out}/work"),
        slow=True,
    ),
    "cli_start.py": Case(("--out", "{out}", "--repeats", "1"), slow=True),
    "export_profile.py": Case(
        ("{run}", "--label", "smoke", "--one", "0", "--fleet", "0,1", "--out", "{out}"), slow=True
    ),
    "knn_config_device.py": Case(
        ("--run", "{run}", "--budget", "1MB", "--out", "{out}"), slow=True
    ),
    "head_refit.py": Case(("--run", "{run}", "--smoke", "--out", "{out}"), slow=True),
    "thread_count.py": Case(
        # one shape, each a fresh process importing torch: the 3-channel one
        ("--threads", "1", "--steps", "2", "--repeats", "1", "--data", "cifar10", "--out", "{out}"),
        slow=True,
    ),
    "rejudge_experiments.py": Case(("{copy}",), slow=True),
    "lambda_rules.py": Case(
        ("--clients", "6", "--rounds", "1", "--seeds", "1", "--explain", "--out", "{out}"),
        slow=True,
    ),
    "flower_rounds.py": Case(
        (
            "--tag",
            "smoke",
            "--clients",
            "1",
            "--rounds",
            "1",
            "--import-repeats",
            "1",
            "--base",
            "global",
            "--lambda-rule",
            "client",
            "--lambda-estimator",
            "val",
            "--results",
            "{out}",
            "--work",
            "{out}/work",
        ),
        slow=True,
        module="flwr",
    ),
    "flower_floor.py": Case(
        (
            "--tag",
            "smoke",
            "--clients",
            "1",
            "--rounds",
            "1",
            "--results",
            "{out}",
            "--work",
            "{out}/work",
        ),
        slow=True,
        module="flwr",
    ),
    "flower_expected.py": Case(
        (
            "--clients",
            "2",
            "--rounds",
            "1",
            "--work",
            "{out}/work",
            "--expected",
            "{out}/expected.json",
            "--results",
            "{out}",
        ),
        slow=True,
    ),
    "paper_tables.py": Case(
        (
            "--smoke",
            "--only",
            "fashion-mnist",
            "--methods",
            "fedavg,knnper",
            "--out",
            "{out}",
            "--no-progress",
        ),
        slow=True,
        dataset="fashion-mnist",
    ),
}
# scripts whose smallest case is run by a test of its own below (which checks its tables)
OWN_TEST = {
    "runtime_latency.py",
    "runtime_memory.py",
    "distribution_shift.py",
    "runtime_scan.py",
    "runtime_start.py",
    "paper_order.py",
    "protonn_grid.py",
    "map_forms.py",  # on the releases tests/test_model_update.py's experiment writes
}


def test_every_script_has_a_case():
    assert not set(CASES) & OWN_TEST
    assert sorted({*CASES, *OWN_TEST}) == SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_prints_its_help(script, tmp_path, monkeypatch, capsys):
    """In this process (the imports are paid once): from another folder, as a user runs it."""
    assert run_as_main(BENCHMARKS / script, ["--help"], tmp_path, monkeypatch) in (0, None)
    assert "usage:" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # --help writes nothing


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A one-round digits run, trained in this process (torch is imported already)."""
    run = tmp_path_factory.mktemp("bench") / "run"
    threads = torch.get_num_threads()
    try:
        code = main(
            [
                "--no-progress",
                "--threads",
                "1",
                "train",
                "--dataset",
                "digits",
                "--clients",
                "4",
                "--rounds",
                "1",
                "--batch-size",
                "16",
                "--checkpoint-every",
                "1",
                "--out",
                str(run),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    return run


def _later_seeds(folder: str, names: list[str]) -> list[str]:
    """What a copy of the committed experiments leaves out: every experiment keeps its combined
    folder and seed_0 (each experiment's rules, on a combined and on a one-seed folder), the
    distribution shift seed_1 too (its combined plot reads the steps of more than one seed);
    the other seeds' folders run the same code on other numbers (32 folders judged become 17)."""
    kept = {"seed_0", "seed_1"} if Path(folder).name == SHIFT else {"seed_0"}
    return [n for n in names if n.startswith("seed_") and n not in kept]


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(name, marks=[pytest.mark.slow] if case.slow else [])
        for name, case in CASES.items()
    ],
)
def test_smallest_case_runs(script, tmp_path, request, monkeypatch, capsys):
    """In this process, as `python benchmarks/X.py` runs it from another folder with one
    thread (torch and the project are imported once for every case, not once a case)."""
    case = CASES[script]
    if case.module is not None:
        pytest.importorskip(case.module)
    if case.dataset is not None and not DEFAULT_PATHS[case.dataset].is_dir():
        pytest.skip(f"{case.dataset} is not installed")
    out = tmp_path / "out"
    values = {"out": str(out)}
    if any("{run}" in a for a in case.args):
        values["run"] = str(request.getfixturevalue("tiny_run"))
    if any("{copy}" in a for a in case.args):
        values["copy"] = str(tmp_path / "copy")
        shutil.copytree(
            BENCHMARKS / "results" / "experiments" / "fashion-mnist",
            tmp_path / "copy",
            ignore=_later_seeds,
        )
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    scratch = tmp_path / "tmp"  # the temporary folder, here and in what the script starts
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    shipped = EXPECTED_FILE.read_bytes()  # a file of the package a benchmark can rewrite
    code = run_as_main(
        BENCHMARKS / script, [a.format(**values) for a in case.args], elsewhere, monkeypatch
    )
    assert code in (0, None), capsys.readouterr().err[-4000:]
    if "{out}" in " ".join(case.args):
        assert any(p.is_file() for p in out.rglob("*")), "the case wrote no results"
    assert not list(elsewhere.iterdir()), "the script wrote into the folder it ran from"
    left = sorted(p.name for p in scratch.glob("knnper-*"))  # the project's own temporary folders
    assert not left, f"the script left temporary folders behind: {left}"
    assert EXPECTED_FILE.read_bytes() == shipped, "the case rewrote the package's expected.json"


@pytest.mark.slow
def test_paper_order_runs_tiny_on_the_cpu_and_resumes(tmp_path, monkeypatch, capsys, caplog):
    """The GPU-scale command at its tiny scale: every stage, both tables under both kNN-Per
    rules; run again, it skips what finished and trains and evaluates nothing. Both runs in
    this process, from another folder with one thread (torch is imported once, not twice)."""
    out = tmp_path / "out"
    argv = ["--tiny", "--device", "cpu", "--no-progress", "--out", str(out)]
    caplog.set_level(logging.INFO)  # the tables log each learning rate they train or evaluate
    first = run_as_main(BENCHMARKS / "paper_order.py", argv, tmp_path, monkeypatch)
    assert first in (0, None), capsys.readouterr().err[-4000:]
    summary = (out / "summary.md").read_text()
    assert "model mobilenet-v2-gn" in summary and "model small-cnn" in summary
    assert summary.count("| paper's rule") == 2 and summary.count("| project default") == 2
    assert all(f"| {m} |" in summary for m in ("Local", "FedAvg", "Ditto", "APFL", "pFedGP"))
    assert any(" at lr=" in r.getMessage() for r in caplog.records)  # the first run trained
    written = {p: p.stat().st_mtime_ns for p in out.rglob("*.pt")}
    caplog.clear()
    again = run_as_main(BENCHMARKS / "paper_order.py", argv, tmp_path, monkeypatch)
    assert again in (0, None), capsys.readouterr().err[-4000:]
    stages = json.loads((out / "stages.json").read_text())["stages"]
    assert stages["split"]["skipped"] and stages["pretrain"]["skipped"]
    # every method's rows came from the caches
    assert not [r.getMessage() for r in caplog.records if " at lr=" in r.getMessage()]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.pt")} == written  # nothing retrained


def _in_own_process(script: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`python benchmarks/SCRIPT ARGV` from `cwd` with one thread, which must exit 0."""
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *argv],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_protonn_grid_smoke_writes_its_tables_and_the_device_agrees(tmp_path):
    """Encoder, budget curve and ProtoNN grid at smoke size; the bundles of the device check,
    run through the runtime, give the benchmark's own accuracy."""
    out, elsewhere = tmp_path / "out", tmp_path / "cwd"
    elsewhere.mkdir()
    proc = _in_own_process("protonn_grid.py", ["--smoke", "--out", str(out)], elsewhere)
    assert "Command:" in proc.stdout and "ProtoNN grid" in proc.stdout
    assert not list(elsewhere.iterdir()), "the script wrote into the folder it ran from"
    for name in (
        "encoder.csv",
        "budget_curve.csv",
        "protonn_grid.csv",
        "clients.csv",
        "budget_curve.png",
        "protonn_grid.png",
        "results.md",
        "run.json",
    ):
        assert (out / name).stat().st_size > 0, name
    assert {r["backend"] for r in read_csv(out / "budget_curve.csv")} == {
        "flat",
        "hnsw",
        "protonn",
        "auto",
    }
    assert "Device check at 1/4" in proc.stdout
    check = json.loads((out / "run.json").read_text())["check"]
    assert check["runtime_accuracy"] == pytest.approx(check["benchmark_accuracy"], abs=1e-12)


def run_smoke(script: str, tmp_path: Path, monkeypatch, capsys, own_process=False) -> Path:
    """`python benchmarks/SCRIPT --smoke` from another folder with one thread: in this process
    (torch and onnxruntime are imported already), or in a process of its own where the script
    measures its own process."""
    out = tmp_path / "out"
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    argv = ["--smoke", "--out", str(out)]
    if own_process:
        printed = _in_own_process(script, argv, elsewhere).stdout
    else:
        code = run_as_main(BENCHMARKS / script, argv, elsewhere, monkeypatch)
        captured = capsys.readouterr()
        assert code in (0, None), captured.err[-4000:]
        printed = captured.out
    assert "Command:" in printed and "Machine:" in printed
    assert "onnxruntime 1." in printed
    assert "AVX-512 VNNI" in printed or "instruction sets unknown" in printed
    return out


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@needs_fashion_mnist
def test_latency_smoke_times_every_backend_against_torch(tmp_path, monkeypatch, capsys):
    out = run_smoke("runtime_latency.py", tmp_path, monkeypatch, capsys)
    rows = read_csv(out / "latency.csv")
    assert [r["backend"] for r in rows] == ["none", "flat", "hnsw", "protonn"]
    for row in rows:
        for key in (
            "b1_p50_ms_runtime",
            "b1_p99_ms_torch",
            "speedup_b1_p50",
            "throughput_runtime",
            "speedup_throughput",
        ):
            value = float(row[key])
            assert math.isfinite(value) and value > 0, (key, row)
        assert 0.0 <= float(row["argmax_agreement"]) <= 1.0
    assert {r["keys"] for r in rows[1:]} == {"200"}
    text = (out / "latency.md").read_text()
    assert "--smoke" in text and "| protonn |" in text
    assert (out / "run.json").is_file()


@pytest.mark.slow
@needs_fashion_mnist
def test_memory_smoke_runtime_process_is_small_and_torch_free(tmp_path, monkeypatch, capsys):
    out = run_smoke("runtime_memory.py", tmp_path, monkeypatch, capsys, own_process=True)
    rows = read_csv(out / "memory.csv")
    runtime = [r for r in rows if r["backend"]]
    assert sorted(r["backend"] for r in runtime) == ["flat", "hnsw", "protonn"]
    torch_row = next(r for r in rows if r["process"].startswith("torch small CNN"))
    for row in runtime:
        assert row["server_side_imported"] == "none"
        # a fresh process's own peak, not the parent's (which held torch and the data)
        assert 0 < float(row["peak_rss_mib"]) < float(torch_row["peak_rss_mib"])
    assert "torch" in torch_row["server_side_imported"]
    assert (out / "memory.md").read_text().count("edge runtime loads bundle") == 3


@pytest.mark.slow
@needs_fashion_mnist
def test_distribution_shift_smoke_updates_each_copy_by_its_strategy(tmp_path, monkeypatch, capsys):
    out = run_smoke("distribution_shift.py", tmp_path, monkeypatch, capsys)
    rows = read_csv(out / "steps.csv")
    steps, batch, clients = 4, 8, 2
    assert len(rows) == clients * steps * 4
    for client in {r["client"] for r in rows}:

        def sizes(strategy: str, client: str = client) -> list[int]:
            return [
                int(r["datastore_size"])
                for r in rows
                if r["client"] == client and r["strategy"] == strategy
            ]

        assert len(set(sizes("fixed"))) == 1
        assert len(set(sizes("fifo"))) == 1  # full at export: each batch evicts as many
        grown = sizes("concatenate")
        assert grown == [grown[0] + batch * t for t in range(steps)]
    curve = read_csv(out / "curve.csv")
    assert {r["strategy"] for r in curve} == {"fifo", "concatenate", "fixed", "global (lambda=0)"}
    assert all(0.0 <= float(r["mean_accuracy"]) <= 1.0 for r in curve)
    assert (out / "shift.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "shift.png" in (out / "shift.md").read_text()


@pytest.mark.slow
@needs_fashion_mnist
def test_scan_smoke_measures_every_key_dtype_against_memory_speed(tmp_path, monkeypatch, capsys):
    out = run_smoke("runtime_scan.py", tmp_path, monkeypatch, capsys)
    rows = read_csv(out / "scan.csv")
    assert {r["dtype"] for r in rows} == {"fp32", "fp16", "int8"}
    by_dtype = {r["dtype"]: r for r in rows}
    assert float(by_dtype["int8"]["bytes_vs_fp32"]) == 0.25
    assert all(float(r["memory_gb_s"]) > 0 and float(r["scan_ms"]) > 0 for r in rows)
    assert read_csv(out / "topk.csv")


@pytest.mark.slow
@needs_fashion_mnist
def test_start_smoke_times_start_and_batch_one(tmp_path, monkeypatch, capsys):
    out = run_smoke("runtime_start.py", tmp_path, monkeypatch, capsys)
    starts = read_csv(out / "start.csv")
    assert [r["encoder"] for r in starts] == ["optimized at export", "not optimized"]
    assert all(float(r["spawn_to_first_ms"]) > float(r["load_ms"]) > 0 for r in starts)
    assert all(float(r["ratio"]) > 0 for r in read_csv(out / "batch1.csv"))
