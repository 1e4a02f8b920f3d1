"""kNN-Per's configuration is chosen once on validation, saved in the run directory with its
evidence, reused by later commands, chosen again (with one line) when the model changes, and a
damaged file is refused in one line."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest
import torch

from edge_runtime.knn import choice_key
from fed_train.algorithms.base import TrainingConfig
from fed_train.errors import KnnperError
from fed_train.knn_choice import KNN_CONFIG_FILE, choose, load_or_choose, model_sha256
from fed_train.knn_request import (
    FROM_FLAG,
    FROM_PAPER,
    FROM_VALIDATION,
    K_GRID,
    SIGMA_GRID,
    KNNRequest,
)
from fed_train.run import MODEL_FILE, RunConfig, load_run, train
from fed_train.run_evaluation import evaluate_run
from knnper_cli.main import main as knnper_main


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("knnchoice") / "run"
    config = RunConfig(
        dataset="digits",
        clients=6,
        unseen_fraction=0.34,
        seed=3,
        training=TrainingConfig(rounds=2, epochs=1, batch_size=16, lr=0.05),
    )
    train(config, out, progress=False)
    return out


def test_requests_say_what_is_searched_and_where_each_value_comes_from():
    tuned = KNNRequest()
    assert tuned.grids() == (K_GRID, SIGMA_GRID, ("none", "l2"))
    assert tuned.estimator() == "auto" and tuned.rule() == "auto"
    assert set(tuned.sources().values()) == {FROM_VALIDATION}
    paper = KNNRequest("paper")
    assert paper.grids() == ((10,), (1.0,), ("none",)) and paper.estimator() == "val"
    assert paper.rule() == "client"
    assert set(paper.sources().values()) == {FROM_PAPER}
    pinned = KNNRequest(k=5, normalize="l2")
    assert pinned.grids() == ((5,), SIGMA_GRID, ("l2",))
    assert pinned.sources() == {
        "k": FROM_FLAG,
        "sigma": FROM_VALIDATION,
        "normalize": FROM_FLAG,
        "lambda_estimator": FROM_VALIDATION,
        "lambda_rule": FROM_VALIDATION,
        "base": FROM_VALIDATION,
    }
    assert (
        KNNRequest("paper", lambda_estimator="loo+val").sources()["lambda_estimator"] == FROM_FLAG
    )
    assert KNNRequest("paper", lambda_rule="pooled").sources()["lambda_rule"] == FROM_FLAG
    assert paper.base_choice() == "global" and tuned.base_choice() == "auto"
    assert KNNRequest("paper", base="linear").sources()["base"] == FROM_FLAG
    for bad in (
        {"mode": "best"},
        {"k": 0},
        {"sigma": -1.0},
        {"normalize": "l1"},
        {"lambda_estimator": "test"},
        {"lambda_rule": "oracle"},
        {"base": "local"},
    ):
        with pytest.raises(KnnperError):
            KNNRequest(**bad)


def test_the_choice_is_saved_with_its_evidence_and_reused(run_dir, monkeypatch):
    run = load_run(run_dir)
    clients = run.clients()
    choice = load_or_choose(run_dir, run.model, clients, KNNRequest(), seed=0)
    saved = json.loads((run_dir / KNN_CONFIG_FILE).read_text())
    assert saved["model_sha256"] == model_sha256(run.model)
    record = saved["choices"][KNNRequest().key()]
    assert len(record["grid"]) == len(K_GRID) * len(SIGMA_GRID) * 2
    best = min(record["grid"], key=lambda r: choice_key(r["val_accuracy"], r["val_nll"]))
    assert (best["k"], best["sigma"], best["normalize"]) == (
        choice.config.k,
        choice.config.sigma,
        choice.config.normalize,
    )
    assert set(record["lambda_cv"]) == {"val", "loo+val"}
    seen = [c for c in clients if not c.unseen and len(c.y_val)]
    assert record["chosen_on"]["clients"] == [c.client_id for c in seen]
    assert record["chosen_on"]["samples"] == sum(len(c.y_val) for c in seen)
    assert "oracle_rows" not in record  # nothing per client from the test splits is kept

    def refuse(*args, **kwargs):
        raise AssertionError("a saved choice must be reused, not made again")

    monkeypatch.setattr("fed_train.knn_choice.choose_knn", refuse)
    again = load_or_choose(run_dir, run.model, clients, KNNRequest(), seed=0)
    assert again == choice


def test_a_changed_model_is_chosen_for_again_with_one_line(run_dir, tmp_path, caplog):
    run = load_run(run_dir)
    clients = run.clients()
    load_or_choose(run_dir, run.model, clients, KNNRequest("paper"), seed=0)
    with torch.no_grad():
        next(run.model.parameters()).mul_(1.5)
    with caplog.at_level(logging.WARNING):
        load_or_choose(run_dir, run.model, clients, KNNRequest("paper"), seed=0)
    lines = [r.getMessage() for r in caplog.records if "choosing kNN-Per" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    saved = json.loads((run_dir / KNN_CONFIG_FILE).read_text())
    assert saved["model_sha256"] == model_sha256(run.model)
    assert list(saved["choices"]) == [KNNRequest("paper").key()]  # the old weights' are gone


@pytest.mark.parametrize("content", ["{not json", "[]", '{"model_sha256": 1, "choices": {}}'])
def test_a_damaged_file_is_refused_in_one_line(run_dir, tmp_path, capsys, content):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / KNN_CONFIG_FILE).write_text(content)
    code = knnper_main(["--no-progress", "evaluate", str(copy), "--methods", "knnper"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and KNN_CONFIG_FILE in err, err


def test_a_forged_saved_choice_is_refused(run_dir, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    run = load_run(copy)
    load_or_choose(copy, run.model, run.clients(), KNNRequest("paper"), seed=0)
    saved = json.loads((copy / KNN_CONFIG_FILE).read_text())
    saved["choices"][KNNRequest("paper").key()]["config"]["k"] = "ten"
    (copy / KNN_CONFIG_FILE).write_text(json.dumps(saved))
    with pytest.raises(KnnperError, match="malformed"):
        load_or_choose(copy, run.model, run.clients(), KNNRequest("paper"), seed=0)


def test_evaluate_runs_the_saved_choice_and_prints_where_it_came_from(run_dir, capsys):
    assert (
        knnper_main(
            [
                "--no-progress",
                "evaluate",
                str(run_dir),
                "--methods",
                "knnper",
                "--knn-config",
                "paper",
                "--k",
                "5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "k=5 (flag)" in out and "sigma=1 (paper default)" in out
    result = evaluate_run(
        load_run(run_dir), ["knnper"], knn=KNNRequest("paper", k=5), progress=False
    )
    assert result["knn"]["config"] == {"k": 5, "sigma": 1.0, "normalize": "none"}
    assert (run_dir / MODEL_FILE).exists()


@pytest.fixture(scope="module")
def chosen(run_dir, tmp_path_factory):
    """A copy of the run with a saved tuned and a saved paper choice."""
    import shutil

    copy = tmp_path_factory.mktemp("knnchoice-edits") / "run"
    shutil.copytree(run_dir, copy)
    run = load_run(copy)
    for request in (KNNRequest(), KNNRequest("paper")):
        load_or_choose(copy, run.model, run.clients(), request, seed=0)
    return copy


def _refused_by_evaluate(run, tmp_path, capsys, write, *needles: str, knn: str = "paper") -> None:
    """`evaluate` on a copy whose knn_config.json `write` changed fails in one line, exit 2."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    path = copy / KNN_CONFIG_FILE
    write(path, json.loads(path.read_text()))
    capsys.readouterr()
    code = knnper_main(
        ["--no-progress", "evaluate", str(copy), "--methods", "knnper", "--knn-config", knn]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in (str(path), "delete it", *needles):
        assert needle in err, err


def _edit_paper(**changes):
    def write(path, saved):
        config = saved["choices"][KNNRequest("paper").key()]["config"]
        for key, value in changes.items():
            if value is _MISSING:
                del config[key]
            else:
                config[key] = value
        path.write_text(json.dumps(saved))

    return write


_MISSING = object()


@pytest.mark.parametrize(
    ("write", "needle"),
    [
        (lambda p, s: p.write_bytes(b"\x00\xff\xfe binary"), "not UTF-8"),
        (lambda p, s: p.write_bytes(json.dumps(s).encode("utf-16")), "not UTF-8"),
        (lambda p, s: p.write_text("[" * 100_000 + "]" * 100_000), "nested deeper"),
        (lambda p, s: p.write_text('{"model_sha256": ' + "7" * 5000 + "}"), "not usable JSON"),
        (_edit_paper(k=2.5), "k must be int"),
        (_edit_paper(k=True), "k must be int"),
        (_edit_paper(k=None), "k must be int"),
        (_edit_paper(k=_MISSING), "lacks 'k'"),
        (_edit_paper(k=2**70), "k must be an integer from 1"),
        (_edit_paper(sigma=1e-320), "sigma must be a number from"),
        (_edit_paper(k=5), "its scores choose"),
        (_edit_paper(sigma=10**400), "malformed or edited"),  # was an OverflowError
    ],
)
def test_a_damaged_or_edited_choice_is_refused_in_one_line(chosen, tmp_path, capsys, write, needle):
    _refused_by_evaluate(chosen, tmp_path, capsys, write, needle)


def test_a_choice_edited_to_another_grid_point_is_refused(chosen, tmp_path, capsys):
    """Values that stay in range and in the grid are still not what the saved scores chose."""

    def write(path, saved):
        record = saved["choices"][KNNRequest().key()]
        others = [
            g
            for g in record["grid"]
            if {k: g[k] for k in ("k", "sigma", "normalize")} != record["config"]
        ]
        record["config"] = {k: others[0][k] for k in ("k", "sigma", "normalize")}
        path.write_text(json.dumps(saved))

    _refused_by_evaluate(
        chosen, tmp_path, capsys, write, "its scores choose", "edited", knn="tuned"
    )


def test_an_edited_estimator_is_refused(chosen, tmp_path, capsys):
    def write(path, saved):
        record = saved["choices"][KNNRequest().key()]
        record["estimator"] = next(e for e in ("val", "loo+val") if e != record["estimator"])
        path.write_text(json.dumps(saved))

    _refused_by_evaluate(chosen, tmp_path, capsys, write, "lambda_cv does not choose", knn="tuned")


def _edit_tuned(change):
    def write(path, saved):
        change(saved["choices"][KNNRequest().key()])
        path.write_text(json.dumps(saved))

    return write


def _other_base(record):
    record["base"] = (
        {"name": "global", "l2": None, "l2_choice": {}}
        if record["base"]["name"] == "linear"
        else {"name": "linear", "l2": 0.01, "l2_choice": {}}
    )


def _other_rule(record):
    record["lambda_rule"]["name"] = next(
        r for r in ("client", "pooled") if r != record["lambda_rule"]["name"]
    )


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (_other_base, "base_cv does not choose"),
        (_other_rule, "base_cv does not choose"),
        (lambda r: r["base"].update(l2=-1.0), "base must be 'global', or 'linear' with l2 > 0"),
        (lambda r: r["lambda_rule"].update(grid=[0.0, 2.0]), "distinct values in"),
    ],
)
def test_an_edited_base_or_lambda_rule_is_refused(chosen, tmp_path, capsys, change, needle):
    """The saved base and rule are what their own cross-validation chose, or refused."""
    _refused_by_evaluate(chosen, tmp_path, capsys, _edit_tuned(change), needle, knn="tuned")


