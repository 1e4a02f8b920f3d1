"""Every bundle the exporter writes keeps learning on the device: `add` with fifo and concatenate
works on whichever backend the sizing chose (ProtoNN included, through its buffer) and stays
within the budget; with update strategy "fixed" ProtoNN reserves no buffer room."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from edge_runtime.datastores import BACKENDS
from edge_runtime.runtime import Runtime
from export.exporter import ExportSettings, export_run
from export.sizing import SearchSpace
from fed_train.algorithms.base import TrainingConfig
from fed_train.run import RunConfig, load_run, train

SPACE = SearchSpace(
    count_fractions=(1.0,),
    hnsw_M=(8,),
    protonn_dims=(8,),
    protonn_fractions=(0.3,),
    protonn_steps=30,
)
ROOM = 20_000  # datastore bytes above the encoder: not every sample fits


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("learning")
    config = RunConfig(
        dataset="digits",
        clients=4,
        seed=1,
        training=TrainingConfig(rounds=3, epochs=1, batch_size=16, lr=0.05, momentum=0.9),
    )
    train(config, root / "run", progress=False)
    run = load_run(root / "run")
    first = export_run(
        run, root / "probe", {0: 10**7}, ExportSettings(space=SPACE), clients="0", progress=False
    )
    budgets = {0: first["encoder"]["bytes"] + ROOM}
    rows = []
    for backend in ("auto", *BACKENDS):
        settings = ExportSettings(backend=backend, space=SPACE)
        report = export_run(run, root / backend, budgets, settings, clients="0", progress=False)
        rows.append((root / backend / report["clients"][0]["bundle"], report["clients"][0]))
    return root, run, rows


@pytest.mark.parametrize("strategy", ["fifo", "concatenate"])
def test_add_works_on_every_exported_backend_within_the_budget(
    exported, tmp_path, strategy, caplog
):
    _, run, rows = exported
    assert {row["backend"] for _, row in rows} == set(BACKENDS)
    x, y = run.dataset.x_test[:40], run.dataset.y_test[:40].astype(np.int64)
    for path, row in rows:
        bundle = tmp_path / path.parent.name / path.name
        shutil.copytree(path, bundle)
        rt = Runtime.load(bundle)
        assert rt.manifest.update_strategy == "fifo"
        before, held = rt.components(x)[0], len(rt.datastore.sample_store())
        caplog.clear()
        update = rt.add(x, y, strategy=strategy)  # the README's example
        assert update.added > 0, row["recipe"]
        if strategy == "fifo" and row["backend"] == "protonn":  # room reserved for the buffer
            assert (
                update.size == min(rt.capacity, held + len(y)) and "does not fit" not in caplog.text
            )
        assert rt.manifest.footprint.total <= rt.manifest.budget.total
        reloaded = Runtime.load(bundle)
        np.testing.assert_allclose(reloaded.predict_proba(x), rt.predict_proba(x))
        # the samples just learned are found again: the datastore's own accuracy on them does
        # not drop (the interpolation may lean on the global model, and fifo evicts old samples)
        after = rt.components(x)[0]
        assert (after.argmax(1) == y).mean() >= (before.argmax(1) == y).mean(), row["recipe"]


def test_fixed_strategy_reserves_no_protonn_buffer(exported):
    root, run, _ = exported
    report = export_run(
        run,
        root / "fixed",
        {0: 10**6},
        ExportSettings(
            space=SearchSpace(
                backends=("protonn",), protonn_dims=(8,), protonn_fractions=(0.3,), protonn_steps=10
            ),
            update_strategy="fixed",
        ),
        clients="0",
        progress=False,
    )
    rt = Runtime.load(root / "fixed" / report["clients"][0]["bundle"])
    assert rt.manifest.update_strategy == "fixed"
    assert rt.datastore.buffer is None and ":b" not in rt.datastore.recipe


def test_re_exporting_over_a_taught_bundle_is_refused_without_force(exported, tmp_path):
    """A re-export replaced bundles that `add` had taught, silently (exit 0), while
    `knnper-edge init --out` refuses an existing bundle without --force: one rule for both."""
    from edge_runtime.bundle import read_manifest
    from export.exporter import ExportError

    root, run, rows = exported
    out = tmp_path / "flat"
    shutil.copytree(root / "flat", out)
    bundle = out / rows[1][0].name
    Runtime.load(bundle).add(run.dataset.x_test[:20], run.dataset.y_test[:20].astype(np.int64))
    taught = read_manifest(bundle).files
    budgets = {0: read_manifest(bundle).budget.total}
    settings = ExportSettings(backend="flat", space=SPACE)
    with pytest.raises(ExportError, match="taught since they were exported.*--force"):
        export_run(run, out, budgets, settings, clients="0", progress=False)
    assert read_manifest(bundle).files == taught  # nothing lost
    export_run(run, out, budgets, settings, clients="0", progress=False, force=True)
    assert read_manifest(bundle).files != taught


def test_a_linear_base_export_leaves_room_for_the_head_the_device_refits(
    exported, tmp_path, caplog
):
    """The exporter sized n without the head file the device's first `add` writes: every fifo
    add warned 'capacity N samples does not fit the budget; keeping M'."""
    from export.exporter import apply_knn_choice
    from fed_train.knn_choice import load_or_choose
    from fed_train.knn_request import KNNRequest

    root, run, _ = exported
    budgets = {0: 300_000}  # more room than the client has samples: n is its capacity
    shutil.copytree(root / "run", tmp_path / "run")
    choice = load_or_choose(
        tmp_path / "run", run.model, run.clients(), KNNRequest(base="linear"), seed=1
    )
    settings = apply_knn_choice(ExportSettings(backend="flat", space=SPACE), choice)
    report = export_run(run, tmp_path / "linear", budgets, settings, clients="0", progress=False)
    bundle = tmp_path / "linear" / report["clients"][0]["bundle"]
    rt = Runtime.load(bundle)
    with caplog.at_level("WARNING"):
        rt.add(run.dataset.x_test[:30], run.dataset.y_test[:30].astype(np.int64))
    assert "does not fit the budget" not in caplog.text
    assert (bundle / "linear_head.1.npz").is_file()


@pytest.mark.slow
def test_init_like_a_pooled_linear_base_bundle_matches_like_a_client_rule_one(exported, tmp_path):
    """The done-when of the new-device lambda: `init --like` of a bundle exported with the
    pooled rule (evidence measured on the clients' linear heads) gave lambda 0 and 2-8%; it
    must come within 1 pp of `init --like` of a client-rule bundle on the same data."""
    from edge_runtime.cli import main as edge_main
    from export.exporter import apply_knn_choice
    from fed_train.client_files import write_client_files
    from fed_train.knn_choice import load_or_choose
    from fed_train.knn_request import KNNRequest

    root, run, _ = exported
    device = max(range(len(run.partition.clients)), key=lambda c: run.partition.unseen[c])
    write_client_files(run, device, tmp_path / "device")
    test = np.load(tmp_path / "device" / "test.npz")
    accuracy = {}
    for rule in ("pooled", "client"):
        shutil.copytree(root / "run", tmp_path / rule / "run")
        choice = load_or_choose(
            tmp_path / rule / "run",
            run.model,
            run.clients(),
            KNNRequest(base="linear", lambda_rule=rule),
            seed=1,
        )
        report = export_run(
            run,
            tmp_path / rule / "bundles",
            {0: 300_000},
            apply_knn_choice(ExportSettings(backend="flat", space=SPACE), choice),
            clients="0",
            progress=False,
        )
        like = tmp_path / rule / "bundles" / report["clients"][0]["bundle"]
        assert (
            edge_main(
                [
                    "init",
                    "--encoder",
                    str(like / "encoder.onnx"),
                    "--data",
                    str(tmp_path / "device" / "train.npz"),
                    "--budget",
                    "300000",
                    "--out",
                    str(tmp_path / rule / "new"),
                    "--like",
                    str(like),
                ]
            )
            == 0
        )
        predicted = Runtime.load(tmp_path / rule / "new").predict_proba(test["x"]).argmax(1)
        accuracy[rule] = float(np.mean(predicted == test["y"]))
    assert abs(accuracy["pooled"] - accuracy["client"]) <= 0.01, accuracy
