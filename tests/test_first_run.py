"""A new user's first run: every option documented with its default, --version, Ctrl-C on one
line, a runtime-only install told which extra to install, evaluate reusing its cached local
models, a client's data written for the device commands, and the demo's pipeline end to end."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import knnper_cli.main as cli
import knnper_cli.train as train_commands
from edge_runtime.runtime import Runtime
from export.demo import DemoSize, format_demo_table, run_demo
from fed_train import defaults
from fed_train.algorithms.base import TrainingConfig
from fed_train.algorithms.local import Local
from fed_train.run import RunConfig, load_run, train
from fed_train.run_evaluation import evaluate_run
from knnper_cli.training_args import config_from_args


def _options(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*path, name))
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield path, action


def test_every_cli_option_has_help_text_and_shows_its_default():
    parser = cli.build_parser()
    missing = [
        f"{' '.join(path)} {action.option_strings or action.dest}"
        for path, action in _options(parser, ("knnper",))
        if not action.help
    ]
    assert missing == []
    assert "(default: 0.02)" in _help(parser, "train")


def _help(parser: argparse.ArgumentParser, command: str) -> str:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command].format_help().replace("\n", " ")


def test_train_and_bench_share_the_defaults_chosen_on_validation():
    args = cli.build_parser().parse_args(["train", "--out", "x"])
    assert config_from_args(args).training == defaults.TRAINING
    bench = cli.build_parser().parse_args(["bench", "table", "--out", "x"])
    assert config_from_args(bench).training == defaults.TRAINING
    assert args.threads == defaults.THREADS == 1


def test_version_prints_and_exits_zero(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("knnper ")


def test_ctrl_c_ends_with_one_line_and_code_130(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_commands, "_cmd_train", interrupted)
    assert cli.main(["train", "--out", "x"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted" in err and "Traceback" not in err


def test_runtime_only_install_is_told_which_extra_to_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("torch", "tqdm") else real(name, *a),
    )
    assert cli.main(["train", "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install '.[train]' in a knnper clone" in err
    assert "torch, tqdm" in err
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("knnper ") and "device runtime only" in out


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("first") / "run"
    config = RunConfig(
        dataset="digits",
        clients=5,
        seed=0,
        training=TrainingConfig(rounds=2, epochs=1, batch_size=16, lr=0.05, milestones=(0.5, 0.75)),
    )
    train(config, path, progress=False)
    return path


def test_evaluate_reuses_its_cached_local_results(tiny_run, monkeypatch):
    first = evaluate_run(load_run(tiny_run), ["local"], progress=False)

    def no_training(*args, **kwargs):
        raise AssertionError("local models were trained again instead of read from the cache")

    monkeypatch.setattr(Local, "personalize", no_training)
    again = evaluate_run(load_run(tiny_run), ["local"], progress=False)
    assert again == first


def test_client_data_writes_the_files_the_device_commands_read(tiny_run, tmp_path, capsys):
    out = tmp_path / "client1"
    assert cli.main(["client-data", str(tiny_run), "--client", "1", "--out", str(out)]) == 0
    run = load_run(tiny_run)
    split = run.partition.clients[1]
    for name, idx, source in (
        ("train", split.train, run.dataset.x_train),
        ("val", split.val, run.dataset.x_train),
        ("test", split.test, run.dataset.x_test),
    ):
        with np.load(out / f"{name}.npz", allow_pickle=False) as data:
            np.testing.assert_array_equal(data["x"], source[np.asarray(idx)])
            assert data["y"].shape == (len(idx),)
    x_test = np.load(out / "test_x.npy", allow_pickle=False)
    assert x_test.dtype == np.uint8 and len(x_test) == len(split.test)
    assert not list(out.glob(".*.tmp"))


def test_client_data_refuses_a_client_the_run_does_not_have(tiny_run, tmp_path, capsys):
    code = cli.main(["client-data", str(tiny_run), "--client", "9", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "client 9 is not in the run" in err


@pytest.mark.slow
def test_demo_pipeline_prints_server_and_device_rows(tmp_path, caplog):
    rows, _ = run_demo(
        tmp_path / "demo", DemoSize(clients=4, rounds=1, local_epochs=1), progress=False, workers=1
    )
    extras = [r for r in caplog.records if "datastores are among those tried" in r.getMessage()]
    assert len(extras) == 1  # each device class's export printed it: twice
    assert [r["method"] for r in rows] == ["FedAvg", "Local", "kNN-Per", "kNN-Per", "kNN-Per"]
    weak, strong = rows[3], rows[4]
    assert weak["budget"] < strong["budget"]
    for device in (weak, strong):
        assert 0 < device["bundle_bytes"] <= device["budget"]
        assert 0.0 <= device["seen"] <= 1.0
    for name in ("weak", "strong"):
        report = json.loads((tmp_path / "demo" / f"bundles-{name}" / "export.json").read_text())
        bundle = tmp_path / "demo" / f"bundles-{name}" / report["clients"][0]["bundle"]
        assert Runtime.load(bundle).manifest.budget.total == device_budget(rows, name)
    table = format_demo_table(rows)
    assert "weak device" in table and "strong device" in table and "FedAvg" in table


def device_budget(rows: list[dict], name: str) -> int:
    return next(r["budget"] for r in rows if r["where"].startswith(name))
