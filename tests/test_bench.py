"""`knnper bench table` end to end on digits, learning-rate tuning on validation, bad input."""

from __future__ import annotations

import csv
import dataclasses
import json

import numpy as np
import pytest
import torch

from experiments.lr_tuning import (
    LR_GRID,
    check_lr_grid,
    choose_lr,
    parse_lr_grid,
    validation_score,
)
from experiments.tables import METHODS, BenchError, check_validation_splits
from fed_train.algorithms.base import ClientData, PersonalModel
from fed_train.evaluation import client_accuracies
from tests.helpers.bench_table import LEAN, TINY, bench
from tests.helpers.interrupts import interrupt_after


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_bench_table_writes_both_tables_and_per_client_results(tmp_path, capsys):
    out = tmp_path / "table"
    assert bench(*LEAN, "--methods", "all", "--out", str(out)) == 0
    printed = capsys.readouterr().out
    assert "Table 1: clients seen in training" in printed and "Table 2: unseen clients" in printed
    for name in ("table.md", "table1.csv", "table2.csv", "clients.csv", "results.json"):
        assert (out / name).is_file(), name
    for table in ("table1.csv", "table2.csv"):
        rows = list(csv.DictReader((out / table).open()))
        assert [r["method"] for r in rows] == list(METHODS)
        for r in rows:
            assert 0.0 <= float(r["bottom_decile"]) <= float(r["mean"]) + 1e-9 <= 1.0 + 1e-9
    result = json.loads((out / "results.json").read_text())
    assert set(result["seen"]) == set(result["unseen"]) == set(METHODS)
    clients = list(csv.DictReader((out / "clients.csv").open()))
    assert len(clients) == 8 and all(m in clients[0] for m in METHODS)
    # FedAvg is trained once and shared by FedAvg, FedAvg+ and kNN-Per
    assert sorted(p.name for p in (out / "runs").iterdir()) == sorted(
        {"fedavg", "clustered", "ditto", "fedrep", "apfl", "pfedgp"}
    )

    # a second run resumes from the cached runs and results and writes the same numbers
    before = (out / "table1.csv").read_text()
    assert bench(*LEAN, "--methods", "fedavg,knnper", "--out", str(out)) == 0
    rows = list(csv.DictReader((out / "table1.csv").open()))
    assert [r["method"] for r in rows] == ["fedavg", "knnper"]
    assert {r["method"]: r["mean"] for r in rows}.items() <= {
        r["method"]: r["mean"] for r in csv.DictReader(before.splitlines())
    }.items()


def test_a_folder_holding_another_table_is_refused(tmp_path):
    out = tmp_path / "table"
    assert bench(*TINY, "--rounds", "1", "--methods", "fedavg", "--out", str(out)) == 0
    with pytest.raises(BenchError, match="different configuration"):
        bench(*TINY, "--rounds", "1", "--clients", "9", "--methods", "fedavg", "--out", str(out))


def test_tuning_picks_the_learning_rate_on_validation(tmp_path):
    out = tmp_path / "tuned"
    assert (
        bench(
            *TINY,
            "--rounds",
            "1",
            "--methods",
            "fedavg,knnper",
            "--tune-lr",
            "--lr-grid",
            "0.1,0.01",
            "--out",
            str(out),
        )
        == 0
    )
    result = json.loads((out / "results.json").read_text())
    for method in ("fedavg", "knnper"):
        scores = result["validation"][method]
        assert set(scores) == {"0.1", "0.01"}
        assert f"{result['lr'][method]:g}" == max(scores, key=scores.get)
    assert sorted(p.name for p in (out / "runs" / "fedavg").iterdir()) == ["lr_0.01", "lr_0.1"]


def _client(cid: int, n_val: int, unseen: bool = False) -> ClientData:
    x = torch.zeros(4, 2)
    y = torch.zeros(4, dtype=torch.int64)
    return ClientData(cid, x, y, x[:n_val], y[:n_val], x, y, unseen)


