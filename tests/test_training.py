"""The server pipeline end to end on digits: train, evaluate, resume after a kill, bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from knnper_cli.main import main
from tests.helpers.interrupts import interrupt_after

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "--dataset",
    "digits",
    "--clients",
    "8",
    "--rounds",
    "4",
    "--local-epochs",
    "1",
    "--batch-size",
    "16",
    "--lr",
    "0.05",
    "--no-progress",
]


def _cli(capsys, *args: str) -> tuple[int, str]:
    """`knnper ARGS` in this process (torch is imported already): its exit code and stderr.
    The one-line handling is main()'s own; an error it let through raises here."""
    try:
        code = main(list(args))
    except SystemExit as exited:  # a flag argparse refuses while parsing
        code = exited.code
    return code, capsys.readouterr().err


def _train_args(out: Path, *extra: str) -> list[str]:
    return ["--no-progress", "train", *TINY[:-1], "--out", str(out), *extra]


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "digits"
    assert main(_train_args(out)) == 0
    return out


def test_train_writes_a_complete_run(digits_run):
    for name in ("config.json", "partition.npz", "model.pt", "metrics.jsonl"):
        assert (digits_run / name).is_file()
    rounds = [json.loads(line)["round"] for line in (digits_run / "metrics.jsonl").open()]
    assert rounds == [1, 2, 3, 4]
    state = torch.load(digits_run / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


def test_evaluate_json_has_every_method_and_client(digits_run, tmp_path):
    out = tmp_path / "eval.json"
    assert main(["--no-progress", "evaluate", str(digits_run), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for method in ("local", "fedavg", "knnper"):
        for group in ("seen", "unseen"):
            summary = result[group][method]
            assert 0.0 <= summary["bottom_decile"] <= summary["mean"] + 1e-9 <= 1.0 + 1e-9
    assert len(result["clients"]) == 8
    assert all(0.0 <= row["knnper_lambda"] <= 1.0 for row in result["clients"])
    assert (digits_run / "eval" / "local.jsonl").is_file()  # cached for the next evaluate


def test_an_interrupted_evaluate_resumes_at_the_client_it_stopped_at(digits_run, monkeypatch):
    from fed_train.algorithms.local import Local
    from fed_train.run import load_run
    from fed_train.run_evaluation import evaluate_run

    journal = digits_run / "eval" / "local.jsonl"
    journal.unlink(missing_ok=True)
    shutil.rmtree(digits_run / "eval", ignore_errors=True)  # as a fresh run: no eval folder
    with monkeypatch.context() as m:
        first = interrupt_after(m, Local, 3)
        with pytest.raises(KeyboardInterrupt):
            evaluate_run(load_run(digits_run), ["local"], progress=False)
    assert len(first) == 3
    with monkeypatch.context() as m:
        resumed = interrupt_after(m, Local, 100)
        result = evaluate_run(load_run(digits_run), ["local"], progress=False)
    assert len(resumed) == 8 - 3 and not set(first) & set(resumed)
    journal.unlink()
    fresh = evaluate_run(load_run(digits_run), ["local"], progress=False)
    assert result["clients"] == fresh["clients"]  # each client's own seed: the same models


def test_knnper_with_lambda_zero_everywhere_equals_fedavg(digits_run, monkeypatch):
    from edge_runtime.knn import LambdaRule
    from fed_train.knn_request import KNNRequest
    from fed_train.run import load_run
    from fed_train.run_evaluation import evaluate_run

    monkeypatch.setattr(LambdaRule, "choose_from_counts", lambda self, own: 0.0)
    result = evaluate_run(
        load_run(digits_run), ["fedavg", "knnper"], progress=False, knn=KNNRequest(base="global")
    )  # lambda 0 is then the global model
    for row in result["clients"]:
        assert row["knnper"] == row["fedavg"]


def test_rerunning_a_finished_run_trains_nothing_more(digits_run):
    before = (digits_run / "metrics.jsonl").read_text()
    assert main(_train_args(digits_run)) == 0
    assert (digits_run / "metrics.jsonl").read_text() == before


def test_a_killed_run_resumes_without_losing_rounds(tmp_path):
    reference = tmp_path / "reference"
    args = ["--rounds", "12", "--checkpoint-every", "2"]
    assert main(_train_args(reference, *args)) == 0

    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "knnper_cli.main", *_train_args(out, *args)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "model.pt").exists(), "the run finished before it could be killed"
    done = sorted((out / "checkpoints").glob("round_*.pt"))
    assert done, "no checkpoint was written before the kill"

    assert main(_train_args(out, *args)) == 0
    rounds = [json.loads(line)["round"] for line in metrics.open()]
    assert rounds == list(range(1, 13))
    a = torch.load(reference / "model.pt", weights_only=True)
    b = torch.load(out / "model.pt", weights_only=True)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


def test_a_different_config_in_an_existing_run_is_refused(digits_run, capsys):
    code, err = _cli(capsys, *_train_args(digits_run, "--alpha", "0.5"))
    assert code == 2
    assert "different configuration" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dataset", "nope"], "unknown data set|unknown dataset"),
        (["--alpha", "0"], "alpha"),
        (["--alpha", "-1"], "alpha"),
        (["--clients", "100000"], "clients"),
        (["--dataset", "npz", "--data", "/nonexistent/x.npz"], "/nonexistent/x.npz"),
        (["--lr", "1e6"], "loss became"),
    ],
)
def test_bad_input_gives_one_line_error_and_exit_2(tmp_path, capsys, args, message):
    code, err = _cli(
        capsys, "--no-progress", "train", *TINY[:-1], "--out", str(tmp_path / "run"), *args
    )
    assert code == 2, err
    lines = [
        line
        for line in err.splitlines()
        if line.strip() and not line.startswith(("INFO", "WARNING"))
    ]
    assert len(lines) == 1, err
    assert re.search(message, lines[0], flags=re.I), lines[0]


def test_evaluate_a_missing_run_is_a_clear_error(tmp_path, capsys):
    code, err = _cli(capsys, "evaluate", str(tmp_path / "nothing"))
    assert code == 2
    assert "config.json is missing" in err


def test_evaluate_a_corrupt_model_is_a_clear_error(digits_run, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(digits_run, broken)
    (broken / "model.pt").write_bytes(b"not a checkpoint")
    code, err = _cli(capsys, "evaluate", str(broken), "--methods", "fedavg")
    assert code == 2
    assert "model.pt cannot be loaded" in err


def test_malformed_npz_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    np.savez(bad, x_train=np.zeros((4, 8, 8), np.uint8))
    code, err = _cli(
        capsys,
        "--no-progress",
        "train",
        *TINY[:-1],
        "--dataset",
        "npz",
        "--data",
        str(bad),
        "--out",
        str(tmp_path / "run"),
    )
    assert code == 2
    assert "y_train" in err
