"""Export at fleet scale: the pruned search and successive halving do what they say, ProtoNN's
faster training step computes edgeml's function, training can be split, progress off a
terminal is plain lines, and an interrupted export resumes without redoing finished clients."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from edgeml.pytorch.graph.protoNN import ProtoNN

from edge_runtime.budget import Budget
from edge_runtime.datastores import BACKENDS
from edge_runtime.personal_head import ClientSplits
from edge_runtime.runtime import Runtime
from export import exporter
from export.exporter import JOURNAL_FILE, ExportSettings, export_run
from export.sizing import DatastoreSizer, SearchSpace
from fed_train.algorithms.base import TrainingConfig
from fed_train.run import RunConfig, load_run, train
from protonn.training import ProtoNNClassifier, prototype_scores

SPACE = SearchSpace(
    protonn_dims=(4, 8), protonn_fractions=(0.1, 0.3), protonn_steps=20, hnsw_M=(8,)
)


def _embeddings(seed: int = 0) -> ClientSplits:
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=3.0, size=(3, 16))
    y_train, y_val = rng.integers(0, 3, 120), rng.integers(0, 3, 40)
    z_train = (centres[y_train] + rng.normal(size=(120, 16))).astype(np.float32)
    z_val = (centres[y_val] + rng.normal(size=(40, 16))).astype(np.float32)
    logits = rng.normal(size=(40, 3)).astype(np.float32)
    logits_train = rng.normal(size=(120, 3)).astype(np.float32)
    return ClientSplits.from_logits(
        0, False, (z_train, logits_train, y_train), (z_val, logits, y_val)
    )


def _backends(sizer: DatastoreSizer) -> set[str]:
    return {c.backend for c in sizer.candidates_}


def test_exhaustive_search_is_the_default_and_trains_every_protonn_to_the_end():
    sizer = DatastoreSizer(3, space=SPACE).fit(_embeddings(), Budget(4_600, encoder=0))
    assert _backends(sizer) == set(BACKENDS)
    steps = [c.steps for c in sizer.candidates_ if c.backend == "protonn"]
    assert len(steps) > SPACE.protonn_finalists and set(steps) == {SPACE.protonn_steps}


def test_pruned_search_skips_hnsw_and_protonn_when_every_key_fits_in_float32():
    sizer = DatastoreSizer(3, space=SPACE.pruned(5)).fit(_embeddings(), Budget(10**6, encoder=0))
    assert _backends(sizer) == {"flat"}
    assert any(c.recipe.startswith("flat:fp32") and c.stored == 120 for c in sizer.candidates_)


def test_successive_halving_trains_only_the_finalists_to_the_end():
    space = SPACE.pruned(5)
    sizer = DatastoreSizer(3, space=space).fit(_embeddings(), Budget(4_600, encoder=0))
    assert "hnsw" not in _backends(sizer)
    steps = [c.steps for c in sizer.candidates_ if c.backend == "protonn"]
    assert steps.count(space.protonn_steps) == space.protonn_finalists
    assert steps.count(5) == len(steps) - space.protonn_finalists > 0


def test_the_search_runs_numpys_blas_on_one_thread_and_gives_the_callers_back(monkeypatch):
    """Issue 49: OpenBLAS's thread per core busy-waits in every worker process of an export;
    the sizer runs on one and leaves the caller's count as it found it."""
    from threadpoolctl import ThreadpoolController

    from export import sizing

    blas = ThreadpoolController().select(user_api="blas")
    if not blas.lib_controllers:
        pytest.skip("numpy's BLAS is not visible to threadpoolctl")
    seen = []
    measure = sizing.measure_nbytes

    def counting(datastore):
        seen.append({lib.get_num_threads() for lib in blas.lib_controllers})
        return measure(datastore)

    monkeypatch.setattr(sizing, "measure_nbytes", counting)
    with blas.limit(limits=2):
        DatastoreSizer(3, space=SPACE).fit(_embeddings(), Budget(4_600, encoder=0))
        after = {lib.get_num_threads() for lib in blas.lib_controllers}
    assert seen and all(counts == {1} for counts in seen), seen
    assert after == {2}


