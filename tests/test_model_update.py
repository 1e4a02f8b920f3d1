"""A model update end to end at digits scale: two trainings from one pretraining (whose server
split is the only data the key map sees), two exports, the second with --upgrade-from the first,
and devices upgrading their bundles with `knnper-edge upgrade`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from edge_runtime.cli import main as edge
from edge_runtime.keymap import load_key_map
from edge_runtime.runtime import Runtime
from knnper_cli.main import main
from tests.helpers.scripts import run_as_main

pytestmark = pytest.mark.slow


def knnper(*argv: str) -> int:
    return main(["--threads", "1", "--no-progress", *argv])


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("update")
    assert (
        knnper(
            "pretrain",
            "--dataset",
            "digits",
            "--server-fraction",
            "0.2",
            "--epochs",
            "2",
            "--out",
            str(root / "pre"),
        )
        == 0
    )
    for name, seed in (("v1", "0"), ("v2", "1")):
        assert (
            knnper(
                "train",
                "--init",
                str(root / "pre"),
                "--clients",
                "4",
                "--rounds",
                "2",
                "--seed",
                seed,
                "--out",
                str(root / name),
            )
            == 0
        )
    assert (
        knnper(
            "export",
            str(root / "v1"),
            "--out",
            str(root / "b1"),
            "--budget",
            "200kB",
            "--workers",
            "1",
            "--device-extras",
            "none",
        )
        == 0
    )
    assert (
        knnper(
            "export",
            str(root / "v2"),
            "--out",
            str(root / "b2"),
            "--budget",
            "200kB",
            "--workers",
            "1",
            "--device-extras",
            "none",
            "--upgrade-from",
            str(root / "b1"),
        )
        == 0
    )
    return root


def test_release_ships_a_map_with_its_evidence(releases):
    maps = list((releases / "b2" / "upgrades").glob("from-*.npz"))
    assert len(maps) == 1
    evidence = json.loads(maps[0].with_suffix(".json").read_text())
    assert evidence["fit_samples"] > 0 and evidence["alpha"] in (
        1e-4,
        1e-3,
        1e-2,
        0.1,
        1.0,
        10.0,
        100.0,
    )
    assert set(evidence["evidence_knn_accuracy"]) == {"mapped", "stale", "re-embedded", "global"}
    cv = evidence["cv"]  # every candidate form's cross-validated scores; the chosen one is best
    assert cv[evidence["form"]]["knn_accuracy"] == max(s["knn_accuracy"] for s in cv.values())
    assert 0 <= evidence["reverse"]["evidence_knn_accuracy_queries_mapped_back"] <= 1
    assert load_key_map(maps[0]).reverse_weight is not None  # what a protonn bundle folds
    report = json.loads((releases / "b2" / "export.json").read_text())
    old = json.loads((releases / "b1" / "export.json").read_text())
    assert report["replaces"] == old["model"] and report["model"]["run"] == "v2"
    manifest = json.loads((releases / "b2" / "client_0000" / "manifest.json").read_text())
    assert manifest["replaces"] == old["model"]


def test_device_upgrade_keeps_its_samples(releases, tmp_path, capsys):
    device = tmp_path / "device"
    shutil.copytree(releases / "b1" / "client_0000", device)
    rt = Runtime.load(device)
    protonn = rt.manifest.backend == "protonn"  # its buffer is what it learned
    x = np.random.default_rng(0).integers(0, 17, (5, 8, 8, 1)).astype(np.uint8)
    rt.add(x, np.arange(5) % 10)
    labels = (rt.datastore.buffer_labels_ if protonn else rt.datastore.labels_).copy()
    assert (
        edge(["upgrade", str(device), "--to", str(releases / "b2" / "client_0000"), "--force"]) == 0
    )
    assert ("carried (buffered" if protonn else "carried (mapped)") in capsys.readouterr().out
    after = Runtime.load(device)
    kept = after.datastore.buffer_labels_ if protonn else after.datastore.labels_
    np.testing.assert_array_equal(kept, labels[len(labels) - len(kept) :])
    assert after.manifest.model.run == "v2"


def test_training_continues_from_a_finished_run_and_records_it(releases, tmp_path):
    out = tmp_path / "v1b"
    assert (
        knnper(
            "train",
            "--continue-from",
            str(releases / "v1"),
            "--clients",
            "4",
            "--rounds",
            "1",
            "--out",
            str(out),
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert config["continue_from"] == str((releases / "v1").resolve())
    assert "init" not in config and config["init_sha256"]
    assert (
        knnper(
            "export",
            str(out),
            "--out",
            str(tmp_path / "b"),
            "--budget",
            "200kB",
            "--workers",
            "1",
            "--device-extras",
            "none",
            "--upgrade-from",
            str(releases / "b1"),
        )
        == 0
    )  # the key map finds v1's pretraining split
    report = json.loads((tmp_path / "b" / "export.json").read_text())
    assert report["continues"] == config["continue_from"]
    assert list((tmp_path / "b" / "upgrades").glob("from-*.npz"))
    assert (
        knnper(
            "train",
            "--continue-from",
            str(releases / "v1"),
            "--init",
            str(releases / "pre"),
            "--out",
            str(tmp_path / "both"),
        )
        == 2
    )


def test_model_update_experiment_writes_its_report(tmp_path, monkeypatch, capsys):
    import csv

    assert knnper("experiment", "model-update", "--quick", "--out", str(tmp_path)) == 0
    folder = tmp_path / "model-update"
    with open(folder / "clients.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["path"] for r in rows} == {"no upgrade", "stale", "mapped", "exact", "fresh"}
    assert {r["gap"] for r in rows} == {"continued", "retrained", "independent"}
    assert all(0 <= float(r["knn_accuracy"]) <= 1 for r in rows)
    # the independent gap: a second pretraining on the very same server split from other
    # weights, so its run trains on v1's clients sample for sample, and its release is an
    # upgrade a device accepts (the key map fitted on that split)
    seed_dir = folder / "seed_0"
    pre, other = (
        json.loads((seed_dir / d / "pretrain.json").read_text()) for d in ("pre", "pre-independent")
    )
    assert (pre["seed"], pre["weights_seed"]) == (0, None) and other["seed"] == 0
    assert other["weights_seed"] not in (None, 0)
    np.testing.assert_array_equal(
        *(np.load(seed_dir / d / "server_indices.npy") for d in ("pre", "pre-independent"))
    )
    v1, independent = (
        json.loads((seed_dir / d / "config.json").read_text()) for d in ("v1", "independent")
    )
    assert v1["data_sha256"] == independent["data_sha256"]
    assert v1["init_sha256"] != independent["init_sha256"]
    assert list((seed_dir / "b-independent" / "upgrades").glob("from-*.npz"))
    # every successor runs v1's normalisation; stale is mixed with the mapped bundle's lambda
    assert {r["normalize"] for r in rows} == {r["v1_normalize"] for r in rows}
    lam = {(r["gap"], r["client"], r["path"]): r["lam"] for r in rows}
    assert all(lam[g, c, "stale"] == lam[g, c, "mapped"] for g, c, _ in lam)
    assert (folder / "model_update.png").read_bytes().startswith(b"\x89PNG")
    summary = (folder / "summary.md").read_text()
    assert "mapped within 0.5 pp of exact" in summary and "Clients hurt" in summary
    assert "independent: recovers >= 80% of what stale keys lose" in summary
    # the distribution-shift stream was added (4 batches of 10) and kept: stale, mapped and
    # exact were scored on the same stored samples, the train split and the stream
    assert {int(r["added"]) for r in rows} == {40}
    assert all(int(r["stored"]) == int(r["train"]) + 40 for r in rows)
    assert all(int(r["test_samples"]) == 60 for r in rows)
    # a finished seed is read back, not measured again; other flags are refused before
    # anything is trained
    before = (folder / "seed_0" / "rows.json").stat().st_mtime_ns
    assert knnper("experiment", "model-update", "--quick", "--out", str(tmp_path)) == 0
    assert (folder / "seed_0" / "rows.json").stat().st_mtime_ns == before
    assert (
        knnper("experiment", "model-update", "--quick", "--alpha", "1", "--out", str(tmp_path)) == 2
    )
    assert not (folder / "seed_1").exists()
    # benchmarks/map_forms.py compares the map forms on these releases' server splits (run as
    # `python benchmarks/map_forms.py` runs it, in this process: torch is imported already)
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "map_forms.py"
    (tmp_path / "cwd").mkdir()
    code = run_as_main(
        script, [str(folder), "--out", str(tmp_path / "forms")], tmp_path / "cwd", monkeypatch
    )
    assert code in (0, None), capsys.readouterr().err[-4000:]
    measured = json.loads((tmp_path / "forms" / "forms.json").read_text())
    table = (tmp_path / "forms" / "forms.md").read_text()
    assert set(measured["seeds"]["seed_0"]) == {"continued", "retrained", "independent"}
    assert "Command:" in table and "| per-class | " in table and "of 3 |" in table
