"""The export budget-curve benchmark runs end to end at smoke size from another directory."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "export_budget_curve.py"


@pytest.mark.slow
def test_budget_curve_smoke_writes_tables_and_plots(tmp_path):
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Command:" in proc.stdout and "ProtoNN grid" in proc.stdout
    for name in ("encoder.csv", "budget_curve.csv", "protonn_grid.csv", "clients.csv",
                 "budget_curve.png", "protonn_grid.png", "results.md", "run.json"):
        assert (out / name).stat().st_size > 0, name
    with open(out / "budget_curve.csv", newline="") as f:
        curve = list(csv.DictReader(f))
    assert {r["backend"] for r in curve} == {"flat", "hnsw", "protonn", "auto"}
    assert "Device check at 1/4" in proc.stdout
    # What the device computes from the written bundles equals the benchmark's number.
    check = json.loads((out / "run.json").read_text())["check"]
    assert check["runtime_accuracy"] == pytest.approx(check["benchmark_accuracy"], abs=1e-12)