def test_a_fifo_as_the_choice_file_is_refused_without_blocking(chosen, tmp_path, capsys):
    import os

    def write(path, saved):
        path.unlink()
        os.mkfifo(path)

    _refused_by_evaluate(chosen, tmp_path, capsys, write, "not a regular file")


@pytest.mark.parametrize("with_its_config", [False, True])
def test_an_l2_edited_to_another_grid_value_is_refused(run_dir, tmp_path, capsys, with_its_config):
    """The linear head's l2 (0.01 -> 1e-6, a grid value that did not win) was evaluated,
    exported and printed as "(validation)": it is checked against its scores like the rest."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    request = KNNRequest(base="linear")
    load_or_choose(copy, load_run(copy).model, load_run(copy).clients(), request, seed=0)
    path = copy / KNN_CONFIG_FILE
    saved = json.loads(path.read_text())
    base = saved["choices"][request.key()]["base"]
    other = next(v for v in (1e-6, 1.0) if v != base["l2"])
    base["l2"] = other
    if with_its_config:
        base["l2_choice"]["config"]["l2"] = other
    path.write_text(json.dumps(saved))
    capsys.readouterr()
    code = knnper_main(
        ["--no-progress", "evaluate", str(copy), "--methods", "knnper", "--base", "linear"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "its l2 scores choose" in err and "edited" in err and str(path) in err, err


def test_a_new_choice_says_each_step_on_a_terminal(run_dir, monkeypatch):
    # `evaluate` was silent for minutes while it chose; now a bar names each step as it starts
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    run = load_run(run_dir)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    choose(run.model, run.clients(), KNNRequest(), seed=0, progress=True)
    shown = terminal.getvalue()
    for step in (
        "choosing kNN-Per's configuration",
        "embedding every client's splits",
        "grid points on",
        "the lambda estimators",
        "the lambda rule and the base",
        "each client's lambda and the report",
    ):
        assert step in shown, step
    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    choose(run.model, run.clients(), KNNRequest("paper"), seed=0, progress=False)
    assert quiet.getvalue() == ""
