"""The edge-runtime benchmarks run end to end at smoke size, from a directory outside the
repository, and write their tables and plot (they are slow-marked but stay in the default run)."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fed_train.data import DEFAULT_PATHS

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not DEFAULT_PATHS["fashion-mnist"].is_dir(),
                       reason="Fashion-MNIST is not installed (apt-get install "
                              "dataset-fashion-mnist)"),
]


def run_smoke(script: str, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke", "--out", str(out)],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Command:" in proc.stdout and "Machine:" in proc.stdout
    assert "onnxruntime 1." in proc.stdout
    assert "AVX-512 VNNI" in proc.stdout or "instruction sets unknown" in proc.stdout
    return out


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_latency_smoke_times_every_backend_against_torch(tmp_path):
    out = run_smoke("runtime_latency.py", tmp_path)
    rows = read_csv(out / "latency.csv")
    assert [r["backend"] for r in rows] == ["none", "flat", "hnsw", "protonn"]
    for row in rows:
        for key in ("b1_p50_ms_runtime", "b1_p99_ms_torch", "speedup_b1_p50",
                    "throughput_runtime", "speedup_throughput"):
            value = float(row[key])
            assert math.isfinite(value) and value > 0, (key, row)
        assert 0.0 <= float(row["argmax_agreement"]) <= 1.0
    assert {r["keys"] for r in rows[1:]} == {"200"}
    text = (out / "latency.md").read_text()
    assert "--smoke" in text and "| protonn |" in text
    assert (out / "run.json").is_file()


def test_memory_smoke_runtime_process_is_small_and_torch_free(tmp_path):
    out = run_smoke("runtime_memory.py", tmp_path)
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


def test_distribution_shift_smoke_updates_each_copy_by_its_strategy(tmp_path):
    out = run_smoke("distribution_shift.py", tmp_path)
    rows = read_csv(out / "steps.csv")
    steps, batch, clients = 4, 8, 2
    assert len(rows) == clients * steps * 4
    for client in {r["client"] for r in rows}:
        def sizes(strategy: str, client: str = client) -> list[int]:
            return [int(r["datastore_size"]) for r in rows
                    if r["client"] == client and r["strategy"] == strategy]

        assert len(set(sizes("fixed"))) == 1
        assert len(set(sizes("fifo"))) == 1  # full at export: each batch evicts as many
        grown = sizes("concatenate")
        assert grown == [grown[0] + batch * t for t in range(steps)]
    curve = read_csv(out / "curve.csv")
    assert {r["strategy"] for r in curve} == {"fifo", "concatenate", "fixed",
                                              "global (lambda=0)"}
    assert all(0.0 <= float(r["mean_accuracy"]) <= 1.0 for r in curve)
    assert (out / "shift.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "shift.png" in (out / "shift.md").read_text()


def test_scan_smoke_measures_every_key_dtype_against_memory_speed(tmp_path):
    out = run_smoke("runtime_scan.py", tmp_path)
    rows = read_csv(out / "scan.csv")
    assert {r["dtype"] for r in rows} == {"fp32", "fp16", "int8"}
    by_dtype = {r["dtype"]: r for r in rows}
    assert float(by_dtype["int8"]["bytes_vs_fp32"]) == 0.25
    assert all(float(r["memory_gb_s"]) > 0 and float(r["scan_ms"]) > 0 for r in rows)
    assert read_csv(out / "topk.csv")


def test_start_smoke_times_start_and_batch_one(tmp_path):
    out = run_smoke("runtime_start.py", tmp_path)
    starts = read_csv(out / "start.csv")
    assert [r["encoder"] for r in starts] == ["optimized at export", "not optimized"]
    assert all(float(r["spawn_to_first_ms"]) > float(r["load_ms"]) > 0 for r in starts)
    assert all(float(r["ratio"]) > 0 for r in read_csv(out / "batch1.csv"))
