"""ProtoNN training (protonn) against edgeml's forward and the device's numpy inference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_runtime.datastores import ProtoNNDatastore
from protonn.training import ProtoNNClassifier, allocate, kmeans, median_heuristic_gamma


def _blobs(n_per_class: int = 40, classes: int = 3, dim: int = 12, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=4.0, size=(classes, dim))
    z = np.concatenate([c + rng.normal(size=(n_per_class, dim)) for c in centres])
    y = np.repeat(np.arange(classes), n_per_class)
    return z.astype(np.float32), y


def _normalised(scores: np.ndarray) -> np.ndarray:
    scores = np.maximum(scores, 0.0)
    return scores / scores.sum(axis=1, keepdims=True)


def test_edgeml_forward_and_numpy_datastore_agree_on_the_same_matrices():
    rng = np.random.default_rng(1)
    d, p, m, c = 6, 10, 9, 4
    W = rng.normal(scale=0.3, size=(d, p)).astype(np.float32)
    B = rng.normal(size=(d, m)).astype(np.float32)
    Z = rng.uniform(size=(c, m)).astype(np.float32)
    gamma = 0.4
    z = rng.normal(size=(25, p)).astype(np.float32)
    from edgeml.pytorch.graph.protoNN import ProtoNN

    edgeml = ProtoNN(p, d, m, c, gamma, W=W.T.copy(), B=B, Z=Z)
    with torch.no_grad():
        s_edgeml = edgeml(torch.from_numpy(z)).numpy().astype(np.float64)
    # The contract's formula, by hand.
    wz = z.astype(np.float64) @ W.T.astype(np.float64)
    sq = ((wz[:, :, None] - B[None, :, :].astype(np.float64)) ** 2).sum(axis=1)
    s_formula = np.exp(-(gamma**2) * sq) @ Z.T.astype(np.float64)
    np.testing.assert_allclose(s_edgeml, s_formula, atol=1e-5)
    device = ProtoNNDatastore.from_matrices(W, B, Z, gamma).predict_proba(z)
    np.testing.assert_allclose(device, _normalised(s_edgeml), atol=1e-5)


def test_trained_classifier_agrees_with_edgeml_and_device():
    z, y = _blobs()
    clf = ProtoNNClassifier(3, projection_dim=4, prototype_fraction=0.2, steps=50).fit(z, y)
    scores = clf.decision_function(z).astype(np.float64)
    np.testing.assert_allclose(clf.predict_proba(z), _normalised(scores), atol=1e-5)


def test_fit_learns_separable_classes():
    z, y = _blobs(seed=2)
    clf = ProtoNNClassifier(3, projection_dim=4, prototype_fraction=0.1, steps=60).fit(z, y)
    assert np.mean(clf.predict(z) == y) > 0.95


def test_matrices_have_the_bundle_layout():
    z, y = _blobs(dim=12)
    clf = ProtoNNClassifier(5, projection_dim=4, n_prototypes=7, steps=10).fit(z, y)
    mats = clf.matrices()
    assert mats["W"].shape == (4, 12)
    assert mats["B"].shape == (4, 7)
    assert mats["Z"].shape == (5, 7)  # num_classes rows, even for classes never seen
    assert np.ndim(mats["gamma"]) == 0 and float(mats["gamma"]) > 0
    assert np.all(mats["Z"] >= 0)  # scores stay proper class weights


def test_fit_is_deterministic_given_the_seed():
    z, y = _blobs()
    a = ProtoNNClassifier(3, projection_dim=4, steps=20, seed=3).fit(z, y).matrices()
    b = ProtoNNClassifier(3, projection_dim=4, steps=20, seed=3).fit(z, y).matrices()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def test_random_init_and_projection_wider_than_the_data():
    z, y = _blobs(n_per_class=5, dim=3)
    clf = ProtoNNClassifier(3, projection_dim=8, n_prototypes=4, init="random", steps=5)
    assert clf.fit(z, y).W_.shape == (8, 3)


def test_median_heuristic_is_edgemls_formula():
    projected = np.array([[0.0, 0.0], [3.0, 4.0]])
    prototypes = np.array([[0.0, 0.0]])
    # distances 0 and 5: median 2.5, gamma = 1 / (2.5 * 2.5)
    assert median_heuristic_gamma(projected, prototypes) == pytest.approx(0.16)


def test_prototype_allocation_follows_class_sizes():
    counts = np.array([50, 30, 0, 20])
    out = allocate(counts, 10)
    assert out.sum() == 10 and out[2] == 0 and np.all(out[[0, 1, 3]] >= 1)
    assert list(out) == [5, 3, 0, 2]
    assert list(allocate(np.array([1, 1, 40]), 2)) == [1, 1, 1]  # one per present class
    assert list(allocate(np.array([2, 3]), 50)) == [2, 3]  # never more than the samples


def test_kmeans_finds_separated_centres():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=(30, 2)), rng.normal(size=(30, 2)) + 20.0])
    centres = kmeans(x, 2, np.random.default_rng(1))
    assert sorted(np.round(centres[:, 0] / 20.0).tolist()) == [0.0, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "z", "y", "message"),
    [
        ({}, np.zeros((0, 3)), np.zeros(0, dtype=int), "at least one training sample"),
        ({}, np.zeros((4, 3)), np.array([0, 1, 9, 0]), "labels must be integers in"),
        ({}, np.full((2, 3), np.nan), np.array([0, 1]), "NaN"),
        ({}, np.zeros((3, 3)), np.zeros(2, dtype=int), "fit expects"),
        ({"init": "spectral"}, np.zeros((2, 3)), np.array([0, 1]), "init must be one of"),
        ({"projection_dim": 0}, np.zeros((2, 3)), np.array([0, 1]), "projection_dim"),
        ({"gamma_scale": 0.0}, np.zeros((2, 3)), np.array([0, 1]), "gamma_scale"),
    ],
)
def test_bad_inputs_are_refused_with_a_message(kwargs, z, y, message):
    with pytest.raises(ValueError, match=message):
        ProtoNNClassifier(3, **kwargs).fit(z, y)
