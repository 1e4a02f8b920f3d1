"""Every benchmark result names the CPU it was measured on: its model, the vector instruction
sets the runtime's kernels run at (AVX2, AVX-512 VNNI, AMX) and the onnxruntime version."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import shutil
from pathlib import Path

import onnxruntime
import pytest

from experiments import benchmark_support as C


def test_machine_line_names_model_instruction_sets_and_onnxruntime():
    info = {
        "cpu_model": "Some CPU",
        "lscpu_cpus": "2",
        "cpus_usable": 2,
        "python": "3.11",
        "onnxruntime": "9.9.9",
        "cpu_features": {"AVX2": True, "AVX-512 VNNI": True, "AVX-VNNI": False, "AMX": False},
    }
    line = C.machine_line(info)
    assert line.startswith("Some CPU, 2 CPUs")
    assert "AVX2 yes, AVX-512 VNNI yes, AVX-VNNI no, AMX no; onnxruntime 9.9.9" in line
    assert "instruction sets unknown" in C.machine_line({**info, "cpu_features": None})


@pytest.mark.skipif(shutil.which("lscpu") is None, reason="needs lscpu")
def test_machine_info_reads_this_cpus_flags_and_onnxruntime():
    info = C.machine_info()
    assert info["onnxruntime"] == onnxruntime.__version__
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    assert info["cpu_features"]["AVX2"] == ("avx2" in flags)
    assert info["cpu_features"]["AVX-512 VNNI"] == ("avx512_vnni" in flags)


def test_export_speed_rewrites_a_file_written_before_the_machine_column(tmp_path):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "export_speed.py"
    spec = importlib.util.spec_from_file_location("export_speed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "speed.csv"
    old_columns = [c for c in module.SUMMARY if c != "machine"]
    out.write_text(",".join(old_columns) + "\n" + ",".join("1" for _ in old_columns) + "\n")
    module._append(out, [{"label": "new", "machine": "Some CPU"}], module.SUMMARY)
    module._append(out, [{"label": "newer"}], module.SUMMARY)
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["label"] for r in rows] == ["1", "new", "newer"]
    assert [r["machine"] for r in rows] == ["", "Some CPU", ""]


def test_a_benchmark_starts_with_the_machine_and_records_its_flags(tmp_path, monkeypatch):
    # this test process keeps its own logging and thread counts
    monkeypatch.setattr(C, "setup_logging", lambda: None)
    monkeypatch.setattr(C, "limit_threads", lambda threads: None)
    out = tmp_path / "out" / "nested"
    started, machine = C.start_benchmark(out, threads=1)
    assert out.is_dir() and machine["onnxruntime"] == onnxruntime.__version__
    args = argparse.Namespace(out=out, sizes=[1, 2], smoke=True)
    record = C.run_record(args, started, machine=machine, weights="random")
    assert list(record) == ["command", "machine", "weights", "settings", "seconds"]
    assert record["settings"] == {"out": str(out), "sizes": [1, 2], "smoke": True}
    assert record["seconds"] >= 0
