"""Lambda rules: the per-client rule is the paper's choice unchanged, the pooled rule gives every
client one lambda from summed evidence, the shrunk rule moves from one to the other with the
prior's weight, and their cross-validation scores each rule on halves its fit never saw."""

from __future__ import annotations

import numpy as np
import pytest

from edge_runtime.knn import (
    CLIENT_RULE,
    LAMBDA_GRID,
    LambdaRule,
    choice_key,
    interpolate,
    lambda_counts,
    split_score,
)
from edge_runtime.personal_head import ClientSplits
from fed_train.knn_setting import KNNConfig
from fed_train.knn_tuning import (
    cross_oracle_accuracy,
    fit_rule,
    pick_base_and_rule,
    pool_rules,
    rule_evidence,
    rule_fold_counts,
)


def _posteriors(n: int, classes: int, seed: int):
    rng = np.random.default_rng(seed)
    p_local = rng.dirichlet(np.ones(classes), size=n)
    p_global = rng.dirichlet(np.ones(classes), size=n)
    return p_local, p_global, rng.integers(0, classes, n)


def _paper_choice(p_local, p_global, y) -> float:
    """The paper's per-client rule written out independently: best accuracy, then the lower
    mean log-loss to 2 decimals, then the smaller lambda."""
    if len(y) == 0:
        return 0.5
    return min(
        LAMBDA_GRID,
        key=lambda lam: choice_key(*split_score(interpolate(p_local, p_global, lam), y), lam),
    )


@pytest.mark.parametrize("seed", range(20))
def test_client_rule_is_the_papers_choice(seed):
    p_local, p_global, y = _posteriors(30, 4, seed)
    assert CLIENT_RULE.choose(p_local, p_global, y) == _paper_choice(p_local, p_global, y)
    assert LambdaRule().choose(p_local, p_global, y) == _paper_choice(p_local, p_global, y)


def test_counts_are_sums_whose_means_are_split_scores():
    p_local, p_global, y = _posteriors(17, 3, 0)
    counts = lambda_counts(p_local, p_global, y)
    for row, lam in zip(counts, LAMBDA_GRID, strict=True):
        acc, nll = split_score(interpolate(p_local, p_global, lam), y)
        assert row[2] == 17
        assert row[0] / row[2] == acc and row[1] / row[2] == pytest.approx(nll, rel=1e-15)


def _evidence(rates: list[float], n: int) -> np.ndarray:
    """Hand-made evidence: accuracy `rates[i]` at grid value i, log-loss 1 everywhere."""
    return np.array([[r * n, n, n] for r in rates], dtype=np.float64)


