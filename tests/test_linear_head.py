"""The numpy linear personal head against scikit-learn's logistic regression, a separable case
solved by hand, absent classes, bad input and determinism."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression

from edge_runtime.linear_head import L2_GRID, LinearHead


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    return (x / 16.0)[order].astype(np.float32), y[order]


@pytest.mark.parametrize("l2", [1.0, 1e-1, 1e-2, 1e-3])
def test_probabilities_match_scikit_learn(digits, l2):
    """Same objective as LogisticRegression(lbfgs) with C = 1 / (n * l2) on the embeddings
    divided by their standard deviation (centring them changes nothing with an unpenalised
    intercept): the probabilities on held-out samples agree to 1e-4 when both are solved
    tightly (measured: at most 2e-5, from the float32 weights; an l2 off by 10% moves them by
    1e-2 or more)."""
    x, y = digits
    z, t = x[:300], y[:300]
    scale = np.std(z.astype(np.float64) - z.mean(axis=0))
    ours = LinearHead(10, l2=l2, max_iter=5000, tol=1e-9).fit(z, t)
    # in float64: given float32, scikit-learn also solves in float32, to about 1e-4
    ref = LogisticRegression(C=1.0 / (len(t) * l2), tol=1e-12, max_iter=20000).fit(
        z.astype(np.float64) / scale, t
    )
    held_out = x[300:800]
    np.testing.assert_allclose(
        ours.predict_proba(held_out),
        ref.predict_proba(held_out.astype(np.float64) / scale),
        atol=1e-4,
    )
    assert np.mean(ours.predict(held_out) == ref.predict(held_out / scale)) > 0.995


def test_the_embeddings_scale_does_not_change_the_head(digits):
    """Rescaled embeddings (raw ReLU features, unit vectors) get the same probabilities with
    the same l2: the grid means one thing whatever the body's scale."""
    x, y = digits
    a = LinearHead(10, l2=1e-2, tol=1e-9).fit(x[:300], y[:300])
    b = LinearHead(10, l2=1e-2, tol=1e-9).fit(x[:300] * 40.0, y[:300])
    np.testing.assert_allclose(a.predict_proba(x[300:]), b.predict_proba(x[300:] * 40.0), atol=1e-5)


def test_separable_pair_has_the_hand_solved_probability():
    """Two points z = -1 (class 0) and z = +1 (class 1): by symmetry coef = [-w, w] and no
    intercept, the loss is log(1 + exp(-2w)) + l2 * w^2, minimal where l2 * w = 1 / (1 + e^2w).
    With l2 = 1 / (1 + e^2) that is w = 1, so each point gets its class with sigmoid(2)."""
    head = LinearHead(2, l2=1.0 / (1.0 + math.e**2), tol=1e-10).fit(
        np.array([[-1.0], [1.0]]), np.array([0, 1])
    )
    np.testing.assert_allclose(head.coef_, [[-1.0, 1.0]], atol=1e-5)
    np.testing.assert_allclose(head.intercept_, [0.0, 0.0], atol=1e-6)
    expected = 1.0 / (1.0 + math.exp(-2.0))
    np.testing.assert_allclose(
        head.predict_proba(np.array([[-1.0], [1.0]])),
        [[expected, 1 - expected], [1 - expected, expected]],
        atol=1e-6,
    )
    assert head.predict(np.array([[-3.0], [0.5]])).tolist() == [0, 1]


def test_absent_classes_get_low_finite_probability(digits):
    x, y = digits
    keep = np.isin(y, [1, 4, 7])
    z, t = x[keep][:120], y[keep][:120]
    head = LinearHead(10, l2=1e-2).fit(z, t)
    p_train = head.predict_proba(z)
    p_new = head.predict_proba(x[:300])
    assert np.isfinite(p_new).all() and np.allclose(p_new.sum(axis=1), 1.0)
    absent = [c for c in range(10) if c not in (1, 4, 7)]
    assert (p_train[:, absent] > 0).all() and (p_train[:, absent] <= 1 / (len(t) + 1)).all()
    assert set(head.predict(x[:300]).tolist()) <= {1, 4, 7}
    assert (head.coef_[:, absent] == 0).all()


def test_a_single_class_is_predicted_everywhere():
    z = np.random.default_rng(1).normal(size=(20, 8))
    head = LinearHead(5, l2=1e-2).fit(z, np.full(20, 3))
    p = head.predict_proba(z)
    assert (head.predict(z) == 3).all() and (p[:, 3] > 0.8).all() and np.isfinite(p).all()


def test_fit_is_deterministic_and_float32(digits):
    x, y = digits
    a = LinearHead(10, l2=1e-3).fit(x[:200], y[:200])
    b = LinearHead(10, l2=1e-3).fit(x[:200].copy(), y[:200].copy())
    assert a.coef_.dtype == a.intercept_.dtype == np.float32
    assert a.coef_.shape == (64, 10) and a.intercept_.shape == (10,)
    np.testing.assert_array_equal(a.coef_, b.coef_)
    np.testing.assert_array_equal(a.predict_proba(x[200:300]), b.predict_proba(x[200:300]))
    assert a.nbytes == (64 * 10 + 10) * 4


def test_fits_a_large_client_quickly():
    """The largest size a client holds here (1000 samples, p = 512, 100 classes) at every grid
    value: measured 0.05 to 1.2 s a fit with the two shared cores loaded five-fold."""
    rng = np.random.default_rng(2)
    centres = rng.normal(size=(100, 512))
    y = rng.integers(0, 100, 1000)
    z = np.maximum(centres[y] + 3 * rng.normal(size=(1000, 512)), 0).astype(np.float32)
    for l2 in L2_GRID:
        start = time.perf_counter()
        LinearHead(100, l2=l2).fit(z, y)
        assert time.perf_counter() - start < 5.0, l2


@pytest.mark.parametrize(
    ("z", "y", "message"),
    [
        (np.zeros((3, 2)), np.zeros(2, int), "z \\[n, p\\] and y \\[n\\]"),
        (np.zeros(3), np.zeros(3, int), "z \\[n, p\\] and y \\[n\\]"),
        (np.zeros((0, 2)), np.zeros(0, int), "at least one sample"),
        (np.array([[0.0, np.nan]]), np.zeros(1, int), "NaN or infinite"),
        (np.array([[0.0, np.inf]]), np.zeros(1, int), "NaN or infinite"),
        (np.zeros((2, 2)), np.array([0, 3]), "y must be in \\[0, 3\\)"),
        (np.zeros((2, 2)), np.array([-1, 0]), "y must be in"),
        (np.zeros((2, 2)), np.array([0.0, 1.0]), "integer class labels"),
    ],
)
def test_bad_inputs_are_refused_by_name(z, y, message):
    with pytest.raises(ValueError, match=message):
        LinearHead(3).fit(z, y)


@pytest.mark.parametrize(
    "kwargs", [{"l2": 0.0}, {"l2": -1.0}, {"l2": float("nan")}, {"max_iter": 0}, {"tol": 0.0}]
)
def test_bad_settings_are_refused_at_fit(kwargs):
    with pytest.raises(ValueError, match="l2|max_iter"):
        LinearHead(2, **kwargs).fit(np.zeros((2, 1)), np.array([0, 1]))


def test_predict_proba_refuses_another_width():
    head = LinearHead(2).fit(np.zeros((2, 3)), np.array([0, 1]))
    with pytest.raises(ValueError, match="z \\[n, 3\\]"):
        head.predict_proba(np.zeros((1, 4)))
