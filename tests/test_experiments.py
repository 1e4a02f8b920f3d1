"""`knnper experiment NAME --quick`: every experiment of the family runs on digits into one shared
folder, writes its CSV, plot and summary, resumes from its finished points, and refuses bad
grids before training anything."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from experiments import context as experiment_context
from experiments.lambda_vs_n import step_fit
from experiments.points import PointStore
from experiments.registry import EXPERIMENTS
from knnper_cli import experiment as experiment_cli
from knnper_cli.main import main

pytestmark = pytest.mark.slow

PNG = b"\x89PNG\r\n\x1a\n"


def knnper(*argv: str) -> int:
    return main(["--threads", "1", "--no-progress", *argv])


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> Path:
    """One folder for the whole family, so later experiments reuse the global models."""
    return tmp_path_factory.mktemp("experiments")


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_quick_experiment_writes_points_plot_and_summary(family, name, capsys, monkeypatch):
    bars = []

    class Counted(experiment_cli.Progress):
        def __init__(self, total, **kwargs):
            super().__init__(total, **kwargs)
            bars.append(self)

    monkeypatch.setattr(experiment_cli, "Progress", Counted)
    assert knnper("experiment", name, "--quick", "--out", str(family)) == 0
    if EXPERIMENTS[name].count is not None:  # the progress total is what the points are
        assert bars[0].total is not None and bars[0].done == bars[0].total, name
    folder = family / name
    points = read_csv(folder / "points.csv")
    assert points, name
    summary = (folder / "summary.md").read_text()
    assert "**The paper:**" in summary and "| the paper | we measured | verdict |" in summary
    assert f"Command: `knnper --threads 1 experiment {name} --out {family} --quick`" in summary
    plot = next(p for p in folder.glob("*.png"))
    assert plot.read_bytes()[:8] == PNG and f"]({plot.name})" in summary
    claims = summary.split("| the paper | we measured | verdict |\n|---|---|---|\n", 1)[1]
    verdicts = [row.rsplit("|", 2)[1].strip() for row in claims.split("\n\n", 1)[0].splitlines()]
    assert verdicts and set(verdicts) <= {
        "agree",
        "disagree",
        "partly",
        "inconclusive",
        "not measured",
    }, verdicts
    assert capsys.readouterr().out.count("# Experiment:") == 1


def test_rerun_resumes_from_finished_points_without_training(family, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("a finished experiment trained again")

    monkeypatch.setattr(experiment_context, "train", no_training)
    before = (family / "capacity" / "points.jsonl").read_text()
    for name in ("heterogeneity", "capacity"):
        assert knnper("experiment", name, "--quick", "--out", str(family)) == 0
    assert (family / "capacity" / "points.jsonl").read_text() == before
    # the quick grid given explicitly: the same (cached) points, and the command says so
    assert knnper("experiment", "k-sigma", "--quick", "--ks", "10,3", "--out", str(family)) == 0
    assert "--quick --ks 10,3`" in (family / "k-sigma" / "summary.md").read_text()


def test_cached_embedding_sweep_equals_knnper_evaluate(family):
    """capacity 1 through the cached embeddings is `knnper evaluate`'s kNN-Per, client by client."""
    evaluated = {
        r["client_id"]: r
        for r in read_csv(family / "heterogeneity" / "clients.csv")
        if r["alpha"] == "0.3" and r["method"] == "knnper"
    }
    swept = {
        r["client_id"]: r
        for r in read_csv(family / "capacity" / "clients.csv")
        if r["alpha"] == "0.3" and float(r["capacity"]) == 1.0
    }
    assert evaluated.keys() == swept.keys()
    for cid, row in evaluated.items():
        assert float(row["accuracy"]) == pytest.approx(float(swept[cid]["accuracy"]), abs=1e-12)
        assert float(row["lambda"]) == float(swept[cid]["lambda"])


def test_base_model_replay_ends_at_the_shared_global_model(family):
    last = max(read_csv(family / "base-model" / "points.csv"), key=lambda r: int(r["round"]))
    fedavg = next(
        r
        for r in read_csv(family / "heterogeneity" / "points.csv")
        if r["alpha"] == "0.3" and r["method"] == "fedavg"
    )
    assert float(last["fedavg_mean"]) == pytest.approx(float(fedavg["all_mean"]), abs=1e-6)
    rounds = [int(r["round"]) for r in read_csv(family / "base-model" / "points.csv")]
    assert rounds == [1, 2, 3]  # --quick checkpoints every round and keeps each one


def test_hardware_byte_budgets_are_measured_on_written_bundles(family):
    rows = [r for r in read_csv(family / "hardware" / "clients.csv") if r["version"] == "bytes"]
    assert rows and all(int(r["total_bytes"]) <= int(r["budget"]) for r in rows)
    assert {r["delta_c"] for r in rows} == {"0", "0.3"}
    weak = [r for r in rows if r["delta_c"] == "0.3"]
    assert (
        len(
            {
                int(r["budget"])
                > int(
                    next(
                        x for x in rows if x["delta_c"] == "0" and x["client_id"] == r["client_id"]
                    )["budget"]
                )
                for r in weak
            }
        )
        == 2
    )  # half the devices lost bytes, half gained


@pytest.mark.parametrize(
    "argv, message",
    [
        (["experiment", "nope"], "invalid choice: 'nope'"),
        (["experiment", "heterogeneity", "--alphas", ""], "the grid is empty"),
        (["experiment", "heterogeneity", "--alphas", "0.3,-1"], "-1 is out of range"),
        (["experiment", "capacity", "--capacities", "0.5,1.5"], "1.5 is out of range"),
        (["experiment", "hardware", "--delta-cs", "0.5"], "0.5 is out of range"),
        (["experiment", "k-sigma", "--ks", "0"], "0 is out of range"),
        (["experiment", "k-sigma", "--sigmas", "abc"], "'abc' is not a number"),
        (["experiment", "protonn-grid", "--prototype-fractions", ","], "the grid is empty"),
    ],
)
def test_bad_input_is_one_line_exit_2_before_training(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        knnper(*argv, "--quick", "--out", str(out))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_point_store_recomputes_only_a_torn_point(tmp_path):
    path = tmp_path / "points.jsonl"
    store = PointStore(path)
    assert store.compute({"x": 1}, lambda: {"value": 1})["value"] == 1
    with open(path, "a") as f:
        f.write('{"key": {"x": 2}, "rec')  # killed mid-write
    calls = []
    again = PointStore(path)
    assert again.compute({"x": 1}, lambda: calls.append(1) or {"value": -1})["value"] == 1
    assert again.compute({"x": 2}, lambda: {"value": 2})["value"] == 2
    assert calls == [] and len(PointStore(path)) == 2
    assert json.loads(path.read_text().splitlines()[0])["record"]["value"] == 1


def test_step_fit_finds_the_bound_threshold_and_refuses_a_downward_step():
    n = np.array([10, 20, 30, 100, 200, 300], dtype=float)
    threshold, below, above, explained = step_fit(n, np.array([0, 0.1, 0, 0.9, 1, 1.0]))
    assert threshold == 30 and below < 0.1 and above > 0.9 and explained > 0.9
    *_, explained = step_fit(n, np.array([1, 1, 1, 0, 0, 0.0]))
    assert explained == 0.0
