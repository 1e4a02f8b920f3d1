"""Device capacity profiles: budget files and generated budgets, each a Budget of its total
whose encoder share the exporter adds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_runtime.budget import Budget
from export.errors import BudgetInvalid
from export.profiles import (
    load_budgets,
    lognormal_budgets,
    uniform_budgets,
    weak_strong_budgets,
)


def _totals(budgets):
    """Each client's total, once every budget is checked to be a Budget without its encoder."""
    assert all(isinstance(b, Budget) and b.encoder is None for b in budgets.values())
    return {cid: b.total for cid, b in budgets.items()}


def _write(tmp_path, obj, name="budgets.json"):
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def test_budget_file_gives_each_client_its_budget(tmp_path):
    path = _write(tmp_path, {"0": 1000, "1": 2e3, "2": 5})
    assert _totals(load_budgets(path, [0, 1])) == {0: 1000, 1: 2000}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"0": 1000}, r"no budget for client\(s\) 1"),
        ({"0": 1000, "one": 5}, "'one' is not a client id"),
        ({"0": 1000, "1": -5}, "budget of client 1 .* positive whole number"),
        ({"0": 1000, "1": 10.5}, "positive whole number"),
        ({"0": 1000, "1": "big"}, "must be a number of bytes"),
        ({"0": 1000, "1": True}, "must be a number of bytes"),
        ([1000, 2000], "must hold an object"),
        ("{not json", "is not valid JSON"),
    ],
)
def test_bad_budget_files_are_refused(tmp_path, content, message):
    with pytest.raises(BudgetInvalid, match=message):
        load_budgets(_write(tmp_path, content), [0, 1])


def test_missing_budget_file_is_named(tmp_path):
    with pytest.raises(BudgetInvalid, match="does not exist"):
        load_budgets(tmp_path / "nope.json", [0])


def test_one_budget_for_all():
    assert _totals(uniform_budgets([3, 1], 5000)) == {3: 5000, 1: 5000}
    with pytest.raises(BudgetInvalid, match="positive whole number"):
        uniform_budgets([0], 0)


def test_weak_strong_splits_clients_in_half_around_the_reference():
    ids = list(range(10))
    budgets = _totals(weak_strong_budgets(ids, 100_000, 0.25, seed=1))
    assert sorted(budgets.values()) == [25_000] * 5 + [75_000] * 5
    assert budgets == _totals(weak_strong_budgets(ids, 100_000, 0.25, seed=1))  # seeded
    assert budgets != _totals(weak_strong_budgets(ids, 100_000, 0.25, seed=2))


def test_weak_strong_with_odd_clients_and_zero_delta():
    assert sorted(_totals(weak_strong_budgets([0, 1, 2], 1000, 0.1)).values()) == [400, 600, 600]
    assert set(_totals(weak_strong_budgets([0, 1], 1000, 0.0)).values()) == {500}


@pytest.mark.parametrize("delta", [0.5, -0.1, 1.0])
def test_weak_strong_refuses_delta_outside_range(delta):
    with pytest.raises(BudgetInvalid, match="delta-c must be in"):
        weak_strong_budgets([0, 1], 1000, delta)


def test_lognormal_spreads_around_the_reference():
    ids = list(range(400))
    budgets = _totals(lognormal_budgets(ids, 100_000, sigma=0.5, seed=0))
    values = np.array(list(budgets.values()))
    assert np.all(values >= 1)
    assert 85_000 < np.median(values) < 115_000
    assert 0.4 < np.std(np.log(values)) < 0.6
    assert budgets == _totals(lognormal_budgets(ids, 100_000, sigma=0.5, seed=0))
    assert set(_totals(lognormal_budgets([0, 1], 1000, sigma=0.0)).values()) == {1000}
    with pytest.raises(BudgetInvalid, match="sigma"):
        lognormal_budgets(ids, 1000, sigma=-1.0)


def test_no_clients_or_duplicates_are_refused():
    with pytest.raises(BudgetInvalid, match="no clients"):
        uniform_budgets([], 10)
    with pytest.raises(BudgetInvalid, match="distinct"):
        uniform_budgets([1, 1], 10)