def test_pooled_rule_ignores_the_clients_own_evidence():
    pooled = _evidence([0.5, 0.6, 0.9, 0.6, 0.5, 0.4, 0.3], 100)  # 0.3 wins pooled
    own = _evidence([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 10)  # 0.0 wins alone
    rule = LambdaRule("pooled", tuple(map(tuple, pooled)), 0.0)
    assert rule.choose_from_counts(own) == 0.3
    assert rule.choose_from_counts(np.zeros((7, 3))) == 0.3
    assert LambdaRule().choose_from_counts(own) == 0.0


def test_shrunk_rule_weighs_own_evidence_against_the_prior():
    pooled = _evidence([0.5, 0.6, 0.9, 0.6, 0.5, 0.4, 0.3], 100)
    own = _evidence([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 10)
    as_pairs = tuple(map(tuple, pooled))
    # prior worth 0 samples: the client's own choice; 10 samples: own 10/20 at 0.0 against
    # (0 + 10*0.9)/20 at 0.3 -> 0.3 wins (0.45 > 0.25 + ... ) computed by hand below
    assert LambdaRule("shrunk", as_pairs, 0.0).choose_from_counts(own) == 0.0
    # at lambda 0: (10 + 10 * 0.5) / 20 = 0.75; at 0.3: (0 + 10 * 0.9) / 20 = 0.45 -> 0.0
    assert LambdaRule("shrunk", as_pairs, 10.0).choose_from_counts(own) == 0.0
    # at lambda 0: (10 + 40 * 0.5) / 50 = 0.6; at 0.3: (0 + 40 * 0.9) / 50 = 0.72 -> 0.3
    assert LambdaRule("shrunk", as_pairs, 40.0).choose_from_counts(own) == 0.3
    # no own evidence at all: the pooled choice
    assert LambdaRule("shrunk", as_pairs, 5.0).choose_from_counts(np.zeros((7, 3))) == 0.3


def test_rules_round_trip_and_refuse_missing_evidence():
    rule = fit_rule("shrunk", [_evidence([0.5] * 7, 10), _evidence([0.7] * 7, 30)])
    assert rule.prior_samples == 20.0  # the mean evidence size
    assert np.asarray(rule.pooled)[0].tolist() == [26.0, 40.0, 40.0]
    assert LambdaRule.from_dict(rule.to_dict()) == rule
    with pytest.raises(ValueError, match="pooled evidence"):
        LambdaRule("pooled")
    with pytest.raises(ValueError, match="lambda rule must be one of"):
        LambdaRule("oracle")
    for grid in ((), (0.0, 0.0), (0.5, 1.5)):
        with pytest.raises(ValueError, match="distinct values in"):
            LambdaRule(grid=grid)
    with pytest.raises(ValueError, match="needs validation evidence"):
        fit_rule("pooled", [np.zeros((7, 3))])
    assert fit_rule("client", []) == LambdaRule()


def _view(cid: int, seed: int, n_val: int = 12, n_train: int = 20, p: int = 4, c: int = 3):
    rng = np.random.default_rng(seed)
    y_train = rng.integers(0, c, n_train)
    z_train = rng.normal(size=(n_train, p)).astype(np.float32) + y_train[:, None]
    y_val = rng.integers(0, c, n_val)
    z_val = rng.normal(size=(n_val, p)).astype(np.float32) + y_val[:, None]
    probs = [rng.dirichlet(np.ones(c), size=m) for m in (n_train, n_val, 0)]
    return ClientSplits(
        cid,
        False,
        z_train,
        y_train,
        z_val,
        y_val,
        np.zeros((0, p), np.float32),
        np.zeros(0, np.int64),
        *probs,
    )


def test_rule_cross_validation_scores_each_half_with_a_rule_fitted_on_the_others():
    views = [_view(cid, seed=cid) for cid in range(5)]
    config = KNNConfig(k=5, sigma=1.0)
    folds = [rule_fold_counts(v, config, "val", seed=3) for v in views]
    cv = pool_rules(folds)
    # recomputed by hand: each fold's rules fitted on the fitting halves only
    grid = len(LAMBDA_GRID)
    right = dict.fromkeys(cv, 0.0)
    total = 0.0
    for f in range(2):
        halves = [fc[f * grid : (f + 1) * grid] for fc in folds]
        pooled = sum(h[:, :3] for h in halves)
        prior = float(np.mean([h[0, 2] for h in halves]))
        for h in halves:
            total += h[0, 4]
            own = h[:, :3]
            lams = {
                "client": LambdaRule().choose_from_counts(own),
                "pooled": LambdaRule("pooled", tuple(map(tuple, pooled)), prior).choose_from_counts(
                    own
                ),
                "shrunk": LambdaRule("shrunk", tuple(map(tuple, pooled)), prior).choose_from_counts(
                    own
                ),
            }
            for name, lam in lams.items():
                right[name] += h[LAMBDA_GRID.index(lam), 3]
    assert cv == {name: right[name] / total for name in cv}
    assert total == sum(len(v.y_val) for v in views)
    # the full evidence pools what each client's own rule_evidence says
    assert rule_evidence(views[0], config, "val")[0, 2] == len(views[0].y_val)


def test_rule_ties_go_to_the_papers_rule_first():
    def pick_rule(scores):
        return pick_base_and_rule({"global": scores})[1]

    assert pick_rule({"client": 0.8, "pooled": 0.8, "shrunk": 0.8}) == "client"
    assert pick_rule({"client": 0.7, "pooled": 0.8, "shrunk": 0.8}) == "pooled"
    assert pick_rule({"client": 0.7, "pooled": 0.75, "shrunk": 0.8}) == "shrunk"
    # and between bases, the global model first
    assert pick_base_and_rule({"global": {"client": 0.8}, "linear": {"client": 0.8}}) == (
        "global",
        "client",
    )


def test_cross_oracle_never_scores_a_choice_on_the_samples_that_made_it():
    # two samples of class 0: the global model is right on the first (lambda <= 0.5 keeps it),
    # the kNN on the second (lambda >= 0.5). On both at once lambda 0.5 is right twice: the
    # test oracle scores 100%. Chosen on one sample, the log-loss pushes lambda to 0 (or 1),
    # which is wrong on the other: the cross-oracle scores 0%, by hand.
    y = np.zeros(2, dtype=np.int64)
    p_knn = np.array([[0.0, 1.0], [1.0, 0.0]])
    p_global = 1.0 - p_knn
    lam = CLIENT_RULE.choose(p_knn, p_global, y)
    assert lam == 0.5 and np.mean(interpolate(p_knn, p_global, lam).argmax(1) == y) == 1.0
    assert CLIENT_RULE.choose(p_knn[:1], p_global[:1], y[:1]) == 0.0
    assert CLIENT_RULE.choose(p_knn[1:], p_global[1:], y[1:]) == 1.0
    assert cross_oracle_accuracy(p_knn, p_global, y, seed=0) == 0.0
