"""The paper's aggregation rule and the learning-rate schedule, against hand computation."""

import numpy as np
import pytest

from fed_train.algorithms.base import TrainingConfig, aggregate_weights


def test_aggregation_equals_hand_computed_weighted_average():
    w = {"a": np.array([1.0, 2.0], np.float32)}
    u1 = {"a": np.array([3.0, 0.0], np.float32)}
    u2 = {"a": np.array([0.0, 6.0], np.float32)}
    # n = 10 in all; client 1 has 2 samples, client 2 has 3, the other 5 did not report
    out = aggregate_weights(w, [(u1, 2), (u2, 3)], total_samples=10)
    expected = 0.5 * np.array([1.0, 2.0]) + 0.2 * np.array([3.0, 0.0]) + 0.3 * np.array([0.0, 6.0])
    np.testing.assert_allclose(out["a"], expected, rtol=1e-6)
    assert out["a"].dtype == np.float32


def test_full_participation_is_plain_fedavg():
    w = {"a": np.zeros(3)}
    ups = [({"a": np.full(3, 1.0)}, 1), ({"a": np.full(3, 4.0)}, 3)]
    np.testing.assert_allclose(aggregate_weights(w, ups, 4)["a"], np.full(3, 3.25))


def test_integer_buffers_stay_integers():
    w = {"n": np.array(10, dtype=np.int64)}
    out = aggregate_weights(w, [({"n": np.array(14, dtype=np.int64)}, 1)], 2)
    assert out["n"].dtype == np.int64 and int(out["n"]) == 12


def test_more_reported_samples_than_total_is_refused():
    with pytest.raises(ValueError, match="more than the total"):
        aggregate_weights({"a": np.zeros(1)}, [({"a": np.zeros(1)}, 5)], 4)


def test_multistep_learning_rate_decay():
    t = TrainingConfig(lr=0.1, milestones=(0.5, 0.75), gamma=0.1)
    assert [round(t.lr_at(r, 8), 6) for r in range(8)] == [0.1] * 4 + [0.01] * 2 + [0.001] * 2
