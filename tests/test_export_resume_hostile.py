"""An export folder is shared and hostile: one export at a time writes into an --out, a resume
re-verifies every bundle it would skip (and rebuilds what was replaced, resigned or re-budgeted),
and a tampered journal row never reaches export.json."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cryptography")

import knnper_cli.main as export_cli  # noqa: E402
from edge_runtime.locking import directory_lock  # noqa: E402
from edge_runtime.release import RELEASE_FILE  # noqa: E402
from edge_runtime.runtime import Runtime  # noqa: E402
from edge_runtime.signing import SIGNATURE_FILE, generate_key_pair, load_public_key  # noqa: E402
from export.exporter import JOURNAL_FILE  # noqa: E402
from fed_train.algorithms.base import TrainingConfig  # noqa: E402
from fed_train.run import RunConfig, train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hostile-export") / "run"
    train(
        RunConfig(
            dataset="digits",
            clients=3,
            seed=0,
            training=TrainingConfig(rounds=1, epochs=1, batch_size=32),
        ),
        path,
        progress=False,
    )
    generate_key_pair(path.parent / "key.pem", path.parent / "key.pub")
    return path


def _export(run_dir: Path, out: Path, budget: str = "2M", *extra: str) -> list[str]:
    return [
        "--no-progress",
        "export",
        str(run_dir),
        "--out",
        str(out),
        "--budget",
        budget,
        "--backend",
        "flat",
        "--clients",
        "0,1",
        "--workers",
        "1",
        *extra,
    ]


def _consistent(out: Path, trusted=None) -> dict:
    """export.json describes every bundle it lists, and each one verifies."""
    report = json.loads((out / RELEASE_FILE).read_text())
    for row in report["clients"]:
        rt = Runtime.load(out / row["bundle"], trusted_keys=trusted)
        assert rt.manifest.budget.total == row["budget"]
        assert rt.manifest.footprint.total == row["total_bytes"]
        assert rt.manifest.recipe == row["recipe"]
    return report


def test_an_export_into_a_folder_another_export_holds_is_refused(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    with directory_lock(out, exclusive=True):
        assert export_cli.main(_export(run_dir, out)) == 2
    err = capsys.readouterr().err
    assert "in use by another export" in err and err.count("\n") == 1
    assert not (out / RELEASE_FILE).exists()


def test_two_exports_into_one_folder_never_mix(run_dir, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "knnper_cli.main", *_export(run_dir, out, b)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for b in ("2M", "3M")
    ]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    codes = sorted(code for code, _ in results)
    assert codes in ([0, 0], [0, 2]), results
    for code, err in results:
        assert code == 0 or ("in use by another export" in err and "Traceback" not in err)
    report = _consistent(out)
    assert len({row["budget"] for row in report["clients"]}) == 1  # one export's bundles only


def test_resume_rebuilds_every_tampered_bundle_and_journal_row(run_dir, tmp_path, capsys):
    key, trusted = run_dir.parent / "key.pem", [load_public_key(run_dir.parent / "key.pub")]
    out, other = tmp_path / "out", tmp_path / "other"
    assert export_cli.main(_export(run_dir, out, "2M", "--signing-key", str(key))) == 0
    assert export_cli.main(_export(run_dir, other, "3M", "--clients", "0")) == 0
    # client 0: replaced by an unsigned bundle of another budget
    shutil.rmtree(out / "client_0000")
    shutil.copytree(other / "client_0000", out / "client_0000")
    # client 1: signature removed; and its journal row edited
    (out / "client_0001" / SIGNATURE_FILE).unlink()
    lines = (out / JOURNAL_FILE).read_text().splitlines()
    rows = [json.loads(line) for line in lines[1:]]
    for row in rows:
        if row["client_id"] == 1:
            row.update(backend="evil", total_bytes=-1)
    (out / JOURNAL_FILE).write_text("\n".join([lines[0], *map(json.dumps, rows)]) + "\n")
    capsys.readouterr()
    assert export_cli.main(_export(run_dir, out, "2M", "--signing-key", str(key))) == 0
    report = _consistent(out, trusted)
    assert {row["backend"] for row in report["clients"]} == {"flat"}
    assert all(row["budget"] == 2_000_000 for row in report["clients"])
    # a clean resume skips both, and still describes them
    assert export_cli.main(_export(run_dir, out, "2M", "--signing-key", str(key))) == 0
    assert _consistent(out, trusted)["clients"] == report["clients"]


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_no_temporary(
    run_dir, tmp_path, capsys, monkeypatch
):
    import errno

    from edge_runtime import _io

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_io.os, "fsync", full)
    out = tmp_path / "out"
    capsys.readouterr()
    assert export_cli.main(_export(run_dir, out)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith(("INFO", "WARNING"))]
    assert len(lines) == 1 and "No space left on device" in lines[0], err
    assert not [p.name for p in out.rglob("*") if ".tmp" in p.name]


def test_a_petabyte_budget_exports_and_loads_without_allocating_it(run_dir, tmp_path):
    """The verifier used to read each file with f.read(budget + 1): a MemoryError at 1e15."""
    out = tmp_path / "out"
    assert export_cli.main(_export(run_dir, out, "1PB")) == 0
    report = _consistent(out)
    assert {row["budget"] for row in report["clients"]} == {10**15}


def test_resume_rebuilds_another_models_bundle_whose_row_was_rewritten_to_match(
    run_dir, tmp_path, caplog
):
    """Every field of the row and the manifest matches this export's: only the encoder is
    another model's, and that alone must send the bundle back to be rebuilt."""
    import logging

    from edge_runtime._io import sha256_file

    other_run = tmp_path / "other-run"
    train(
        RunConfig(
            dataset="digits",
            clients=3,
            seed=0,
            training=TrainingConfig(rounds=1, epochs=1, batch_size=32, lr=0.02),
        ),
        other_run,
        progress=False,
    )
    out, other = tmp_path / "out", tmp_path / "other"
    assert export_cli.main(_export(run_dir, out)) == 0
    assert export_cli.main(_export(other_run, other)) == 0
    assert sha256_file(out / "encoder.onnx") != sha256_file(other / "encoder.onnx")
    shutil.rmtree(out / "client_0000")
    shutil.copytree(other / "client_0000", out / "client_0000")
    lines = (out / JOURNAL_FILE).read_text().splitlines()
    theirs = {
        json.loads(line)["client_id"]: line
        for line in (other / JOURNAL_FILE).read_text().splitlines()[1:]
    }
    rows = [theirs[0] if json.loads(line)["client_id"] == 0 else line for line in lines[1:]]
    (out / JOURNAL_FILE).write_text("\n".join([lines[0], *rows]) + "\n")
    with caplog.at_level(logging.WARNING):
        assert export_cli.main(_export(run_dir, out)) == 0
    assert "its encoder is not this export's" in caplog.text
    assert Runtime.load(out / "client_0000").manifest.files["encoder.onnx"] == sha256_file(
        out / "encoder.onnx"
    )
    _consistent(out)