def test_validation_score_uses_only_seen_clients_validation_splits():
    rows = [
        {"unseen": False, "n_val": 1, "val_accuracy": 1.0, "accuracy": 0.0},
        {"unseen": False, "n_val": 3, "val_accuracy": 0.0, "accuracy": 1.0},
        {"unseen": True, "n_val": 9, "val_accuracy": 1.0, "accuracy": 1.0},
    ]
    assert validation_score(rows) == pytest.approx(0.25)
    assert choose_lr({0.1: 0.5, 0.01: 0.7, 0.001: 0.7}) == 0.01  # ties: first in grid order
    assert LR_GRID == pytest.approx((10**-0.5, 0.1, 10**-1.5, 0.01, 10**-2.5))


def test_client_accuracies_with_validation_add_the_validation_accuracy():
    class Constant:
        name = "constant"

        def personalize(self, weights, client, state, seed):
            return PersonalModel(lambda x: np.tile([1.0, 0.0], (len(x), 1)))

    clients = [_client(0, 2), _client(1, 0, unseen=True)]
    rows = client_accuracies(Constant(), {}, {}, clients, validation=True)
    plain = client_accuracies(Constant(), {}, {}, clients)
    assert [r["accuracy"] for r in rows] == [r["accuracy"] for r in plain] == [1.0, 1.0]
    assert [(r["n_val"], r["val_accuracy"]) for r in rows] == [(2, 1.0), (0, None)]


def test_rows_read_back_from_a_journal_are_counted_but_never_timed(tmp_path, monkeypatch):
    from fed_train import evaluation
    from fed_train.journal import ClientRows

    class Constant:
        name = "constant"

        def personalize(self, weights, client, state, seed):
            return PersonalModel(lambda x: np.tile([1.0, 0.0], (len(x), 1)))

    updates = []
    real = evaluation.Progress

    class Recorder(real):
        def update(self, work=1.0, *, measured=True):
            updates.append(measured)
            super().update(work, measured=measured)

    monkeypatch.setattr(evaluation, "Progress", Recorder)
    clients = [_client(i, 2) for i in range(4)]
    journal = ClientRows(tmp_path / "rows.jsonl", {"method": "constant"})
    first = client_accuracies(Constant(), {}, {}, clients[:2], journal=journal)
    again = client_accuracies(Constant(), {}, {}, clients, journal=journal)
    assert again[:2] == first and updates == [True, True, False, False, True, True]
    other = ClientRows(tmp_path / "rows.jsonl", {"method": "another"})  # other settings
    client_accuracies(Constant(), {}, {}, clients, journal=other)
    assert updates[-4:] == [True] * 4


@pytest.mark.parametrize("grid", [[0.1, 3.0], [0.0], [-0.01], [float("nan")], []])
def test_learning_rate_grid_values_out_of_range_are_refused(grid):
    with pytest.raises(ValueError, match="out of range|empty"):
        check_lr_grid(grid)


def test_bad_command_lines_are_clear_errors(tmp_path):
    out = tmp_path / "bad"
    with pytest.raises(BenchError, match="unknown method 'fedsgd'"):
        bench(*TINY, "--methods", "fedavg,fedsgd", "--out", str(out))
    with pytest.raises(BenchError, match="grid value 3.0 is out of range"):
        bench(*TINY, "--tune-lr", "--lr-grid", "0.1,3", "--out", str(out))
    with pytest.raises(BenchError, match="only with --tune-lr"):
        bench(*TINY, "--lr-grid", "0.1", "--out", str(out))
    with pytest.raises(ValueError, match="'x' is not a number"):
        parse_lr_grid("0.1,x")
    with pytest.raises(BenchError, match="no validation data"):
        bench(*TINY, "--val-fraction", "0", "--out", str(out))
    assert not out.exists()  # nothing written for a table that cannot be made


def test_a_client_without_validation_data_is_named():
    with pytest.raises(BenchError, match=r"1 client\(s\) have no validation data \(client 7\)"):
        check_validation_splits([_client(3, 2), _client(7, 0, unseen=True)])


