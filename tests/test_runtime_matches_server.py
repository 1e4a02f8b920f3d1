"""What a device computes equals what the server reports: the same bundle configuration gives the
same predictions through edge_runtime's Runtime (ONNX, raw inputs) as through the server-side
evaluation (torch, KNNHead)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_runtime.knn import KNNHead, interpolate, softmax
from edge_runtime.runtime import Runtime
from export.exporter import ExportSettings, export_run
from export.sizing import SearchSpace
from fed_train.algorithms.base import TrainingConfig, embed_and_logits
from fed_train.knn_setting import KNNChoice, KNNConfig
from fed_train.run import RunConfig, load_run, train


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("match")
    config = RunConfig(
        dataset="digits",
        clients=6,
        seed=3,
        training=TrainingConfig(rounds=4, batch_size=16, lr=0.05, momentum=0.9),
    )
    train(config, root / "run", progress=False)
    run = load_run(root / "run")
    settings = ExportSettings(
        quantize="fp32", backend="flat", space=SearchSpace(flat_dtypes=("fp32",))
    )
    budgets = {c: 10**8 for c in range(len(run.partition.clients))}
    report = export_run(run, root / "bundles", budgets, settings, progress=False)
    return run, root / "bundles", report


def test_runtime_equals_server_side_knnper_for_flat_fp32(exported):
    run, out, report = exported
    clients = run.clients()
    checked = 0
    for row in report["clients"]:
        runtime = Runtime.load(out / row["bundle"])
        client = clients[row["client_id"]]
        idx = run.partition.clients[row["client_id"]].test
        if len(idx) == 0:
            continue
        on_device = runtime.predict_proba(run.dataset.x_test[idx])

        z_train, _ = embed_and_logits(run.model, client.x_train)
        head = KNNHead(
            run.dataset.num_classes, k=runtime.manifest.k, sigma=runtime.manifest.sigma
        ).fit(z_train, client.y_train.numpy())
        z_test, logits = embed_and_logits(run.model, client.x_test)
        server = interpolate(
            head.predict_proba(z_test),
            softmax(logits.astype(np.float64)),
            runtime.manifest.lam,
        )
        np.testing.assert_array_equal(on_device.argmax(1), server.argmax(1))
        np.testing.assert_allclose(on_device, server, atol=1e-5)
        checked += len(idx)
    assert checked > 0


def test_every_bundle_fits_its_budget(exported):
    _, out, report = exported
    for row in report["clients"]:
        files = (out / row["bundle"]).iterdir()
        manifest = Runtime.load(out / row["bundle"]).manifest
        on_disk = sum(f.stat().st_size for f in files if f.name != "manifest.json")
        assert on_disk == manifest.footprint.total <= manifest.budget.total


def test_runtime_input_is_the_raw_data_not_the_prepared_tensor(exported):
    run, out, report = exported
    runtime = Runtime.load(out / report["clients"][0]["bundle"])
    with pytest.raises(ValueError, match="dtype"):
        runtime.predict_proba(torch.zeros(1, 1, 8, 8).numpy())


def test_l2_normalised_bundles_equal_server_side_knnper_with_l2(tmp_path):
    """`export --normalize l2` puts the normalisation into the encoder's embedding output, so the
    device computes KNNPer(normalize="l2") without any runtime change."""
    from edge_runtime.knn import normalize_embeddings

    config = RunConfig(
        dataset="digits",
        clients=4,
        seed=5,
        training=TrainingConfig(rounds=2, batch_size=16, lr=0.05, momentum=0.9),
    )
    train(config, tmp_path / "run", progress=False)
    run = load_run(tmp_path / "run")
    settings = ExportSettings(
        quantize="fp32",
        backend="flat",
        knn=KNNChoice(KNNConfig(5, 0.01, "l2")),
        space=SearchSpace(flat_dtypes=("fp32",)),
    )
    budgets = {c: 10**8 for c in range(len(run.partition.clients))}
    report = export_run(run, tmp_path / "bundles", budgets, settings, progress=False)
    clients = run.clients()
    for row in report["clients"]:
        runtime = Runtime.load(tmp_path / "bundles" / row["bundle"])
        client = clients[row["client_id"]]
        idx = run.partition.clients[row["client_id"]].test
        z, _ = runtime.embed(run.dataset.x_test[idx])
        np.testing.assert_allclose(np.linalg.norm(z, axis=1), 1.0, atol=1e-5)
        z_train, _ = embed_and_logits(run.model, client.x_train)
        head = KNNHead(run.dataset.num_classes, k=5, sigma=0.01).fit(
            normalize_embeddings(z_train, "l2"), client.y_train.numpy()
        )
        z_test, logits = embed_and_logits(run.model, client.x_test)
        server = interpolate(
            head.predict_proba(normalize_embeddings(z_test, "l2")),
            softmax(logits.astype(np.float64)),
            runtime.manifest.lam,
        )
        np.testing.assert_allclose(
            runtime.predict_proba(run.dataset.x_test[idx]), server, atol=1e-5
        )
