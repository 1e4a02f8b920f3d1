"""FedAvg + local linear head: its l2 is chosen on the seen clients' pooled validation splits
only, each client's head is edge_runtime's LinearHead on FedAvg's embeddings, and `bench table`
runs it on FedAvg's shared training run."""

from __future__ import annotations

import csv
import dataclasses
import json

import numpy as np
import pytest

from edge_runtime.linear_head import L2_GRID, LinearHead
from edge_runtime.personal_head import ClientSplits
from fed_train.algorithms import ALGORITHMS, build_algorithm
from fed_train.algorithms.base import embed_and_logits
from fed_train.knn_tuning import choose_l2, l2_counts
from tests.helpers.bench_table import TINY, bench
from tests.helpers.federation import CLASSES, TRAINING, initial_weights, make_clients, model_fn


def _view(
    cid: int, rng: np.random.Generator, *, unseen: bool = False, n_val: int = 40, noise: float = 1.5
) -> ClientSplits:
    """A client with 3 classes around fixed centres in 8 dimensions: noisy enough that the
    regularisation matters on validation."""
    centres = np.eye(3, 8) * 2.0

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, 3, n)
        return (centres[y] + noise * rng.normal(size=(n, 8))).astype(np.float32), y

    (zt, yt), (zv, yv), (zs, ys) = split(15), split(n_val), split(40)
    probs = [np.full((len(y), 3), 1 / 3) for y in (yt, yv, ys)]
    return ClientSplits(cid, unseen, zt, yt, zv, yv, zs, ys, *probs)


@pytest.fixture()
def views() -> list[ClientSplits]:
    rng = np.random.default_rng(0)
    return [_view(c, rng, unseen=c >= 6) for c in range(8)]


def test_l2_is_chosen_on_seen_validation_splits_only(views):
    l2, record = choose_l2(views)
    assert l2 in L2_GRID and record["config"] == {"l2": l2}
    assert record["chosen_on"]["clients"] == list(range(6))
    assert record["chosen_on"]["samples"] == 6 * 40
    assert [g["l2"] for g in record["grid"]] == list(L2_GRID)

    # test splits, and every split of unseen clients, change nothing
    rng = np.random.default_rng(1)
    changed = [
        dataclasses.replace(
            v,
            y_test=rng.permutation(v.y_test),
            z_test=rng.normal(size=v.z_test.shape).astype(np.float32),
        )
        for v in views[:6]
    ]
    changed += [_view(v.client_id, rng, unseen=True) for v in views[6:]]
    assert choose_l2(changed) == (l2, record)

    # the seen clients' validation labels do
    flipped = [dataclasses.replace(v, y_val=(v.y_val + 1) % 3) for v in views[:6]]
    assert choose_l2(flipped + views[6:])[1]["grid"] != record["grid"]


def test_pooled_scores_are_the_clients_summed_counts(views):
    _, record = choose_l2(views)
    counts = sum(l2_counts(v) for v in views[:6])
    assert [g["val_accuracy"] for g in record["grid"]] == pytest.approx(
        list(counts[:, 0] / counts[:, 2])
    )
    assert [g["val_nll"] for g in record["grid"]] == pytest.approx(
        list(counts[:, 1] / counts[:, 2])
    )
    assert np.all(counts[:, 0] == np.round(counts[:, 0]))  # samples right, whole numbers


def test_noisy_clients_prefer_more_regularisation_than_clean_ones():
    """The choice follows the data: on few noisy samples a strong l2 scores best on
    validation, on clean well-separated ones a weak l2 fits better (a lower log-loss)."""
    rng = np.random.default_rng(3)
    noisy, _ = choose_l2([_view(c, rng, noise=4.0, n_val=200) for c in range(6)])
    clean, _ = choose_l2([_view(c, rng, noise=0.3, n_val=200) for c in range(6)])
    assert noisy > clean


def test_without_seen_validation_data_nothing_is_chosen(views):
    with pytest.raises(ValueError, match="cannot choose on validation"):
        choose_l2(views[6:])


def test_personal_model_is_the_linear_head_on_fedavg_embeddings():
    client = make_clients(1)[0]
    weights = initial_weights()
    algorithm = build_algorithm("linear", model_fn, TRAINING, l2=0.05)
    personal = algorithm.personalize(weights, client, {}, seed=0)
    model = algorithm.global_model(weights)
    head = LinearHead(CLASSES, l2=0.05).fit(
        embed_and_logits(model, client.x_train)[0], client.y_train.numpy()
    )
    np.testing.assert_array_equal(
        personal.predict_proba(client.x_test),
        head.predict_proba(embed_and_logits(model, client.x_test)[0]),
    )
    assert personal.info == {"l2": 0.05, "head_bytes": head.nbytes}
    with pytest.raises(ValueError, match="l2 must be positive"):
        build_algorithm("linear", model_fn, TRAINING, l2=0.0)


def test_a_client_without_train_data_keeps_the_global_model():
    full = make_clients(1)[0]
    client = dataclasses.replace(full, x_train=full.x_train[:0], y_train=full.y_train[:0])
    weights = initial_weights()
    personal = build_algorithm("linear", model_fn, TRAINING).personalize(weights, client, {}, 0)
    fedavg = build_algorithm("fedavg", model_fn, TRAINING).personalize(weights, client, {}, 0)
    np.testing.assert_array_equal(
        personal.predict_proba(client.x_test), fedavg.predict_proba(client.x_test)
    )
    assert personal.info == {"l2": None}


def test_bench_table_runs_the_linear_baseline_on_fedavgs_run(tmp_path):
    out = tmp_path / "table"
    assert (
        bench(*TINY, "--rounds", "1", "--methods", "fedavg,linear,knnper", "--out", str(out)) == 0
    )
    result = json.loads((out / "results.json").read_text())
    assert result["methods"] == ["fedavg", "linear", "knnper"]
    assert [p.name for p in (out / "runs").iterdir()] == ["fedavg"]  # trained once, shared
    l2 = result["linear"]["config"]["l2"]
    assert l2 in L2_GRID and len(result["linear"]["grid"]) == len(L2_GRID)
    clients = list(csv.DictReader((out / "clients.csv").open()))
    assert len(clients) == 8
    for row in clients:
        assert 0.0 <= float(row["linear"]) <= 1.0
        assert float(row["linear_l2"]) == l2
    seen = result["seen"]["linear"]
    assert 0.0 <= seen["bottom_decile"] <= seen["mean"] <= 1.0
    table = (out / "table.md").read_text()
    assert f"| {ALGORITHMS['linear'].title} |" in table and "FedAvg + linear head's choice" in table
    rows = list(csv.DictReader((out / "table1.csv").open()))
    assert [r["method"] for r in rows] == ["fedavg", "linear", "knnper"]
