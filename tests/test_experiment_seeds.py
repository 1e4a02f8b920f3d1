"""`knnper experiment NAME --seeds N`: clients of several seeds are pooled as (seed, client id) and
resampled only within their own seed; the command writes each seed's report and the combined
one; a bad seed count is refused in one line."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from experiments.experiment_seeds import combine_points
from experiments.margins import Aligned, paired, resample
from knnper_cli.main import main
from tests.helpers.scripts import run_as_main

REPO = Path(__file__).resolve().parents[1]


def _rows() -> list[dict]:
    """Two seeds, client id 0 in both: (seed, client, accuracy at a, at b, test size)."""
    table = [
        (0, 0, 0.8, 0.6, 10),
        (0, 1, 0.5, 0.5, 30),
        (1, 0, 1.0, 0.5, 20),
        (1, 1, 0.7, 0.7, 20),
        (1, 2, 0.4, 0.2, 20),
    ]
    return [
        {"seed": s, "client_id": c, "point": p, "accuracy": acc, "n_test": n}
        for s, c, a, b, n in table
        for p, acc in (("a", a), ("b", b))
    ]


def test_aligned_keys_clients_by_seed_and_pools_their_weighted_means():
    aligned = Aligned(_rows(), [{"point": "a"}, {"point": "b"}])
    assert aligned.ids == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert aligned.strata == (2, 3)
    # (8 + 15 + 20 + 14 + 8) / 100 and (6 + 15 + 10 + 14 + 4) / 100
    assert aligned.means(np.arange(5)) == pytest.approx([0.65, 0.49])
    assert paired(aligned, 0, 1)["effect"] == pytest.approx(0.16)


def test_bootstrap_resamples_each_seed_within_itself():
    rng = np.random.default_rng(0)
    for _ in range(200):
        idx = resample(rng, (2, 3))
        assert len(idx) == 5 and set(idx[:2]) <= {0, 1} and set(idx[2:]) <= {2, 3, 4}
    # one seed draws exactly as a plain size did, so one-seed verdicts are unchanged
    assert np.array_equal(
        resample(np.random.default_rng(1), (7,)), np.random.default_rng(1).integers(0, 7, 7)
    )


def test_points_are_averaged_per_key_with_their_standard_deviation():
    seed0 = [{"alpha": "0.3", "all_mean": 0.8, "recipe": "flat", "seconds": 2.0}]
    seed1 = [{"alpha": "0.3", "all_mean": 0.6, "recipe": "hnsw", "seconds": 3.0}]
    [point] = combine_points([seed0, seed1], ("alpha",))
    assert point["all_mean"] == pytest.approx(0.7)
    assert point["all_mean_std"] == pytest.approx(np.std([0.8, 0.6], ddof=1))
    assert point["recipe"] == "flat / hnsw" and point["seconds"] == 5.0 and point["seeds"] == 2


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_two_seeds_write_each_seed_and_the_combined_report(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert (
        main(
            [
                "--threads",
                "1",
                "--no-progress",
                "experiment",
                "k-sigma",
                "--quick",
                "--seeds",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    folder = out / "k-sigma"
    for seed in (0, 1):  # each as a one-seed run writes it
        assert (folder / f"seed_{seed}" / "summary.md").exists()
        assert "seed" not in _csv(folder / f"seed_{seed}" / "clients.csv")[0]
    assert "--quick --seed 1`" in (folder / "seed_1" / "summary.md").read_text()
    assert {r["seed"] for r in _csv(folder / "clients.csv")} == {"0", "1"}
    points = _csv(folder / "points.csv")
    assert "all_mean_std" in points[0] and {p["seeds"] for p in points} == {"2"}
    summary = (folder / "summary.md").read_text()
    assert "--quick --seeds 2`" in summary and "2 seeds (0, 1)" in summary
    assert len(list((out / "runs").iterdir())) == 2  # one global model per seed
    # the rejudge script takes the combined folder and each seed's
    capsys.readouterr()
    script = REPO / "benchmarks" / "rejudge_experiments.py"
    assert run_as_main(script, [str(folder)], tmp_path, monkeypatch) in (0, None)
    assert capsys.readouterr().out.count("k-sigma") == 3


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_bad_seed_count_is_one_line_exit_2(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["experiment", "k-sigma", "--quick", "--seeds", value, "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--seeds" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
