"""`knnper export --keep-inputs` at digits scale: each bundle keeps its client's raw training
inputs for exactly the samples it stores, within its budget, and `knnper-edge upgrade` of it
re-embeds them exactly (what a fresh init of them with the new encoder predicts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from edge_runtime.bundle import ENCODER_FILE
from edge_runtime.datastores.recipes import format_recipe
from edge_runtime.device_choice import InitSettings
from edge_runtime.device_init import init_bundle
from edge_runtime.manifest import Manifest
from edge_runtime.runtime import Runtime
from edge_runtime.upgrade import REEMBED_VAL_FRACTION
from fed_train.client_files import client_split
from fed_train.run import load_run
from knnper_cli.main import main

pytestmark = pytest.mark.slow

BUDGET = "60kB"  # tight at digits scale: kept inputs cost some clients keys


def knnper(*argv: str) -> int:
    return main(["--threads", "1", "--no-progress", *argv])


def export(run: Path, out: Path, *extra: str) -> dict:
    argv = ["export", str(run), "--out", str(out), "--budget", BUDGET, "--workers", "1"]
    # the global model as base: a fresh init refits no linear head, and neither does upgrade
    assert knnper(*argv, "--base", "global", *extra) == 0
    return json.loads((out / "export.json").read_text())


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("keep-inputs")
    argv = ["--dataset", "digits", "--clients", "3", "--rounds", "1"]
    assert knnper("train", *argv, "--out", str(root / "v1")) == 0
    v2 = ["--continue-from", str(root / "v1"), "--rounds", "1", "--out", str(root / "v2")]
    assert knnper("train", *v2) == 0
    export(root / "v1", root / "kept", "--keep-inputs")  # auto: protonn is left out
    export(root / "v1", root / "plain", "--backend", "flat")
    export(root / "v2", root / "new", "--backend", "flat")
    return root


def _report(root: Path, name: str) -> dict:
    return json.loads((root / name / "export.json").read_text())


def test_bundles_keep_the_raw_inputs_of_exactly_their_stored_samples(exports):
    run = load_run(exports / "v1")
    for row in _report(exports, "kept")["clients"]:
        assert row["recipe"].endswith(":x64")
        assert all(c["backend"] in ("flat", "hnsw") for c in row["candidates"])
        rt = Runtime.load(exports / "kept" / row["bundle"])
        kept, labels = rt.datastore.inputs_, rt.datastore.labels_
        x, y = client_split(run, row["client_id"], "train")
        train = [(xi.tobytes(), int(yi)) for xi, yi in zip(x, y, strict=True)]
        assert kept.dtype == np.uint8 and kept.shape[1:] == (8, 8, 1)
        assert len(kept) == len(labels) == row["stored"]
        stored = [(xi.tobytes(), int(yi)) for xi, yi in zip(kept, labels, strict=True)]
        assert set(stored) <= set(train)  # every kept input is one of its own train images
        if row["backend"] == "flat":  # each key is the embedding of the input beside it
            z, _ = rt.embed(kept)
            keys = rt.datastore.keys()
            assert np.abs(keys - z).max() <= 0.05 * np.abs(z).max()


def test_kept_inputs_are_counted_in_the_budget(exports):
    kept, plain = _report(exports, "kept")["clients"], _report(exports, "plain")["clients"]
    for a, b in zip(kept, plain, strict=True):
        assert a["total_bytes"] <= a["budget"] and b["total_bytes"] <= b["budget"]
        # the same flat configuration holds fewer keys when it keeps their inputs
        held = {c["recipe"].split(":n")[0]: c["stored"] for c in b["candidates"]}
        flat = [c for c in a["candidates"] if c["backend"] == "flat"]
        assert flat and all(c["stored"] < held[c["recipe"].split(":n")[0]] for c in flat)


def test_upgrade_of_an_exported_bundle_re_embeds_exactly(exports, tmp_path):
    row = _report(exports, "kept")["clients"][0]
    device, release = tmp_path / "device", exports / "new" / row["bundle"]
    shutil.copytree(exports / "kept" / row["bundle"], device)
    before = Runtime.load(device).datastore.inputs_.copy()
    report = Runtime.load(device).upgrade(release)
    # the same-size encoder: the exporter sized the bundle by the runtime's own estimate
    assert report.how == "re-embedded"
    assert (report.carried, report.evicted) == (row["stored"], 0)
    rt = Runtime.load(device)
    np.testing.assert_array_equal(rt.datastore.inputs_, before)
    manifest = json.loads((release / "manifest.json").read_text())
    fresh = init_bundle(
        release / ENCODER_FILE,
        rt.datastore.inputs_,
        rt.datastore.labels_,
        rt.manifest.budget.total,
        tmp_path / "fresh",
        input_spec=manifest["input"],
        settings=InitSettings(
            k=manifest["k"],
            sigma=manifest["sigma"],
            recipes=[format_recipe("flat", {**rt.manifest.params, "n": len(rt.datastore)})],
            val_fraction=REEMBED_VAL_FRACTION,
            client_id=manifest["client_id"],
            lambda_rule=Manifest(manifest).lambda_rule,
            keep_inputs=True,
        ),
    )
    assert fresh.lam == rt.lam
    x, _ = client_split(load_run(exports / "v1"), row["client_id"], "test")
    np.testing.assert_array_equal(
        Runtime.load(tmp_path / "fresh").predict_proba(x), rt.predict_proba(x)
    )


def test_upgrade_of_a_tightly_exported_bundle_to_a_same_size_encoder_evicts_nothing(
    exports, tmp_path
):
    """The exporter and upgrade hold a bundle to one definition of what fits (the datastore's
    estimate_nbytes), so an encoder no larger than the old one evicts nothing."""
    for row in _report(exports, "kept")["clients"]:
        device = tmp_path / row["bundle"]
        release = exports / "new" / row["bundle"]
        shutil.copytree(exports / "kept" / row["bundle"], device)
        old = (device / ENCODER_FILE).stat().st_size
        assert (release / ENCODER_FILE).stat().st_size <= old
        assert row["stored"] < row["train_samples"]  # the budget binds
        report = Runtime.load(device).upgrade(release)
        assert (report.carried, report.evicted) == (row["stored"], 0)
        assert len(Runtime.load(device).datastore) == row["stored"]


@pytest.mark.parametrize("backend", ["protonn"])
def test_keep_inputs_with_a_backend_that_stores_no_samples_is_one_line(
    exports, tmp_path, capsys, backend
):
    argv = [str(exports / "v1"), "--out", str(tmp_path / "b"), "--budget", BUDGET]
    assert knnper("export", *argv, "--keep-inputs", "--backend", backend) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--keep-inputs" in err and backend in err
    assert not (tmp_path / "b").exists()
