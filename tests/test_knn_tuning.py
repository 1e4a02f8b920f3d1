"""kNN-Per's k / sigma / normalisation chosen on validation, the lambda estimators, and the
test-oracle report: hand-checked search, a grid that must find the right normalisation, and
agreement with the KNNPer algorithm that devices mirror."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_runtime.knn import (
    CLIENT_RULE,
    LAMBDA_GRID,
    KNNHead,
    estimator_evidence,
    interpolate,
    leave_one_out_search,
    normalize_embeddings,
)
from edge_runtime.personal_head import ClientSplits
from fed_train.algorithms.knnper import KNNPer
from fed_train.evaluation import client_accuracies
from fed_train.knn_setting import KNNChoice, KNNConfig
from fed_train.knn_tuning import (
    client_rows,
    client_views,
    compare_lambda_estimators,
    lambda_report,
    select_config,
)
from tests.helpers.federation import TRAINING, make_clients, model_fn, train


def test_leave_one_out_search_drops_each_keys_own_entry():
    keys = np.array([[0.0], [1.0], [3.0], [7.0]], dtype=np.float32)
    sq, idx = leave_one_out_search(keys, 2)
    assert idx.tolist() == [[1, 2], [0, 2], [1, 0], [2, 1]]
    assert sq.tolist() == [[1.0, 9.0], [1.0, 4.0], [4.0, 9.0], [16.0, 36.0]]


def test_leave_one_out_search_with_duplicate_keys_keeps_k_others():
    keys = np.zeros((3, 2), dtype=np.float32)
    sq, idx = leave_one_out_search(keys, 2)
    assert sq.shape == (3, 2) and not np.any(idx == np.arange(3)[:, None])


def test_l2_normalisation_puts_rows_on_the_unit_sphere_and_keeps_zero_rows():
    z = np.array([[3.0, 4.0], [0.0, 0.0]], dtype=np.float32)
    out = normalize_embeddings(z, "l2")
    assert np.allclose(out, [[0.6, 0.8], [0.0, 0.0]])
    with pytest.raises(ValueError, match="normalisation"):
        normalize_embeddings(z, "l1")


def _direction_views(seed: int = 0) -> list[ClientSplits]:
    """Labels given by an embedding's direction, magnitudes random over two decades: only L2
    normalisation lets Euclidean neighbours see the label."""
    rng = np.random.default_rng(seed)
    angles = np.array([0.0, 0.6, 1.2])

    def split(n):
        y = rng.integers(0, 3, n)
        a = angles[y] + rng.normal(0, 0.05, n)
        r = 10 ** rng.uniform(-2, 2, n)
        z = np.stack([r * np.cos(a), r * np.sin(a)], 1).astype(np.float32)
        return z, y

    views = []
    for cid in range(4):
        (zt, yt), (zv, yv), (zs, ys) = split(60), split(30), split(30)
        flat = np.full((1, 3), 1 / 3)
        views.append(
            ClientSplits(
                cid,
                False,
                zt,
                yt,
                zv,
                yv,
                zs,
                ys,
                np.repeat(flat, 60, 0),
                np.repeat(flat, 30, 0),
                np.repeat(flat, 30, 0),
            )
        )
    return views


def test_select_config_finds_the_normalisation_the_labels_need():
    config, scores = select_config(_direction_views())
    assert config.normalize == "l2"
    assert len(scores) == 4 * 13 * 2
    best_raw = max(s["val_accuracy"] for s in scores if s["normalize"] == "none")
    best_l2 = max(s["val_accuracy"] for s in scores if s["normalize"] == "l2")
    assert best_l2 > best_raw


def test_empty_grids_and_clients_without_validation_are_refused():
    views = _direction_views()
    with pytest.raises(ValueError, match="must not be empty"):
        select_config(views, ks=())
    for v in views:
        v.y_val = v.y_val[:0]
    with pytest.raises(ValueError, match="no seen client"):
        select_config(views)


def test_the_loo_estimator_adds_the_datastore_samples_to_the_evidence():
    # validation alone prefers the global model (lambda 0). With the 20 datastore samples,
    # lambda 0.5 and 0.7 get all 21 right; 0.7 has the lower log-loss (0.371 x 20 + 0.598 for
    # the validation sample, against 0.598 x 20 + 0.431)
    y_val = np.array([0])
    p_knn_val, p_glob_val = np.array([[0.4, 0.6]]), np.array([[0.9, 0.1]])
    y_tr = np.ones(20, dtype=np.int64)
    loo = (np.tile([[0.1, 0.9]], (20, 1)), np.tile([[0.8, 0.2]], (20, 1)), y_tr)

    def estimate(*args):
        return CLIENT_RULE.choose(*estimator_evidence(*args))

    assert estimate("val", p_knn_val, p_glob_val, y_val) == 0.0
    assert estimate("loo+val", p_knn_val, p_glob_val, y_val, loo) == 0.7
    with pytest.raises(ValueError, match="lambda estimator"):
        estimate("test", p_knn_val, p_glob_val, y_val)


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    clients = make_clients(6, swapped=(1, 2), unseen=(5,))
    algorithm = KNNPer(model_fn, TRAINING)
    weights = train(algorithm, clients).weights
    return clients, weights


@pytest.mark.parametrize("estimator", ["val", "loo+val"])
@pytest.mark.parametrize("config", [KNNConfig(), KNNConfig(5, 0.01, "l2")])
def test_client_rows_agree_with_the_knnper_algorithm(trained, estimator, config):
    clients, weights = trained
    algorithm = KNNPer(model_fn, TRAINING, KNNChoice(config, estimator))
    expected = client_accuracies(algorithm, weights, {}, clients)
    views = client_views(algorithm.global_model(weights), clients)
    rows = client_rows(views, config, estimator=estimator)
    for got, want in zip(rows, expected, strict=True):
        assert got["info"]["lambda"] == want["info"]["lambda"]
        assert got["accuracy"] == pytest.approx(want["accuracy"], abs=1e-12)
    assert lambda_report(rows)["clients"] == len(clients)


def _noisy_views(seed: int = 0) -> list[ClientSplits]:
    """Three overlapping classes in 2-d and a base model right about 70% of the time, its errors
    independent of the kNN's: neither is perfect, so lambda matters and an honest choice made
    on 30 validation samples often differs from the test oracle's."""
    rng = np.random.default_rng(seed)
    centres = 1.2 * np.array([[1.0, 0.0], [-0.5, 0.87], [-0.5, -0.87]])

    def split(n):
        y = rng.integers(0, 3, n)
        z = (centres[y] + rng.normal(0, 1.0, (n, 2))).astype(np.float32)
        logits = 2.0 * np.eye(3)[y] + rng.normal(0, 1.5, (n, 3))
        return z, y, np.exp(logits) / np.exp(logits).sum(1, keepdims=True)

    views = []
    for cid in range(6):
        (zt, yt, pt), (zv, yv, pv), (zs, ys, ps) = split(80), split(30), split(60)
        views.append(ClientSplits(cid, cid == 5, zt, yt, zv, yv, zs, ys, pt, pv, ps))
    return views


