"""`knnper` answers what needs no model before it imports torch: `--help`, `--version`, a
mistyped command and a bad flag of `export` (knnper_cli.commands; benchmarks/cli_start.py
times them). Checked by the modules a fresh interpreter holds afterwards, not by time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")  # the server CLI needs the train extra

HEAVY = ("torch", "onnx", "onnxruntime", "sklearn", "tqdm", "edgeml")

_PROBE = """
import contextlib, io, json, sys
from knnper_cli.main import main
answers = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as done:
            code = done.code
    answers.append([code, out.getvalue(), err.getvalue()])
loaded = sorted({name.split(".")[0] for name in sys.modules})
print(json.dumps({"answers": answers, "loaded": loaded}))
"""


def _answer(*argvs: list[str]) -> tuple[list, set[str]]:
    """Each command line's (exit code, stdout, stderr) in one fresh interpreter, and the top
    packages it imported in all."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(done.stdout)
    return result["answers"], set(result["loaded"])


def test_help_version_and_a_mistyped_command_import_neither_torch_nor_numpy():
    (help_, version, mistyped), loaded = _answer(["--help"], ["--version"], ["expotr"])
    assert help_[0] == 0 and "export" in help_[1] and "knnper COMMAND --help" in help_[1]
    assert version[0] == 0 and version[1].startswith("knnper ")
    assert mistyped[0] == 2 and "invalid choice: 'expotr'" in mistyped[2]
    assert not loaded & {*HEAVY, "numpy"}, loaded & {*HEAVY, "numpy"}


def test_export_help_and_a_bad_export_flag_import_no_torch(tmp_path):
    out = tmp_path / "file"
    out.write_text("")
    (help_, bad_budget, bad_out), loaded = _answer(
        ["export", "--help"],
        ["export", "RUN", "--out", str(tmp_path / "b"), "--budget", "banana"],
        ["export", "RUN", "--out", str(out), "--budget", "1MB"],
    )
    assert help_[0] == 0 and "--budget" in help_[1]
    assert bad_budget[0] == 2 and "--budget: not a byte count: 'banana'" in bad_budget[2]
    assert bad_out[0] == 2 and f"{out} exists and is not a directory" in bad_out[2]
    assert all(err.count("\n") == 1 for _, _, err in (bad_budget, bad_out))
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_training_commands_answer_help_and_a_bad_flag_before_torch():
    """train, evaluate, client-data, pretrain and demo take their flags' defaults from the
    settings types (fed_train.run_config), so torch loads only for the command that runs."""
    argvs = [[name, "--help"] for name in ("train", "evaluate", "client-data", "pretrain", "demo")]
    argvs += [["train", "--out", "r", "--rounds", "x"], ["pretrain", "--out", "p", "--lr", "-1"]]
    answers, loaded = _answer(*argvs)
    for (code, out, _), argv in zip(answers[:5], argvs[:5], strict=True):
        assert code == 0 and out.startswith(f"usage: knnper {argv[0]}"), argv
    assert answers[5][0] == 2 and "--rounds: not an integer: 'x'" in answers[5][2]
    assert answers[6][0] == 2 and "--lr" in answers[6][2]
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_the_model_flag_names_every_registered_model():
    """--model's help is written out (the registry lives with torch): it names them all."""
    from fed_train.models import MODELS
    from knnper_cli.main import build_parser

    help_ = build_parser("train")._subparsers._group_actions[0].choices["train"].format_help()
    assert all(name in " ".join(help_.split()) for name in MODELS), help_
