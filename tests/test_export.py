"""The exporter end to end on a tiny digits run: bundles that fit their budgets, the choice
that is best on validation, what the device reproduces, bad inputs, interrupted exports."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import knnper_cli.main as cli
from edge_runtime.budget import Budget
from edge_runtime.bundle import read_manifest
from edge_runtime.datastores import BACKENDS
from edge_runtime.encoder import OPTIMIZED_KEY, Encoder, open_session, session_options
from edge_runtime.onnx_proto import ParsedModel
from edge_runtime.release import Release, read_release, write_release
from edge_runtime.runtime import Runtime
from edge_runtime.versions import ModelVersion
from export.errors import BudgetInvalid, ExportError
from export.exporter import (
    EncoderFiles,
    ExportSettings,
    build_encoder,
    bundle_dir,
    client_embeddings,
    export_run,
)
from export.onnx_export import encoder_nbytes_floor
from export.sizing import DatastoreSizer, SearchSpace, selection_key, smallest_datastore_bytes
from fed_train.algorithms.base import TrainingConfig
from fed_train.partition import ClientSplit, Partition
from fed_train.run import RunConfig, load_run, train
from tests.helpers.bundle_hashes import file_hashes

# Small enough for a test: one count fraction besides the budget-filling one, one ProtoNN
# shape with short training, one HNSW graph degree.
SMALL_SPACE = SearchSpace(
    count_fractions=(1.0, 0.25),
    hnsw_M=(8,),
    protonn_dims=(8,),
    protonn_fractions=(0.3,),
    protonn_steps=30,
)
ROOMS = (3_000, 5_000, 10_000, 20_000, 40_000, 150_000)  # datastore bytes above the encoder


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run") / "digits"
    config = RunConfig(
        dataset="digits",
        clients=6,
        seed=0,
        training=TrainingConfig(rounds=3, epochs=1, batch_size=16, lr=0.05, momentum=0.9),
    )
    train(config, path, progress=False)
    return path


@pytest.fixture(scope="session")
def run(run_dir):
    return load_run(run_dir)


@pytest.fixture(scope="session")
def encoder_files(run, tmp_path_factory) -> EncoderFiles:
    """The run's int8 encoder, built once: exports that only differ in what they check reuse it."""
    return build_encoder(run, tmp_path_factory.mktemp("encoder"), ExportSettings())


@pytest.fixture(scope="session")
def encoder_bytes(encoder_files) -> int:
    return encoder_files.nbytes


@pytest.fixture(scope="session")
def other_run_dir(run_dir, tmp_path_factory) -> Path:
    """Another model version: the same weights as another run (its record names another run)."""
    path = tmp_path_factory.mktemp("other") / "digits-v2"
    shutil.copytree(run_dir, path)
    return path