def _knn_posteriors(view: ClientSplits, config: KNNConfig, z: np.ndarray) -> np.ndarray:
    """The device's kNN head over the client's datastore, at `config`."""
    head = KNNHead(view.num_classes, config.k, config.sigma).fit(
        normalize_embeddings(view.z_train, config.normalize), view.y_train
    )
    return head.predict_proba(normalize_embeddings(z, config.normalize))


def test_the_test_oracle_is_the_best_grid_lambda_and_the_report_its_cost():
    views, config = _noisy_views(), KNNConfig(5, 1.0, "none")
    rows = client_rows(views, config)
    # each client's test accuracy at every grid lambda, through the device's kNN head
    acc = np.array(
        [
            [np.mean(interpolate(p, v.p_test, lam).argmax(1) == v.y_test) for lam in LAMBDA_GRID]
            for v in views
            for p in [_knn_posteriors(v, config, v.z_test)]
        ]
    )
    for row, grid in zip(rows, acc, strict=True):
        assert row["accuracy"] == grid[LAMBDA_GRID.index(row["info"]["lambda"])]
        assert row["info"]["oracle_accuracy"] == grid.max()
        assert grid[LAMBDA_GRID.index(row["info"]["oracle_lambda"])] == grid.max()
    honest = np.array([row["accuracy"] for row in rows])
    assert (honest < acc.max(1)).any()  # the data let an honest choice fall short
    n_test = np.array([len(v.y_test) for v in views], dtype=np.float64)
    report = lambda_report(rows)
    assert report["cost_pp"] == pytest.approx(
        100 * np.average(acc.max(1) - honest, weights=n_test), abs=1e-9
    )
    assert report["differs"] == sum(r["info"]["lambda"] != r["info"]["oracle_lambda"] for r in rows)