@pytest.mark.slow
def test_tuned_knn_table_with_workers_and_attribution(tmp_path):
    """kNN-Per's k / sigma / normalisation chosen on validation, the oracle-lambda report, two
    worker processes, and every head on every body: the same table a single process writes."""
    out = tmp_path / "table"
    # the attribution's knn+own head is the kNN with each body's own model and each client's
    # own lambda: the table's kNN-Per with that base and rule pinned
    argv = [
        *LEAN,
        "--methods",
        "fedavg,fedrep,pfedgp,knnper",
        "--lambda-estimator",
        "auto",
        "--lambda-rule",
        "client",
        "--base",
        "global",
        "--attribution",
    ]
    assert bench(*argv, "--workers", "2", "--out", str(out)) == 0
    result = json.loads((out / "results.json").read_text())
    knn = result["knn"]
    assert knn["source"]["k"] == "validation" and knn["config"]["k"] in (5, 10, 20, 50)
    assert knn["config"]["normalize"] in ("none", "l2")
    assert knn["estimator"] == max(
        knn["lambda_cv"], key=lambda e: (knn["lambda_cv"][e], e == "val")
    )
    assert len(knn["grid"]) == 4 * 13 * 2
    assert knn["oracle"]["seen"]["mean"] >= result["seen"]["knnper"]["mean"] - 1e-12
    assert result["command"].startswith("knnper ")
    summary = result["attribution"]["summary"]
    for body in ("fedavg", "fedrep", "pfedgp"):
        for head in ("own", "linear", "gp", "knn", "knn+own"):
            assert summary[f"{body}/{head}"]["seen"]["clients"] > 0, (body, head)
    # kNN-Per on FedAvg's body is the table's kNN-Per, and each "own" head the method's row
    assert summary["fedavg/knn+own"]["seen"] == pytest.approx(result["seen"]["knnper"])
    assert summary["fedrep/own"]["seen"] == pytest.approx(result["seen"]["fedrep"])
    table = (out / "table.md").read_text()
    assert "test-oracle lambda" in table and "every head on every body" in table
    assert (out / "attribution.csv").is_file()
    # one process reading the same caches writes the same table
    again = tmp_path / "again"
    assert bench(*argv, "--out", str(again)) == 0
    assert json.loads((again / "results.json").read_text())["seen"] == result["seen"]


def test_a_diverging_learning_rate_is_skipped_by_tuning_and_fails_a_fixed_table(
    tmp_path, monkeypatch
):
    import fed_train.algorithms.base as base_module
    from fed_train.errors import TrainingDiverged, TrainingError

    real = base_module.local_sgd

    def diverge_at_large_lr(model, x, y, training, lr, seed, **kw):
        if lr > 0.5:
            raise TrainingDiverged(f"the training loss became nan (lr={lr:g})")
        return real(model, x, y, training, lr, seed, **kw)

    monkeypatch.setattr(base_module, "local_sgd", diverge_at_large_lr)
    out = tmp_path / "tuned"
    assert (
        bench(*TINY, "--methods", "fedavg", "--tune-lr", "--lr-grid", "0.9,0.05", "--out", str(out))
        == 0
    )
    result = json.loads((out / "results.json").read_text())
    assert result["lr"]["fedavg"] == 0.05 and result["validation"]["fedavg"]["0.9"] is None
    assert "diverged" in json.loads((out / "eval" / "fedavg" / "lr_0.9.json").read_text())
    with pytest.raises(TrainingError, match="nan"):
        bench(*TINY[:-1], "0.9", "--methods", "fedavg", "--out", str(tmp_path / "fixed"))


@pytest.mark.slow
def test_a_broken_checkpoint_stops_the_table_instead_of_passing_for_a_divergence(tmp_path):
    """A run folder whose checkpoints cannot be resumed (copied from an older version, say) is
    a folder to clean up: tuning must not record that learning rate as diverged and go on."""
    from fed_train.simulation import CheckpointError

    out = tmp_path / "table"
    grid = ("--methods", "fedavg", "--tune-lr", "--lr-grid", "0.1,0.05", "--out", str(out))
    assert bench(*TINY, *grid) == 0
    for path in (out / "runs" / "fedavg" / "lr_0.1" / "checkpoints").glob("round_*.pt"):
        path.write_bytes(b"not a checkpoint")
    (out / "eval" / "fedavg" / "lr_0.1.json").unlink()
    with pytest.raises(CheckpointError, match="no good checkpoint"):
        bench(*TINY, *grid)
    assert not (out / "eval" / "fedavg" / "lr_0.1.json").exists()


# ClusteredFL splits whenever three clients report (the official tolerances never split on so
# small a run), so the test has several clusters for its new clients to choose from
SPLIT_ALWAYS = {"eps1": 1e9, "eps2": 0.0, "min_split_size": 3}