@pytest.fixture(scope="session")
def exported(run, encoder_bytes, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "bundles"
    budgets = {cid: Budget(encoder_bytes + room) for cid, room in enumerate(ROOMS)}
    report = export_run(run, out, budgets, ExportSettings(space=SMALL_SPACE), progress=False)
    return out, report, budgets


def _bundle_files_bytes(path: Path) -> int:
    return sum((path / name).stat().st_size for name in read_manifest(path).files)


def test_every_bundle_fits_its_budget_and_loads(exported):
    out, report, budgets = exported
    assert len(report["clients"]) == len(ROOMS)
    for row in report["clients"]:
        path = out / row["bundle"]
        total = _bundle_files_bytes(path)
        assert total <= budgets[row["client_id"]].total == row["budget"]
        assert total == row["total_bytes"]
        runtime = Runtime.load(path)
        assert runtime.manifest.footprint.total == total
        assert runtime.manifest.client_id == row["client_id"]


def test_choice_is_best_on_validation_among_candidates_that_fit(exported):
    _, report, budgets = exported
    encoder = report["encoder"]["bytes"]
    backends = set()
    for row in report["clients"]:
        cands = row["candidates"]
        assert len(cands) > 1
        room = budgets[row["client_id"]].with_encoder(encoder).room
        assert all(c["bytes"] <= room for c in cands)
        best = min(cands, key=lambda c: selection_key(_candidate(c)))
        assert (row["recipe"], row["datastore_bytes"]) == (best["recipe"], best["bytes"])
        assert row["val_accuracy"] == max(c["val_accuracy"] for c in cands)
        backends.update(c["backend"] for c in cands)
    assert backends == set(BACKENDS)


def _candidate(row: dict):
    from export.sizing import Candidate

    return Candidate(
        row["recipe"],
        row["backend"],
        row["bytes"],
        row["stored"],
        row["lambda"],
        row["val_accuracy"],
        row["val_nll"],
    )


def test_tighter_budgets_never_store_more_bytes(exported, run):
    """One client sized under every room, tightest first, with one configuration (flat float32
    keys, as many as fit): what it stores grows with the room and never passes it."""
    out, report, _ = exported
    encoder = Encoder(out / report["clients"][0]["bundle"] / "encoder.onnx")
    data = client_embeddings(encoder, run.clients()[0])
    sizer = DatastoreSizer(
        run.dataset.num_classes, space=SearchSpace(backends=("flat",), flat_dtypes=("fp32",))
    )
    sizes = [sizer.fit(data, Budget(room, 0)).best_.nbytes for room in ROOMS]
    assert all(size <= room for size, room in zip(sizes, ROOMS, strict=True)), sizes
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1], sizes


def test_device_reproduces_the_validation_accuracy_of_the_choice(exported, run):
    out, report, _ = exported
    for row in report["clients"]:
        split = run.partition.clients[row["client_id"]]
        x, y = run.dataset.x_train[split.val], run.dataset.y_train[split.val]
        acc = np.mean(Runtime.load(out / row["bundle"]).predict(x) == y)
        assert acc == pytest.approx(row["val_accuracy"], abs=1e-12)
        assert Runtime.load(out / row["bundle"]).lam == row["lambda"]


def test_report_records_encoder_sizes_and_quality(exported):
    out, report, _ = exported
    enc = report["encoder"]
    assert enc["bytes"] == (out / "encoder.onnx").stat().st_size
    assert enc["fp32_bytes"] == (out / "encoder.fp32.onnx").stat().st_size
    assert enc["fp32_bytes"] / enc["bytes"] > 2.3
    assert enc["torch_max_abs_diff"] <= 1e-4
    assert enc["int8_vs_fp32"]["embedding_cosine_min"] > 0.99
    assert json.loads((out / "export.json").read_text()) == json.loads(json.dumps(report))


@pytest.mark.parametrize("quantize", ["int8", "fp32"])
def test_datastore_keys_are_the_shipped_encoders_embeddings(run, tmp_path, quantize):
    space = dataclasses.replace(SMALL_SPACE, backends=("flat",), flat_dtypes=("fp32",))
    report = export_run(
        run,
        tmp_path,
        {0: 10**7},
        ExportSettings(quantize=quantize, space=space),
        clients="0",
        progress=False,
    )
    keys = np.load(tmp_path / "client_0000" / "datastore.npz")["keys"]
    x = run.clients()[0].x_train.numpy()
    shipped = Encoder(tmp_path / "client_0000" / "encoder.onnx").run(x)[0]
    np.testing.assert_array_equal(keys, shipped)
    assert report["clients"][0]["stored"] == len(x)
    fp32 = Encoder(tmp_path / "encoder.fp32.onnx").run(x)[0]
    # the shipped encoder is saved optimized (fused operators): fp32 agrees to rounding only
    assert np.allclose(keys, fp32, atol=1e-5) == (quantize == "fp32")
    assert (
        OPTIMIZED_KEY
        in ParsedModel((tmp_path / "client_0000" / "encoder.onnx").read_bytes()).metadata
    )


