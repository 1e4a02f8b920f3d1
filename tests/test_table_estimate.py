"""`bench table` says what its training will cost before the first job starts."""

from __future__ import annotations

import logging

import pytest
import torch

from experiments.table_estimate import TableEstimate, fedavg_steps, wall_seconds
from fed_train.algorithms.base import TrainingConfig
from tests.helpers.bench_table import TINY, bench


def test_fedavg_steps_count_each_training_clients_batches_per_round():
    training = TrainingConfig(rounds=10, participation=0.5, epochs=2, batch_size=16)
    # 2 epochs of ceil(n / 16) batches: 2 x (1 + 2 + 4) per round, half the clients sampled
    assert fedavg_steps([16, 17, 64, 0], training) == 10 * 0.5 * 2 * (1 + 2 + 4)
    fixed = TrainingConfig(rounds=3, steps=5, batch_size=16)
    assert fedavg_steps([1, 100], fixed) == 3 * 5 * 2


def test_wall_time_shares_the_jobs_out_but_never_below_the_longest():
    assert wall_seconds([6.0, 1.5, 1.0], 10.0, workers=1) == pytest.approx(85.0)
    assert wall_seconds([1.0, 1.0, 1.0, 1.0], 10.0, workers=2) == pytest.approx(20.0)
    assert wall_seconds([6.0, 1.0], 10.0, workers=4) == pytest.approx(60.0)  # APFL alone
    assert wall_seconds([], 10.0, workers=2) == 0.0


def test_the_line_says_time_and_disk():
    line = TableEstimate(35, 62.5, 2 * 3600 + 18 * 60, 1_690_000_000, 1).line()
    assert "35 training run(s)" in line and "2h18m00s" in line and "at least 1.6 GB" in line
    assert "at least 0.5 MB" in TableEstimate(3, 12.5, 22.0, 542_448, 1).line()


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_estimate_is_logged_before_the_first_job_and_not_when_all_are_cached(
    tmp_path, caplog, one_thread
):
    out = tmp_path / "table"
    argv = (*TINY, "--rounds", "1", "--methods", "fedavg,ditto", "--out", str(out))
    with caplog.at_level(logging.INFO, logger="experiments"):
        assert bench(*argv) == 0
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("experiments")]
    assert messages and messages[0].startswith("bench table: 2 training run(s) left")
    assert "6.5 FedAvg runs" in messages[0]  # fedavg 1.5 + ditto 5.0, the declared job costs
    assert any(" at lr=" in m for m in messages[1:])  # the jobs' own lines come after it
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="experiments"):
        assert bench(*argv) == 0
    assert "training run(s) left" not in caplog.text
