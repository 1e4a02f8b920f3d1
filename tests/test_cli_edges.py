"""Command-line edges a careless operator reaches: non-finite or absurd budgets, --out that is a
file or lies under one, milestones past the end of training, negative thread counts. Each is one
line on stderr and exit code 2, and nothing is written; a killed export's temporary bundle
directories are removed by the next run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import knnper_cli.main as export_cli
from edge_runtime.bundle import remove_abandoned_temporaries
from edge_runtime.cli import main as edge_main
from fed_train.algorithms.base import TrainingConfig
from fed_train.run import RunConfig, train
from knnper_cli.main import main as train_main
from tests.helpers.bundles import IMAGE_SPEC, build_bundle, make_images


def _exit_code(main, argv: list[str]) -> int:
    """What the console script would exit with (argparse errors exit from inside main)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


def _one_line(capsys, code: int, fragment: str) -> None:
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and fragment in err, err


@pytest.fixture
def device(tmp_path):
    bundle = build_bundle(tmp_path)
    x, y = make_images(40, 1)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "spec.json").write_text(json.dumps(IMAGE_SPEC))
    (tmp_path / "afile").write_text("not a directory")
    return tmp_path, bundle


def _init(d: Path, budget: str, out: Path) -> list[str]:
    return [
        "init",
        "--encoder",
        str(d / "encoder.onnx"),
        "--data",
        str(d / "data.npz"),
        "--budget",
        budget,
        "--out",
        str(out),
        "--input-spec",
        str(d / "spec.json"),
    ]


@pytest.mark.parametrize("budget", ["inf", "1e400", "1" * 400, "99999999999999GB", "0", "-1"])
def test_edge_init_refuses_absurd_budgets(device, capsys, budget):
    d, _ = device
    _one_line(capsys, _exit_code(edge_main, _init(d, budget, d / "new")), "budget")
    assert not (d / "new").exists()


@pytest.mark.parametrize(
    ("out", "fragment"),
    [("afile", "afile exists and is not a directory"), ("afile/sub", "afile is not a directory")],
)
def test_edge_init_refuses_an_out_that_is_a_file_or_under_one(device, capsys, out, fragment):
    d, _ = device
    _one_line(capsys, edge_main(_init(d, "1MB", d / out)), fragment)
    assert (d / "afile").read_text() == "not a directory"


@pytest.mark.parametrize("threads", ["-1", "0", "two"])
def test_edge_threads_must_be_positive(device, capsys, threads):
    _, bundle = device
    _one_line(capsys, edge_main(["--threads", threads, "info", str(bundle)]), "--threads")


def test_edge_predict_output_under_a_file(device, capsys):
    d, bundle = device
    code = edge_main(
        [
            "predict",
            str(bundle),
            "--input",
            str(d / "x.npy"),
            "--output",
            str(d / "afile" / "p.npy"),
        ]
    )
    _one_line(capsys, code, "is not a directory")


def test_edge_add_with_an_empty_strategy(device, capsys):
    d, bundle = device
    code = edge_main(["add", str(bundle), "--data", str(d / "data.npz"), "--strategy", ""])
    _one_line(capsys, code, "invalid choice: ''")


# ----------------------------------------------------------------------------- server side


def _train_args(out: Path, *extra: str) -> list[str]:
    return [
        "--threads",
        "1",
        "--no-progress",
        "train",
        "--dataset",
        "digits",
        "--clients",
        "4",
        "--rounds",
        "1",
        "--out",
        str(out),
        *extra,
    ]


@pytest.mark.parametrize(
    ("out", "extra", "fragment"),
    [
        ("afile", (), "afile exists and is not a directory"),
        ("afile/sub", (), "cannot make"),
        ("run", ("--milestones", "2.0"), "must be in (0, 1], got 2.0"),
        ("run", ("--milestones", "0"), "must be in (0, 1], got 0"),
    ],
)
def test_train_refuses_bad_out_and_milestones(tmp_path, capsys, out, extra, fragment):
    (tmp_path / "afile").write_text("x")
    code = _exit_code(train_main, _train_args(tmp_path / out, *extra))
    _one_line(capsys, code, fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_train_refuses_negative_threads(tmp_path, capsys):
    args = _train_args(tmp_path / "run")
    args[1] = "-1"
    _one_line(capsys, _exit_code(train_main, args), "--threads")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run") / "digits"
    train(
        RunConfig(
            dataset="digits",
            clients=4,
            seed=0,
            training=TrainingConfig(rounds=1, epochs=1, batch_size=16),
        ),
        path,
        progress=False,
    )
    return path


@pytest.mark.parametrize(
    ("out", "fragment"),
    [("afile", "afile exists and is not a directory"), ("afile/sub", "afile is not a directory")],
)
def test_export_refuses_an_out_that_is_a_file_or_under_one(
    run_dir, tmp_path, capsys, out, fragment
):
    (tmp_path / "afile").write_text("x")
    code = _exit_code(
        export_cli.main,
        ["--no-progress", "export", str(run_dir), "--out", str(tmp_path / out), "--budget", "2M"],
    )
    _one_line(capsys, code, fragment)
    assert (tmp_path / "afile").read_text() == "x"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_export_removes_temporaries_a_killed_export_left(run_dir, tmp_path, capsys):
    out = tmp_path / "bundles"
    out.mkdir()
    dead = out / f".client_0000.tmp-{_dead_pid()}-0123abcd"
    live = out / f".client_0001.tmp-{os.getpid()}-89abcdef"  # a writer still at work
    for leftover in (dead, live):
        leftover.mkdir()
        (leftover / "encoder.onnx").write_bytes(b"half")
    code = export_cli.main(
        [
            "--no-progress",
            "export",
            str(run_dir),
            "--out",
            str(out),
            "--budget",
            "2M",
            "--backend",
            "flat",
            "--clients",
            "0",
            "--workers",
            "1",
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert not dead.exists() and live.exists()
    assert (out / "client_0000" / "manifest.json").is_file()


def test_write_bundle_cleans_only_dead_writers_temporaries(tmp_path):
    dead = tmp_path / f".bundle.old-{_dead_pid()}-00000000"
    live = tmp_path / f".bundle.tmp-{os.getpid()}-11111111"
    other = tmp_path / ".bundle.tmp-notes"
    for directory in (dead, live, other):
        directory.mkdir()
    assert remove_abandoned_temporaries(tmp_path) == [dead.name]
    build_bundle(tmp_path)  # write_bundle runs the same sweep
    assert live.exists() and other.exists() and not dead.exists()
