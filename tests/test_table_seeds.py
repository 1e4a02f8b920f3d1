"""Across-seed summaries and the paired bootstrap that decides whether a method is ahead."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.table_seeds import (
    MIN_CLIENTS,
    across_seeds,
    clients_hurt,
    compare_to_best,
    compare_to_each,
    format_hurt,
    lambda_ties,
    paired_bootstrap,
)


def _clients(rng, n, a_mean, b_mean, noise=0.05):
    base = rng.uniform(0.5, 0.8, n)
    return [
        {
            "client_id": i,
            "unseen": False,
            "n_test": int(rng.integers(10, 50)),
            "knnper": float(base[i] + a_mean + rng.normal(0, noise)),
            "fedrep": float(base[i] + b_mean + rng.normal(0, noise)),
            "fedavg": float(base[i] - 0.1),
        }
        for i in range(n)
    ]


def _result(clients):
    def summary(m):
        acc = np.array([c[m] for c in clients])
        w = np.array([c["n_test"] for c in clients])
        return {
            "mean": float(np.average(acc, weights=w)),
            "bottom_decile": float(np.sort(acc)[int(np.ceil(len(acc) / 10)) - 1]),
        }

    methods = ["fedavg", "fedrep", "knnper"]
    return {
        "methods": methods,
        "clients": clients,
        "seen": {m: summary(m) for m in methods},
        "unseen": {},
        "lr": {},
    }


def test_a_clear_paired_gain_is_called_and_a_tiny_one_is_inconclusive():
    rng = np.random.default_rng(0)
    clear = [_result(_clients(rng, 60, 0.05, 0.0)) for _ in range(3)]
    spread = across_seeds(clear, clear[0]["methods"], oracle=False)
    verdict = compare_to_best(spread, compare_to_each(clear, spread))["seen"]["mean"]
    assert verdict["baseline"] == "fedrep" and verdict["verdict"] == "knnper ahead"
    assert verdict["low"] > 0 and verdict["low"] < verdict["diff"] < verdict["high"]
    tiny = [_result(_clients(rng, 60, 0.002, 0.0)) for _ in range(3)]
    spread = across_seeds(tiny, tiny[0]["methods"], oracle=False)
    tiny_best = compare_to_best(spread, compare_to_each(tiny, spread))
    assert tiny_best["seen"]["mean"]["verdict"] == "inconclusive"
    behind = [_result(_clients(rng, 60, -0.05, 0.0)) for _ in range(3)]
    spread = across_seeds(behind, behind[0]["methods"], oracle=False)
    behind_best = compare_to_best(spread, compare_to_each(behind, spread))
    assert behind_best["seen"]["mean"]["verdict"] == "fedrep ahead"


def test_each_baseline_gets_its_own_interval_and_the_best_one_matches():
    """kNN-Per 5 pp over FedRep and 15 pp over FedAvg (whose clients sit 10 pp below the shared
    base): both called, and the best baseline's entry is compare_to_best's."""
    rng = np.random.default_rng(3)
    results = [_result(_clients(rng, 60, 0.05, 0.0)) for _ in range(3)]
    spread = across_seeds(results, results[0]["methods"], oracle=False)
    each = compare_to_each(results, spread)["seen"]["mean"]
    assert set(each) == {"fedavg", "fedrep"}
    assert each["fedavg"]["diff"] == pytest.approx(each["fedrep"]["diff"] + 0.10, abs=0.01)
    assert each["fedavg"]["verdict"] == each["fedrep"]["verdict"] == "knnper ahead"
    best = compare_to_best(spread, compare_to_each(results, spread))["seen"]["mean"]
    assert {k: best[k] for k in ("diff", "low", "high")} == {
        k: each["fedrep"][k] for k in ("diff", "low", "high")
    }


def test_spread_is_mean_and_sample_std_across_seeds():
    rng = np.random.default_rng(1)
    results = [_result(_clients(rng, 20, 0.0, 0.0)) for _ in range(3)]
    spread = across_seeds(results, ["fedavg"], oracle=False)["seen"]["fedavg"]["mean"]
    values = [r["seen"]["fedavg"]["mean"] for r in results]
    assert spread["mean"] == pytest.approx(np.mean(values))
    assert spread["std"] == pytest.approx(np.std(values, ddof=1))


def test_pairing_removes_the_clients_shared_difficulty():
    """Clients differ a lot, the methods by a steady 1 pp: unpaired, that would be lost."""
    rng = np.random.default_rng(2)
    clients = _clients(rng, 80, 0.01, 0.0, noise=0.001)
    interval = paired_bootstrap([clients], "seen", "knnper", "fedrep", "mean")
    assert 0.008 < interval["low"] < interval["high"] < 0.012
    assert paired_bootstrap([clients[:3]], "seen", "knnper", "fedrep", "mean") is None


def test_lambda_ties_are_counted_apart_from_real_differences():
    clients = [
        {
            "knnper": 0.5,
            "knnper_lambda": 0.3,
            "knnper_oracle_lambda": 0.5,
            "knnper_oracle_accuracy": 0.5,
        },
        {
            "knnper": 0.5,
            "knnper_lambda": 0.3,
            "knnper_oracle_lambda": 0.7,
            "knnper_oracle_accuracy": 0.6,
        },
        {
            "knnper": 0.5,
            "knnper_lambda": 0.3,
            "knnper_oracle_lambda": 0.3,
            "knnper_oracle_accuracy": 0.5,
        },
    ]
    assert lambda_ties([{"clients": clients}]) == [
        {"differs": 2, "same_accuracy": 1, "lower_accuracy": 1}
    ]


def _hurt_rows(knnper, fedavg, fedavg_plus, unseen=False):
    return [
        {
            "client_id": i,
            "unseen": unseen,
            "n_test": 10,
            "knnper": k,
            "fedavg": f,
            "fedavg+": p,
            "local": f - 0.1,
        }
        for i, (k, f, p) in enumerate(zip(knnper, fedavg, fedavg_plus, strict=True))
    ]


def test_clients_hurt_counts_clients_strictly_below_the_reference_across_seeds():
    # seed 0: 2 of 8 below FedAvg, one tie (not hurt); seed 1: 4 of 8 below
    seed0 = _hurt_rows([0.5, 0.5, 0.7, 0.7, 0.7, 0.7, 0.7, 0.6], [0.6] * 8, [0.8] * 8)
    seed1 = _hurt_rows([0.5, 0.5, 0.5, 0.5, 0.7, 0.7, 0.7, 0.7], [0.6] * 8, [0.4] * 8)
    hurt = clients_hurt([seed0, seed1], ["local", "fedavg", "fedavg+", "knnper"])
    h = hurt["seen"]["knnper"]["fedavg"]
    assert h["values"] == [0.25, 0.5] and h["share"] == pytest.approx(0.375)
    assert h["std"] == pytest.approx(np.std([0.25, 0.5], ddof=1))
    assert 0.0 <= h["low"] <= h["share"] <= h["high"] <= 1.0 and h["low"] < h["high"]
    assert hurt["seen"]["knnper"]["fedavg+"]["values"] == [1.0, 0.0]
    assert hurt["seen"]["local"] == {"fedavg": hurt["seen"]["local"]["fedavg"]}  # not vs FedAvg+
    assert hurt["seen"]["local"]["fedavg"]["share"] == 1.0
    assert "fedavg" not in hurt["seen"] and "fedavg+" in hurt["seen"]  # FedAvg+ vs FedAvg
    assert hurt["unseen"] == {}  # no unseen clients: nothing measured
    lines = format_hurt(hurt, "seen", {"knnper": "kNN-Per", "local": "Local"})
    assert lines[0] == "| method | below FedAvg, % | below FedAvg+, % |"
    assert any(line.startswith("| kNN-Per | 37.5 ± 17.7 [") for line in lines)


def test_clients_hurt_needs_enough_clients_and_the_reference():
    few = _hurt_rows(
        [0.5] * (MIN_CLIENTS - 1), [0.6] * (MIN_CLIENTS - 1), [0.6] * (MIN_CLIENTS - 1)
    )
    assert clients_hurt([few], ["fedavg", "fedavg+", "knnper"]) == {"seen": {}, "unseen": {}}
    rows = _hurt_rows([0.5] * 6, [0.6] * 6, [0.6] * 6)
    assert clients_hurt([rows], ["local", "knnper"]) == {"seen": {}, "unseen": {}}