@pytest.mark.slow
def test_permuting_test_labels_changes_no_choice(tmp_path, monkeypatch):
    """The leak test: with every client's test labels changed, every choice a table makes stays
    the same (learning rates; kNN-Per's k / sigma / normalisation / estimator and lambdas on the
    loo+val path the fair tables took; Ditto's lambda; APFL's alpha; fine-tuning epochs; the
    cluster a new client joins among several; the linear head's l2; and the attribution's kNN
    choices and lambdas on every body); only test accuracies move."""
    import experiments.tables as bench_module
    import knnper_cli.bench as bench_command

    real_prepare, real_table = bench_module.prepare_clients, bench_module.run_table

    def wrong_test_labels(dataset, partition, *args, **kwargs):
        # every client's test labels moved to the next class, after partitioning (the partition
        # deals test samples by label): a choice made on test labels now prefers what is worst
        # on the true ones, so it flips even where a random permutation leaves small test
        # splits tied
        return [
            dataclasses.replace(c, y_test=(c.y_test + 1) % dataset.num_classes)
            for c in real_prepare(dataset, partition, *args, **kwargs)
        ]

    def with_clusters(config, methods, out, options, **kwargs):
        hyper = {**options.hyper, "clustered": SPLIT_ALWAYS}
        return real_table(config, methods, out, dataclasses.replace(options, hyper=hyper), **kwargs)

    monkeypatch.setattr(bench_module, "run_table", with_clusters)
    monkeypatch.setattr(bench_command, "run_table", with_clusters)  # the name the CLI calls
    argv = [
        # 400 training samples, not LEAN's 700: where every client's validation labels were
        # moved as the test labels are here, each kind of choice checked below still changed
        # at this size (lr, kNN config and lambdas, Ditto, APFL, fine-tuning, cluster, l2,
        # attribution), so a choice that read the test labels would still show
        *LEAN[: LEAN.index("--max-train")],
        "--max-train",
        "400",
        "--clients",
        "12",
        "--unseen-fraction",
        "0.5",
        "--methods",
        "all",
        "--tune-lr",
        "--lr-grid",
        "0.1,0.03",
        "--lambda-estimator",
        "loo+val",
        "--attribution",
    ]
    assert bench(*argv, "--out", str(tmp_path / "plain")) == 0
    monkeypatch.setattr(bench_module, "prepare_clients", wrong_test_labels)
    assert bench(*argv, "--out", str(tmp_path / "permuted")) == 0
    plain, permuted = (
        json.loads((tmp_path / d / "results.json").read_text()) for d in ("plain", "permuted")
    )
    # the paths the test must take, or a leak there would go unseen
    assert plain["knn"]["estimator"] == "loo+val"
    new = [c for c in plain["clients"] if c["unseen"]]
    assert new and all(c["clustered_picked_on_validation"] for c in new)
    assert min(c["clustered_clusters"] for c in new) >= 2
    assert {"fedavg/knn+own", "fedrep/knn", "pfedgp/knn+own"} <= set(plain["attribution"]["knn"])

    assert plain["lr"] == permuted["lr"]
    assert plain["validation"] == permuted["validation"]
    for key in ("config", "estimator", "lambda_cv", "grid", "lambda_rule", "lambda_rule_cv"):
        assert plain["knn"][key] == permuted["knn"][key], key
    assert plain["linear"] == permuted["linear"]  # the linear head's l2 and its evidence
    accuracy_columns = {
        "n_test",
        *METHODS,
        "knnper_oracle_lambda",
        "knnper_oracle_accuracy",
        "knnper_cross_oracle_accuracy",
    }
    for a, b in zip(plain["clients"], permuted["clients"], strict=True):
        choices = {k: v for k, v in a.items() if k not in accuracy_columns}
        assert choices == {k: v for k, v in b.items() if k not in accuracy_columns}
    for key, info in plain["attribution"]["knn"].items():
        other = permuted["attribution"]["knn"][key]
        assert {k: v for k, v in info.items() if k != "lambda_report"} == {
            k: v for k, v in other.items() if k != "lambda_report"
        }, key
    for a, b in zip(
        plain["attribution"]["clients"], permuted["attribution"]["clients"], strict=True
    ):
        assert {k: v for k, v in a.items() if k != "accuracy"} == {
            k: v for k, v in b.items() if k != "accuracy"
        }
    assert plain["seen"] != permuted["seen"]  # the change did reach the test labels


