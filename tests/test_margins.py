"""The experiments' verdict margins: a claim is called only where its interval clears the
threshold; the hardware and distribution-shift rules the review found too lenient."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.device_experiments import shift_claims
from experiments.hardware import _claims as hardware_claims
from experiments.margins import Aligned, call, paired, tally, two_se


def test_call_needs_the_interval_to_clear_the_threshold():
    assert call({"low": 0.1, "high": 0.3}) == "agree"
    assert call({"low": -0.1, "high": 0.3}) == "inconclusive"
    assert call({"low": -0.3, "high": -0.1}) == "disagree"
    assert call({"low": 0.001, "high": 0.003}, 0.002, above=False) == "inconclusive"
    assert call({"low": 0.0, "high": 0.001}, 0.002, above=False) == "agree"
    assert tally(["agree", "agree"]) == "agree"
    assert tally(["agree", "inconclusive"]) == "partly"
    assert tally(["inconclusive", "disagree"]) == "disagree"
    assert tally(["inconclusive"]) == "inconclusive"


def test_two_standard_errors():
    iv, verdict = two_se([0.01, 0.02, 0.0, 0.015])
    assert iv["se"] == pytest.approx(np.std([0.01, 0.02, 0.0, 0.015], ddof=1) / 2)
    assert verdict == "agree"
    assert two_se([0.01, -0.02, 0.0, 0.015])[1] == "inconclusive"


def _rows(rng, n, shift):
    base = rng.uniform(0.4, 0.9, n)
    return [{"point": "a", "client_id": i, "n_test": 50, "accuracy": base[i]} for i in range(n)] + [
        {
            "point": "b",
            "client_id": i,
            "n_test": 50,
            "accuracy": base[i] + shift + rng.normal(0, 0.01),
        }
        for i in range(n)
    ]


def test_paired_interval_sees_a_steady_shift_and_not_noise():
    rng = np.random.default_rng(0)
    clear = Aligned(_rows(rng, 40, 0.02), [{"point": "b"}, {"point": "a"}])
    assert call(paired(clear, 0, 1)) == "agree"
    noise = Aligned(_rows(rng, 40, 0.0), [{"point": "b"}, {"point": "a"}])
    assert call(paired(noise, 0, 1)) == "inconclusive"


def _hardware(strong_shift):
    rng = np.random.default_rng(1)
    clients = []
    for cid in range(40):
        base = rng.uniform(0.6, 0.9)
        for dc, delta in ((0.0, 0.0), (0.4, (-0.05 if cid < 20 else strong_shift))):
            clients.append(
                {
                    "version": "fractions",
                    "delta_c": dc,
                    "client_id": cid,
                    "test_accuracy": base + delta + rng.normal(0, 0.002),
                    "test_samples": 50,
                }
            )
    points = [
        {"version": "fractions", "delta_c": dc, "all_mean": 0.8 - dc / 10} for dc in (0.0, 0.4)
    ]
    return hardware_claims(points, clients, set(range(20)))[1]


def test_strong_clients_that_lose_too_are_no_agreement():
    """Diminishing returns need strong clients to gain; losing less than the weak is not it."""
    assert _hardware(0.02).verdict == "agree"
    assert _hardware(-0.02).verdict == "disagree"


def test_shift_claims_compare_streams_by_two_standard_errors():
    settings = {"steps": 6, "shift_at": 3}
    rng = np.random.default_rng(2)
    steps = []
    for seed in range(2):
        for client in range(10):
            for step in range(6):
                after = step >= 3
                for strategy, acc in (
                    ("fixed", 0.5 if after else 0.9),
                    ("fifo", 0.6 + 0.1 * (step - 3) if after else 0.9),
                    ("concatenate", 0.88 + rng.normal(0, 0.02) if not after else 0.6),
                ):
                    steps.append(
                        {
                            "seed": seed,
                            "client": client,
                            "step": step,
                            "strategy": strategy,
                            "accuracy": acc,
                        }
                    )
    verdicts = [c.verdict for c in shift_claims(steps, settings)]
    # fixed drops; fifo recovers; concatenate is not better than fixed before the shift
    assert verdicts[0] == "agree" and verdicts[1] == "agree"
    assert verdicts[2] == "disagree"