def test_the_device_adds_its_cpus_layout_to_the_encoder_saved_optimized(run, tmp_path):
    """The shipped encoder is saved at onnxruntime's portable levels; the device's sessions (the
    encoder alone and the whole predictor) open it at ORT_ENABLE_ALL, which adds this CPU's
    layout (NHWC integer convolutions: twice as fast at batch 1, benchmarks/results/runtime/
    load_level/), with outputs bit for bit those of the file as saved."""
    space = dataclasses.replace(SMALL_SPACE, backends=("flat",), flat_dtypes=("int8",))
    export_run(run, tmp_path, {0: 10**7}, ExportSettings(space=space), clients="0", progress=False)
    bundle = tmp_path / "client_0000"
    encoder, rt = Encoder(bundle / "encoder.onnx"), Runtime.load(bundle)
    assert OPTIMIZED_KEY in ParsedModel((bundle / "encoder.onnx").read_bytes()).metadata
    for session in (encoder.session, rt.predictor.session):
        level = session.get_session_options().graph_optimization_level
        assert level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    x = run.clients()[0].x_test.numpy()
    as_saved = open_session(
        str(bundle / "encoder.onnx"),
        session_options(1, ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
        "the encoder as saved",
    )
    for got, want in zip(encoder.run(x), as_saved.run(None, {encoder.input_name: x}), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("below", ["its weights", "its file"])
def test_budget_below_the_encoder_is_refused_before_writing(run, tmp_path, encoder_bytes, below):
    """Below the encoder's weights: refused before it is exported (the floor); between them
    and its file: once the file's size is known."""
    out = tmp_path / "out"
    floor = encoder_nbytes_floor(run.model, "int8")
    budget, size = (
        (1000, f"at least {floor} bytes")
        if below == "its weights"
        else (
            encoder_bytes - 1,
            f"{encoder_bytes} bytes",
        )
    )
    with pytest.raises(
        BudgetInvalid,
        match=rf"client 1: budget {budget} bytes is below the size of "
        rf"the int8 encoder alone \({size}",
    ):
        export_run(
            run,
            out,
            {0: 10**7, 1: budget},
            ExportSettings(space=SMALL_SPACE),
            clients="0,1",
            progress=False,
        )
    assert not out.exists()


@pytest.mark.parametrize("budget", [0, 2.5, "1MB"])
def test_a_budget_that_is_no_number_of_bytes_is_refused_before_the_encoder_is_built(
    run, tmp_path, monkeypatch, budget
):
    import export.exporter as exporter

    def never(*args, **kwargs):
        raise AssertionError("the encoder was built before the budgets were checked")

    monkeypatch.setattr(exporter, "build_encoder", never)
    with pytest.raises(BudgetInvalid, match="client 1: budget_bytes must be a positive integer"):
        export_run(
            run, tmp_path / "out", {0: Budget(10**7), 1: budget}, clients="0,1", progress=False
        )


def test_budget_without_room_for_any_datastore_is_refused(run, tmp_path, encoder_bytes):
    with pytest.raises(BudgetInvalid, match="plus the smallest datastore"):
        export_run(
            run,
            tmp_path / "out",
            {2: encoder_bytes + 10},
            ExportSettings(space=SMALL_SPACE),
            clients="2",
            progress=False,
        )


def test_client_without_training_samples_is_refused(run, tmp_path):
    splits = list(run.partition.clients)
    empty = np.zeros(0, dtype=np.int64)
    splits[3] = ClientSplit(empty, splits[3].val, splits[3].test)
    broken = dataclasses.replace(run, partition=Partition(splits, run.partition.unseen))
    with pytest.raises(ExportError, match="client 3 has no training samples"):
        export_run(broken, tmp_path / "out", {3: 10**7}, clients="3", progress=False)


def test_unknown_client_and_selection(run, tmp_path):
    with pytest.raises(ExportError, match="client 42 is not in the run"):
        export_run(run, tmp_path, {42: 10**7}, clients="42", progress=False)
    with pytest.raises(ExportError, match="comma-separated list"):
        export_run(run, tmp_path, {}, clients="first", progress=False)


def test_interrupted_export_leaves_no_half_written_bundle_and_resumes_its_release_only(
    run, tmp_path, monkeypatch, encoder_files, other_run_dir
):
    import edge_runtime.bundle as bundle_module

    real = bundle_module.sha256_file

    def failing_hash(path):
        # The second bundle: its files are written, its manifest is not.
        if ".client_0001.tmp" in str(path) and Path(path).name.startswith("datastore"):
            raise KeyboardInterrupt("simulated crash")
        return real(path)

    monkeypatch.setattr(bundle_module, "sha256_file", failing_hash)
    space = dataclasses.replace(SMALL_SPACE, backends=("flat",))
    out = tmp_path / "out"
    budgets, settings = {0: 10**6, 1: 10**6}, ExportSettings(space=space)

    def export(run, **kwargs):
        return export_run(
            run,
            out,
            budgets,
            settings,
            clients="0,1",
            progress=False,
            encoder=encoder_files,
            **kwargs,
        )

    with pytest.raises(KeyboardInterrupt):
        export(run)
    monkeypatch.setattr(bundle_module, "sha256_file", real)
    assert Runtime.load(bundle_dir(out, 0)).manifest.client_id == 0
    assert not bundle_dir(out, 1).exists()
    for entry in out.iterdir():  # no leftover directory, hidden or not, holds a bundle
        if entry.is_dir():
            assert entry == bundle_dir(out, 0)
    # the release's record was written first: the folder says which release it holds
    record = read_release(out)
    version = ModelVersion.of(read_manifest(bundle_dir(out, 0)))
    assert record == Release(str(run.run_dir), version, (0, 1), finished=False)
    assert (out / "export.json").read_bytes() == _record_bytes(record, tmp_path)
    # an export of another version does not resume it: refused, nothing written
    before = file_hashes(out)
    with pytest.raises(ExportError, match=r"holds another release: run digits round 3 \("):
        export(load_run(other_run_dir))
    assert file_hashes(out) == before
    # the same release resumes: client 0 is kept, client 1 made, the report written
    report = export(run)
    assert read_release(out) == dataclasses.replace(record, finished=True)
    kept = {name: h for name, h in file_hashes(out).items() if name.startswith("client_0000/")}
    assert kept == {name: h for name, h in before.items() if name.startswith("client_0000/")}
    assert [r["client_id"] for r in report["clients"]] == [0, 1]


def _record_bytes(release: Release, tmp_path: Path) -> bytes:
    """The bytes a release's record is written in (write_release into a fresh folder)."""
    folder = tmp_path / "record"
    folder.mkdir(exist_ok=True)
    write_release(folder, release)
    return (folder / "export.json").read_bytes()


def test_an_export_over_another_release_is_one_line_exit_2_and_force_replaces_it_whole(
    run, run_dir, other_run_dir, tmp_path, capsys, caplog, encoder_files
):
    """`knnper export RUN2 --out DIR` over RUN1's bundles rewrote those of RUN2's clients,
    left the others and wrote a report naming RUN2 alone, exit 0: one folder, two releases."""
    out = tmp_path / "b"
    settings = ExportSettings(backend="flat", space=SMALL_SPACE)
    budgets = {c: encoder_files.nbytes + 20_000 for c in range(6)}
    other = load_run(other_run_dir)
    export_run(other, out, budgets, settings, clients="0,1", progress=False, encoder=encoder_files)
    (out / "upgrades").mkdir()  # the key maps a release ships go with it
    before = file_hashes(out)
    code, _, err = _cli(
        capsys,
        *("export", str(run_dir), "--out", str(out), "--clients", "0"),
        *("--budget", str(budgets[0]), "--backend", "flat", "--knn-config", "paper"),
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--out {out} holds another release: run digits-v2 round 3" in err
    assert "this export is run digits round 3" in err and "--force" in err
    assert file_hashes(out) == before
    # a folder an older version left mixed: a bundle loaded from it says so
    held = read_release(out)
    write_release(
        out, dataclasses.replace(held, model=dataclasses.replace(held.model, run="digits"))
    )
    with caplog.at_level("WARNING", logger="edge_runtime.runtime"):
        Runtime.load(bundle_dir(out, 1))
    assert "client_0001 is run digits-v2 round 3" in caplog.text
    assert "names run digits round 3" in caplog.text
    write_release(out, held)
    # --force replaces the other release whole: none of its bundles is left beside the new one
    export_run(
        run, out, budgets, settings, clients="0", progress=False, encoder=encoder_files, force=True
    )
    release = read_release(out)
    assert release.finished and release.clients == (0,) and release.run == str(run.run_dir)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["client_0000"]
    assert ModelVersion.of(read_manifest(bundle_dir(out, 0))) == release.model
    # a record that is no release's is refused as another release's
    (out / "export.json").write_text('{"run": "x"}')
    with pytest.raises(ExportError, match=r"export.json: 'model' must be an object.*--force"):
        export_run(run, out, budgets, settings, clients="0", progress=False, encoder=encoder_files)


# ----------------------------------------------------------------------------- command line


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["--no-progress", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_exports_and_prints_a_table(run_dir, tmp_path, capsys, encoder_bytes):
    budgets = tmp_path / "budgets.json"
    budgets.write_text(json.dumps({"0": encoder_bytes + 30_000, "4": encoder_bytes + 10_000}))
    code, out, _ = _cli(
        capsys,
        "export",
        str(run_dir),
        "--out",
        str(tmp_path / "b"),
        "--budgets",
        str(budgets),
        "--backend",
        "flat",
        "--clients",
        "0,4",
    )
    assert code == 0
    assert "budget" in out and "recipe" in out and "flat:" in out
    report = json.loads((tmp_path / "b" / "export.json").read_text())
    assert [r["client_id"] for r in report["clients"]] == [0, 4]
    assert all(r["backend"] == "flat" for r in report["clients"])


@pytest.mark.parametrize("budgets", ['{"0": 500000}', '{"4": "1MB"}'])
def test_cli_refuses_bad_budgets_before_choosing_the_knn_setting(
    run_dir, tmp_path, capsys, monkeypatch, budgets
):
    import fed_train.knn_choice

    def never(*args, **kwargs):
        raise AssertionError("the kNN setting was chosen before the budgets were checked")

    monkeypatch.setattr(fed_train.knn_choice, "load_or_choose", never)
    path = tmp_path / "budgets.json"
    path.write_text(budgets)
    code, _, err = _cli(
        capsys,
        "export",
        str(run_dir),
        "--out",
        str(tmp_path / "b"),
        "--budgets",
        str(path),
        "--clients",
        "0,4",
    )
    assert code == 2 and err.count("\n") == 1 and re.search(r"client(\(s\))? 4", err), err
    assert not (tmp_path / "b").exists()


def test_a_budget_below_the_encoders_weights_is_refused_before_any_heavy_step(
    run_dir, run, tmp_path, capsys, monkeypatch, encoder_files
):
    """Issue 49: the encoder's weights bound its file from below, so a budget under them is
    refused before the kNN setting is chosen (minutes) or the encoder is exported."""
    import export.exporter
    import fed_train.knn_choice

    def never(*args, **kwargs):
        raise AssertionError("a heavy step ran before the budget was checked")

    floors = {q: encoder_nbytes_floor(run.model, q) for q in ("int8", "fp32")}
    assert 0 < floors["int8"] <= encoder_files.nbytes
    assert floors["fp32"] == 4 * floors["int8"] <= encoder_files.fp32_nbytes
    monkeypatch.setattr(fed_train.knn_choice, "load_or_choose", never)
    monkeypatch.setattr(export.exporter, "build_encoder", never)
    for quantize, floor in floors.items():
        out = tmp_path / quantize
        flags = ["--quantize", quantize, "--budget", str(floor - 1)]
        code, _, err = _cli(capsys, "export", str(run_dir), "--out", str(out), *flags)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert (
            f"budget {floor - 1} bytes is below the size of the {quantize} encoder alone "
            f"(at least {floor} bytes" in err
        ), err
        assert not out.exists()


def test_cli_refuses_a_budget_below_one_sample_and_fits_at_the_smallest_it_names(
    run_dir, run, tmp_path, capsys, encoder_bytes
):
    """One sample's files fitted where its estimate (files and held memory, what `add` holds
    the bundle to) did not: the exporter wrote a bundle over the device's own rule."""
    smallest = encoder_bytes + smallest_datastore_bytes(
        SearchSpace(backends=("flat",)), run.dataset.num_classes, int(run.model.embedding_dim)
    )
    flags = ["--backend", "flat", "--knn-config", "paper", "--clients", "2", "--budget"]
    export = ["export", str(run_dir), "--out", str(tmp_path / "o"), *flags]
    code, _, err = _cli(capsys, *export, str(smallest - 1))
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"client 2: budget {smallest - 1} bytes cannot hold the int8 encoder" in err
    assert f"the smallest budget that fits is {smallest} bytes" in err
    assert not (tmp_path / "o" / "client_0002").exists()
    code, _, err = _cli(capsys, *export, str(smallest))
    assert code == 0, err
    rt = Runtime.load(tmp_path / "o" / "client_0002")
    assert 1 <= len(rt.datastore) <= rt._max_fit()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "100000", "--backend", "faiss"], "unknown backend 'faiss'"),
        (["--budget", "100000", "--quantize", "int4"], "unknown quantization 'int4'"),
        (["--profile", "weak-strong"], "needs --reference"),
        (["--profile", "tiers", "--reference", "1M"], "unknown --profile 'tiers'"),
        (["--budget", "1000"], "below the size of the int8 encoder alone"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(run_dir, tmp_path, capsys, args, message):
    code, _, err = _cli(capsys, "export", str(run_dir), "--out", str(tmp_path / "o"), *args)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_cli_missing_or_corrupt_run_is_refused(run_dir, tmp_path, capsys):
    code, _, err = _cli(
        capsys, "export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o"), "--budget", "1M"
    )
    assert code == 2 and "is not a finished run" in err
    broken = tmp_path / "broken"
    shutil.copytree(run_dir, broken)
    (broken / "model.pt").write_bytes(b"not a checkpoint")
    code, _, err = _cli(
        capsys, "export", str(broken), "--out", str(tmp_path / "o"), "--budget", "1M"
    )
    assert code == 2 and "cannot be loaded" in err and len(err.strip().splitlines()) == 1


def test_cli_weak_strong_profile_gives_half_the_devices_less(
    run_dir, tmp_path, capsys, encoder_bytes
):
    reference = 2 * (encoder_bytes + 20_000)
    code, _, _ = _cli(
        capsys,
        "export",
        str(run_dir),
        "--out",
        str(tmp_path / "b"),
        "--profile",
        "weak-strong",
        "--reference",
        str(reference),
        "--delta-c",
        "0.1",
        "--backend",
        "flat",
        "--clients",
        "0,2",
    )
    assert code == 0
    report = json.loads((tmp_path / "b" / "export.json").read_text())
    assert sorted(r["budget"] for r in report["clients"]) == [
        int(0.4 * reference),
        int(0.6 * reference),
    ]
    assert all(r["total_bytes"] <= r["budget"] for r in report["clients"])