def test_seeds_run_one_table_per_seed_and_summarize_them(tmp_path):
    out = tmp_path / "seeds"
    assert (
        bench(
            *LEAN,
            "--methods",
            "fedavg,knnper",
            "--seed",
            "3",
            "--seeds",
            "2",
            "--out",
            str(out),
        )
        == 0
    )
    partitions = [json.loads((out / f"seed_{s}" / "results.json").read_text()) for s in (3, 4)]
    assert [p["config"]["seed"] for p in partitions] == [3, 4]
    assert partitions[0]["clients"] != partitions[1]["clients"]
    summary = json.loads((out / "seeds.json").read_text())
    assert summary["seeds"] == [3, 4]
    fedavg = summary["spread"]["seen"]["fedavg"]["mean"]
    assert fedavg["values"] == [p["seen"]["fedavg"]["mean"] for p in partitions]
    assert summary["versus_best"]["seen"]["mean"]["baseline"] == "fedavg"
    assert "mean ± standard deviation" in (out / "seeds.md").read_text()


def test_an_interrupted_table_keeps_each_finished_client(tmp_path, monkeypatch):
    from fed_train.algorithms.local import Local

    out = tmp_path / "table"
    with monkeypatch.context() as m:
        first = interrupt_after(m, Local, 3)
        with pytest.raises(KeyboardInterrupt):
            bench(*TINY, "--methods", "local", "--out", str(out))
    assert len(first) == 3
    with monkeypatch.context() as m:
        resumed = interrupt_after(m, Local, 100)
        assert bench(*TINY, "--methods", "local", "--out", str(out)) == 0
    assert len(resumed) == 8 - 3 and not set(first) & set(resumed)
    assert not list((out / "eval").rglob("*.partial.jsonl"))  # the method's rows replace it
    rows = json.loads((out / "results.json").read_text())["clients"]
    assert sorted(r["client_id"] for r in rows) == list(range(8))


def test_a_baseline_defined_in_one_file_runs_in_the_table(tmp_path, monkeypatch):
    from fed_train.algorithms import ALGORITHMS
    from tests.helpers.centroid_baseline import NearestCentroid

    monkeypatch.setitem(ALGORITHMS, "centroid", NearestCentroid)  # its one registration line
    out = tmp_path / "table"
    assert bench(*TINY, "--rounds", "1", "--methods", "fedavg,centroid", "--out", str(out)) == 0
    rows = list(csv.DictReader((out / "table1.csv").open()))
    assert [r["method"] for r in rows] == ["fedavg", "centroid"]
    assert 0.0 < float(rows[1]["mean"]) <= 1.0
    assert "| FedAvg + class means |" in (out / "table.md").read_text()
    assert [p.name for p in (out / "runs").iterdir()] == ["fedavg"]  # trained once, shared


def test_a_table_cache_whose_rows_are_not_the_runs_clients_is_computed_again(tmp_path, caplog):
    """A duplicated or `client_id: true` row in a table cache changed the table (46.6% ->
    56.2%); its rows must be one per client of the run, each that client's."""
    out = tmp_path / "table"
    assert bench(*TINY, "--methods", "fedavg", "--out", str(out)) == 0
    cache = next((out / "eval" / "fedavg").glob("*.json"))
    honest = json.loads(cache.read_text())
    with caplog.at_level("WARNING"):
        assert bench(*TINY, "--methods", "fedavg", "--out", str(out)) == 0
    assert "computing them again" not in caplog.text  # an honest cache is read back
    for crafted in (
        [*honest["rows"], honest["rows"][0]],
        [{**honest["rows"][0], "client_id": True}, *honest["rows"][1:]],
        [{**honest["rows"][0], "accuracy": 1.0, "n_test": 10**6}, *honest["rows"][1:]],
    ):
        cache.write_text(json.dumps({**honest, "rows": crafted}))
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert bench(*TINY, "--methods", "fedavg", "--out", str(out)) == 0
        assert "computing them again" in caplog.text
        assert json.loads(cache.read_text())["rows"] == honest["rows"]