def test_no_choice_depends_on_test_labels(trained):
    """Permuting every client's test labels changes no chosen k, sigma, normalisation, lambda,
    estimator score or prediction (only the accuracies)."""
    clients, weights = trained
    model = KNNPer(model_fn, TRAINING).global_model(weights)
    views = client_views(model, clients)
    rng = np.random.default_rng(1)
    shuffled = client_views(model, clients)
    for v in shuffled:
        v.y_test = rng.permutation(v.y_test)
    picks = [select_config(vs, sigmas=(0.01, 1.0)) for vs in (views, shuffled)]
    assert picks[0] == picks[1]
    config = picks[0][0]
    assert compare_lambda_estimators(views, config) == compare_lambda_estimators(shuffled, config)
    for est in ("val", "loo+val"):
        a, b = (
            client_rows(views, config, estimator=est),
            client_rows(shuffled, config, estimator=est),
        )
        assert [r["info"]["lambda"] for r in a] == [r["info"]["lambda"] for r in b]
    algorithm = KNNPer(model_fn, TRAINING)
    for c in clients:
        permuted = type(c)(
            c.client_id,
            c.x_train,
            c.y_train,
            c.x_val,
            c.y_val,
            c.x_test,
            c.y_test[torch.randperm(len(c.y_test))],
            c.unseen,
        )
        p1 = algorithm.personalize(weights, c, {}, 0)
        p2 = algorithm.personalize(weights, permuted, {}, 0)
        assert p1.info == p2.info
        assert np.array_equal(p1.predict_proba(c.x_test), p2.predict_proba(c.x_test))


def test_estimator_comparison_scores_are_cross_validated_accuracies():
    """ "val"'s score by hand: each seen client's validation split halved (seeded by (0,
    client)), lambda chosen on one half with the device's kNN head, scored on the other, both
    ways, pooled over the clients; "loo+val" is scored on the same samples."""
    views, config = _noisy_views(), KNNConfig(5, 1.0, "none")
    scores = compare_lambda_estimators(views, config)
    assert set(scores) == {"val", "loo+val"}
    right = scored = 0
    for v in (v for v in views if not v.unseen):
        p_knn = _knn_posteriors(v, config, v.z_val)
        order = np.random.default_rng([0, v.client_id]).permutation(len(v.y_val))
        halves = (order[: len(order) // 2], order[len(order) // 2 :])
        for fit, score in (halves, halves[::-1]):
            lam = CLIENT_RULE.choose(p_knn[fit], v.p_val[fit], v.y_val[fit])
            p = interpolate(p_knn[score], v.p_val[score], lam)
            right += int(np.sum(p.argmax(1) == v.y_val[score]))
            scored += len(score)
    assert scores["val"] == right / scored < 1.0
    assert scores["loo+val"] * scored == pytest.approx(round(scores["loo+val"] * scored))


@pytest.mark.parametrize("base", ["global", "auto"])
def test_choosing_the_setting_counts_its_steps_against_a_total(capsys, base):
    """A log said '3 steps done' for minutes, with no total to measure it against."""
    from fed_train.knn_tuning import choose_knn

    choose_knn(model_fn(), make_clients(4), ks=(5,), sigmas=(1.0,), base=base, progress=True)
    total = 6 if base == "auto" else 4
    assert f"choosing kNN-Per's configuration: {total}/{total} steps done in" in (
        capsys.readouterr().err
    )
