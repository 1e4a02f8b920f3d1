"""The kNN-Per head's math against hand-computed values."""

import numpy as np
import pytest

from edge_runtime.knn import (
    CLIENT_RULE,
    KNNHead,
    exact_search,
    interpolate,
    kernel_posterior,
    softmax,
)


def test_kernel_posterior_of_hand_built_2d_example():
    keys = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]], dtype=np.float32)
    labels = np.array([0, 1, 1])
    head = KNNHead(num_classes=3, k=3, sigma=1.0).fit(keys, labels)
    p = head.predict_proba(np.array([[0.0, 0.0]], dtype=np.float32))
    # squared distances 0, 1, 4; p = 2 (embedding dim), sigma = 1: weights exp(-d / 2)
    w = np.exp(-np.array([0.0, 1.0, 4.0]) / 2.0)
    expected = np.array([w[0], w[1] + w[2], 0.0]) / w.sum()
    np.testing.assert_allclose(p[0], expected, atol=1e-12)


def test_only_k_nearest_vote():
    keys = np.array([[0.0], [0.1], [5.0]], dtype=np.float32)
    head = KNNHead(num_classes=2, k=2).fit(keys, np.array([0, 0, 1]))
    np.testing.assert_allclose(head.predict_proba(np.array([[0.0]], np.float32)), [[1.0, 0.0]])


def test_far_neighbours_do_not_underflow_to_nan():
    p = kernel_posterior(np.array([[1e6, 1e6 + 2.0]]), np.array([[0, 1]]), 2, 1.0, 1)
    assert np.all(np.isfinite(p))
    np.testing.assert_allclose(p[0], [1 / (1 + np.exp(-2.0)), np.exp(-2.0) / (1 + np.exp(-2.0))])


def test_posterior_rows_sum_to_one():
    rng = np.random.default_rng(0)
    head = KNNHead(num_classes=4, k=5, sigma=0.5).fit(
        rng.normal(size=(50, 8)), rng.integers(0, 4, 50)
    )
    p = head.predict_proba(rng.normal(size=(10, 8)).astype(np.float32))
    np.testing.assert_allclose(p.sum(axis=1), 1.0)


def test_exact_search_matches_sorted_distances():
    rng = np.random.default_rng(1)
    keys = rng.normal(size=(200, 6)).astype(np.float32)
    q = rng.normal(size=(7, 6)).astype(np.float32)
    sq, idx = exact_search(q, keys, 5)
    full = ((q[:, None, :] - keys[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(idx, np.argsort(full, axis=1)[:, :5])
    np.testing.assert_allclose(sq, np.sort(full, axis=1)[:, :5], rtol=1e-4, atol=1e-4)


def test_k_larger_than_datastore_uses_all_keys():
    head = KNNHead(num_classes=2, k=10).fit(np.zeros((3, 2), np.float32), np.array([0, 1, 1]))
    np.testing.assert_allclose(head.predict_proba(np.zeros((1, 2), np.float32)), [[1 / 3, 2 / 3]])


def test_lambda_zero_is_global_model_and_one_is_knn_alone():
    p_knn = np.array([[0.9, 0.1]])
    p_global = softmax(np.array([[0.0, 2.0]]))
    np.testing.assert_allclose(interpolate(p_knn, p_global, 0.0), p_global)
    np.testing.assert_allclose(interpolate(p_knn, p_global, 1.0), p_knn)
    np.testing.assert_allclose(interpolate(p_knn, p_global, 0.5), 0.5 * (p_knn + p_global))


def test_lambda_out_of_range_is_refused():
    with pytest.raises(ValueError, match="lambda"):
        interpolate(np.ones((1, 2)) / 2, np.ones((1, 2)) / 2, 1.5)


def test_the_paper_rule_prefers_the_source_that_is_right():
    y = np.array([0, 0, 1])
    p_knn = np.array([[0.9, 0.1], [0.8, 0.2], [0.1, 0.9]])  # always right
    p_global = np.array([[0.1, 0.9], [0.2, 0.8], [0.9, 0.1]])  # always wrong
    assert CLIENT_RULE.choose(p_knn, p_global, y) == 1.0  # right and most confident
    assert CLIENT_RULE.choose(p_global, p_knn, y) == 0.0


def test_the_paper_rule_breaks_accuracy_ties_by_validation_log_loss():
    y = np.array([0, 1])
    p_knn = np.array([[0.99, 0.01], [0.01, 0.99]])
    p_global = np.array([[0.6, 0.4], [0.4, 0.6]])  # also right, less sure
    assert CLIENT_RULE.choose(p_knn, p_global, y) == 1.0
    assert CLIENT_RULE.choose(np.full((2, 2), 0.5), p_global, y) == 0.0


def test_softmax_is_stable_for_large_logits():
    np.testing.assert_allclose(softmax(np.array([[1000.0, 1000.0]])), [[0.5, 0.5]])


def test_fit_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="fit expects"):
        KNNHead(2).fit(np.zeros((3, 2)), np.zeros(4))