def test_prototype_scores_compute_edgemls_forward():
    rng = np.random.default_rng(1)
    model = ProtoNN(
        16,
        8,
        30,
        3,
        0.2,
        W=rng.normal(size=(16, 8)),
        B=rng.normal(size=(8, 30)),
        Z=np.abs(rng.normal(size=(3, 30))),
    )
    x = torch.from_numpy(rng.normal(size=(50, 16)).astype(np.float32))
    with torch.no_grad():
        np.testing.assert_allclose(
            prototype_scores(model, x).numpy(), model(x).numpy(), rtol=1e-4, atol=1e-6
        )


def test_partial_fit_in_two_parts_is_fit_with_all_the_steps():
    data = _embeddings()
    whole = ProtoNNClassifier(3, projection_dim=4, n_prototypes=12, steps=30, seed=3)
    whole.fit(data.z_train, data.y_train)
    parts = ProtoNNClassifier(3, projection_dim=4, n_prototypes=12, seed=3)
    parts.partial_fit(data.z_train, data.y_train, 10).partial_fit(data.z_train, data.y_train, 20)
    assert parts.steps_done_ == 30
    for a, b in zip(whole.matrices().values(), parts.matrices().values(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("fleet") / "run"
    train(
        RunConfig(
            dataset="digits",
            clients=5,
            seed=0,
            training=TrainingConfig(rounds=2, epochs=1, batch_size=16, lr=0.05),
        ),
        path,
        progress=False,
    )
    return load_run(path)


def test_interrupted_export_resumes_without_redoing_finished_clients(run, tmp_path, monkeypatch):
    out = tmp_path / "bundles"
    settings = ExportSettings(
        space=SearchSpace(
            protonn_dims=(4,), protonn_fractions=(0.3,), protonn_steps=10, hnsw_M=(8,)
        )
    )
    budgets = {cid: 10**7 for cid in range(5)}
    real = exporter.export_client
    exported: list[int] = []

    def interrupted_after_two(task, context, sizer=None):
        if len(exported) == 2:
            raise KeyboardInterrupt
        exported.append(task.data.client_id)
        return real(task, context, sizer)

    monkeypatch.setattr(exporter, "export_client", interrupted_after_two)
    with pytest.raises(KeyboardInterrupt):
        export_run(run, out, budgets, settings, progress=False)
    assert exported == [0, 1]
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    # what a writer killed in the middle of a bundle leaves behind
    (out / f".client_0002.tmp-{finished.stdout.strip()}-abcd1234").mkdir()

    def counting(task, context, sizer=None):
        exported.append(task.data.client_id)
        return real(task, context, sizer)

    monkeypatch.setattr(exporter, "export_client", counting)
    report = export_run(run, out, budgets, settings, progress=False)
    assert exported == [0, 1, 2, 3, 4]  # 0 and 1 were not redone
    assert [r["client_id"] for r in report["clients"]] == [0, 1, 2, 3, 4]
    assert not list(out.glob(".client_*"))
    for row in report["clients"]:
        Runtime.load(out / row["bundle"])
    journal = (out / JOURNAL_FILE).read_text().splitlines()
    assert len(journal) == 6 and "fingerprint" in json.loads(journal[0])

    # another budget for one client: only that client is redone
    exported.clear()
    export_run(run, out, {**budgets, 3: 10**7 + 1}, settings, progress=False)
    assert exported == [3]


def test_parallel_workers_write_the_same_bundles_as_one_process(run, tmp_path):
    settings = ExportSettings(
        space=SearchSpace(
            protonn_dims=(4,), protonn_fractions=(0.3,), protonn_steps=10, hnsw_M=(8,)
        )
    )
    budgets = {cid: 10**7 for cid in range(3)}
    one = export_run(run, tmp_path / "one", budgets, settings, clients="0,1,2", progress=False)
    two = export_run(
        run, tmp_path / "two", budgets, settings, clients="0,1,2", progress=False, workers=2
    )
    assert [(r["client_id"], r["recipe"], r["total_bytes"]) for r in one["clients"]] == [
        (r["client_id"], r["recipe"], r["total_bytes"]) for r in two["clients"]
    ]
    for row in two["clients"]:
        assert (Path(tmp_path / "two") / row["bundle"] / "manifest.json").is_file()
