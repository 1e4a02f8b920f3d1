"""`--device` and `--precision` on the command line: the CPU path, bf16 autocast, one-line
refusal of a GPU that is not there, and run files that load on the CPU."""

from __future__ import annotations

import json
import os

import pytest
import torch

from fed_train.accelerator import DeviceError, autocast, resolve_device
from fed_train.models import MODELS
from fed_train.run import load_run
from knnper_cli.main import main

TINY = ["--dataset", "digits", "--clients", "6", "--rounds", "2", "--batch-size", "16"]


def test_auto_is_the_cpu_without_a_gpu_and_cuda_is_refused_in_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceError, match="no CUDA device"):
        resolve_device("cuda")
    code = main(
        ["--no-progress", "train", *TINY, "--device", "cuda", "--out", str(tmp_path / "run")]
    )
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--device cuda" in err
    assert not (tmp_path / "run").exists()


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision"):
        autocast(torch.device("cpu"), "fp8")


def test_bf16_client_batch_run_trains_saves_precision_and_loads_on_cpu(tmp_path):
    out = tmp_path / "run"
    assert (
        main(
            [
                "--no-progress",
                "train",
                *TINY,
                "--device",
                "cpu",
                "--precision",
                "bf16",
                "--client-batch",
                "3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    saved = json.loads((out / "config.json").read_text())
    assert saved["training"]["precision"] == "bf16"
    state = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in state.values())
    run = load_run(out, "cpu")
    assert next(run.model.parameters()).device.type == "cpu"
    # an fp32 run keeps the config.json it always had: no precision key
    plain = tmp_path / "plain"
    assert main(["--no-progress", "train", *TINY, "--device", "cpu", "--out", str(plain)]) == 0
    assert "precision" not in json.loads((plain / "config.json").read_text())["training"]
    # resuming the finished bf16 run in fp32 would mix two runs in one folder
    assert main(["--no-progress", "train", *TINY, "--device", "cpu", "--out", str(out)]) == 2


def test_evaluate_and_pretrain_take_a_device(tmp_path):
    run = tmp_path / "run"
    assert main(["--no-progress", "train", *TINY, "--out", str(run)]) == 0
    assert (
        main(["--no-progress", "evaluate", str(run), "--methods", "fedavg", "--device", "cpu"]) == 0
    )
    pre = tmp_path / "pre"
    assert (
        main(
            [
                "--no-progress",
                "pretrain",
                "--dataset",
                "digits",
                "--epochs",
                "1",
                "--device",
                "cpu",
                "--precision",
                "bf16",
                "--out",
                str(pre),
            ]
        )
        == 0
    )
    assert json.loads((pre / "pretrain.json").read_text())["precision"] == "bf16"


def test_suite_hides_accelerators_unless_the_gpu_tests_are_selected(request):
    from conftest import selects_gpu

    assert selects_gpu("gpu") and selects_gpu("slow or gpu") and selects_gpu("(gpu)")
    assert not selects_gpu("") and not selects_gpu("not gpu") and not selects_gpu("slow")
    if not selects_gpu(request.config.getoption("markexpr") or ""):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()


@pytest.mark.parametrize("command", ["train", "pretrain"])
def test_help_lists_every_model(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in MODELS)
