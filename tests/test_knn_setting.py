"""KNNChoice checks itself when built and builds the one personal head every caller uses."""

from __future__ import annotations

import math

import pytest

from edge_runtime.knn import CLIENT_RULE, LAMBDA_GRID, LambdaRule
from fed_train.knn_setting import KNNChoice, KNNConfig

POOLED = LambdaRule("pooled", tuple((3.0, 2.0, 4.0) for _ in LAMBDA_GRID))


def _fields(head) -> dict:
    return {
        "num_classes": head.num_classes,
        "k": head.k,
        "sigma": head.sigma,
        "normalize": head.normalize,
        "l2": head.l2,
        "rule": head.rule,
        "estimator": head.estimator,
    }


def test_the_paper_choice_builds_the_paper_head():
    assert _fields(KNNChoice().head(10)) == {
        "num_classes": 10,
        "k": 10,
        "sigma": 1.0,
        "normalize": "none",
        "l2": None,
        "rule": CLIENT_RULE,
        "estimator": "val",
    }


def test_a_linear_choice_builds_its_head_and_its_named_variants():
    choice = KNNChoice(
        KNNConfig(5, 0.5, "l2"), "loo+val", lambda_rule=POOLED, base="linear", l2=0.1
    )
    full = {
        "num_classes": 3,
        "k": 5,
        "sigma": 0.5,
        "normalize": "l2",
        "l2": 0.1,
        "rule": POOLED,
        "estimator": "loo+val",
    }
    assert _fields(choice.head(3)) == full
    # embeddings already normalised (an exported encoder's, client_views'): not again
    assert _fields(choice.head(3, normalized=True)) == {**full, "normalize": "none"}
    # logits already the client's linear head's (its own encoder): no linear head of its own
    assert _fields(choice.head(3, linear_in_logits=True)) == {**full, "l2": None}
    # each client's own lambda first (the experiments fit the pooled rule after)
    assert _fields(choice.head(3, rule=CLIENT_RULE)) == {**full, "rule": CLIENT_RULE}
    assert choice.head(3).linear_ is None  # unfitted


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"config": KNNConfig(k=0)}, "k must be an integer"),
        ({"config": KNNConfig(k=2.5)}, "k must be an integer"),
        ({"config": KNNConfig(k=True)}, "k must be an integer"),
        ({"config": KNNConfig(sigma=0.0)}, "sigma must be a number"),
        ({"config": KNNConfig(sigma=-1.0)}, "sigma must be a number"),
        ({"config": KNNConfig(sigma=math.nan)}, "sigma must be a number"),
        ({"config": KNNConfig(normalize="zscore")}, "normalize must be one of none, l2"),
        ({"config": {"k": 10}}, "config must be a KNNConfig"),
        ({"lambda_estimator": "oracle"}, "lambda estimator must be one of val, loo+val"),
        ({"lambda_rule": "pooled"}, "lambda_rule must be a LambdaRule"),
        ({"base": "linear"}, "base must be 'global', or 'linear' with l2 > 0"),
        ({"base": "linear", "l2": 0.0}, "base must be 'global', or 'linear' with l2 > 0"),
        ({"base": "linear", "l2": math.inf}, "base must be 'global', or 'linear' with l2 > 0"),
        ({"base": "global", "l2": 0.1}, "base must be 'global', or 'linear' with l2 > 0"),
        ({"base": "ridge", "l2": 0.1}, "base must be 'global', or 'linear' with l2 > 0"),
    ],
)
def test_a_choice_a_device_cannot_run_is_refused_with_one_line(fields, problem):
    with pytest.raises(ValueError) as err:
        KNNChoice(**fields)
    message = str(err.value)
    assert message.startswith(f"kNN-Per setting: {problem}")
    assert "\n" not in message
