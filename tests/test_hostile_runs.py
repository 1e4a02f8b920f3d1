"""Run directories, data files, weights and flags are inputs: a hand edit, a kill mid-write, a
crafted archive or a careless flag ends in one line and exit 2 (or is tolerated where the
damage is a kill's torn last line), never a traceback, an unbounded allocation or a run that
silently trains or exports on other data."""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import knnper_cli.main as knnper_cli
from fed_train import data as data_module
from fed_train.algorithms.base import TrainingConfig
from fed_train.data import load_dataset
from fed_train.errors import DataError
from fed_train.flower.settings import FlowerConfigError, FlowerSettings
from fed_train.pretrain import InitError, load_init
from fed_train.run import RunConfig, load_run, train
from fed_train.simulation import CheckpointError, resume_from, save_checkpoint
from fed_train.torch_files import load_tensors


def _knnper(argv: list[str], capsys, *needles: str) -> str:
    """Runs `knnper ARGV`, which must fail in one line with exit 2 naming every needle."""
    capsys.readouterr()
    try:
        code = knnper_cli.main(argv)
    except SystemExit as exc:  # argparse's own errors exit from the parser
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if not line.startswith(("INFO", "WARNING"))]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


CONFIG = RunConfig(
    dataset="digits",
    clients=3,
    seed=0,
    max_train=600,
    training=TrainingConfig(rounds=2, epochs=1, batch_size=32),
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hostile-runs") / "run"
    train(CONFIG, path, progress=False)
    return path


@pytest.fixture
def copy(run_dir, tmp_path) -> Path:
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


def _edit_config(run: Path, **changes) -> None:
    config = json.loads((run / "config.json").read_text())
    config.update(changes)
    (run / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda c: _edit_config(c, evil=1), "unknown keys: evil"),
        (lambda c: (c / "config.json").write_text("[1, 2]"), "must hold a JSON object"),
        (lambda c: _edit_config(c, clients="ten"), "'clients' must be int"),
        (lambda c: _edit_config(c, training={"lr": [1]}), "'lr' must be float"),
        (lambda c: (c / "config.json").write_text('{"a": '), "not readable JSON"),
    ],
)
def test_a_hand_edited_config_is_one_line(copy, capsys, edit, needle):
    edit(copy)
    _knnper(
        ["client-data", str(copy), "--client", "0", "--out", str(copy.parent / "cd")],
        capsys,
        needle,
    )


def test_partition_indices_out_of_range_are_refused(copy, capsys):
    with np.load(copy / "partition.npz") as f:
        arrays = dict(f)
    arrays["train_index"][0] = 10**6
    np.savez(copy / "partition.npz", **arrays)
    _knnper(["evaluate", str(copy), "--methods", "fedavg"], capsys, "out of range")


def test_a_run_whose_data_changed_is_refused_by_every_later_stage(copy, capsys, tmp_path):
    """--max-train draws its subsample with the seed: another seed gives other client data."""
    _edit_config(copy, seed=5)
    out = str(tmp_path / "o")
    for argv in (
        ["client-data", str(copy), "--client", "0", "--out", out],
        ["export", str(copy), "--out", out, "--budget", "2M"],
        ["evaluate", str(copy), "--methods", "fedavg"],
    ):
        _knnper(argv, capsys, "the data this run was trained on have changed")


def test_the_fingerprint_is_recorded_and_an_unchanged_run_loads(run_dir):
    assert len(json.loads((run_dir / "config.json").read_text())["data_sha256"]) == 64
    assert load_run(run_dir).partition.num_clients == 3


@pytest.mark.parametrize("damage", ["torn last line", "non-JSON line", "line without round"])
def test_damaged_metrics_resume_or_name_the_file(copy, damage):
    metrics = copy / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    if damage == "torn last line":  # a kill in the middle of writing round 3's line
        metrics.write_text("\n".join([*lines, '{"round": 3, "lr"']))
        train(CONFIG, copy, progress=False)
        assert metrics.read_text().splitlines() == lines
        return
    bad = "garbage" if damage == "non-JSON line" else '{"lr": 0.1}'
    metrics.write_text("\n".join([lines[0], bad, *lines[1:]]) + "\n")
    with pytest.raises(CheckpointError, match=f"{metrics} line 2 is not a round's"):
        train(CONFIG, copy, progress=False)


def _weights() -> dict[str, np.ndarray]:
    return {"w": np.ones((2, 3), np.float32)}


@pytest.mark.parametrize(
    ("weights", "needle"),
    [
        ({"evil": np.ones((2, 3), np.float32)}, "weights of another model"),
        ({"w": np.full((2, 3), np.nan, np.float32)}, "NaN or infinite"),
    ],
)
def test_a_resealed_checkpoint_of_other_or_nan_weights_is_not_resumed(tmp_path, weights, needle):
    save_checkpoint(tmp_path / "checkpoints" / "round_0001.pt", 1, weights, {})
    with pytest.raises(CheckpointError, match=needle):
        resume_from(tmp_path, like=_weights())


def _npz(path: Path, **changes) -> Path:
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 255, (20, 8, 8), np.uint8),
        "y_train": np.arange(20) % 3,
        "x_test": rng.integers(0, 255, (6, 8, 8), np.uint8),
        "y_test": np.arange(6) % 3,
        **changes,
    }
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"num_classes": np.array([3, 4])}, "num_classes must be one integer"),
        ({"num_classes": np.array(2**40)}, "classes (from num_classes or the largest label)"),
        ({"y_train": np.r_[np.arange(19) % 3, 10**6]}, "1000001 classes"),
        (
            {"x_train": np.zeros((20, 1, 1), np.uint8), "x_test": np.zeros((6, 1, 1), np.uint8)},
            "at least 4x4",
        ),
    ],
)
def test_training_data_that_would_build_a_huge_or_broken_model_is_refused(
    tmp_path, changes, needle
):
    with pytest.raises(DataError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_dataset("npz", str(_npz(tmp_path / "d.npz", **changes)))


def test_training_data_is_bounded_before_it_is_inflated(tmp_path, monkeypatch):
    path = _npz(tmp_path / "d.npz")
    with (
        zipfile.ZipFile(tmp_path / "bomb.npz", "w", zipfile.ZIP_DEFLATED) as out,
        zipfile.ZipFile(path) as src,
    ):
        for name in src.namelist():
            out.writestr(name, src.read(name))
    monkeypatch.setattr(data_module, "memory_limit", lambda: 1000)
    with pytest.raises(DataError, match="over the limit of 1000 bytes"):
        load_dataset("npz", str(tmp_path / "bomb.npz"))
    with open(tmp_path / "huge.npz", "wb") as f, zipfile.ZipFile(f, "w") as zf:
        with zf.open("x_train.npy", "w") as member:
            np.lib.format.write_array_header_1_0(
                member, {"descr": "|u1", "fortran_order": False, "shape": (2**40, 8, 8)}
            )
    with pytest.raises(DataError, match="declares a uint8 array"):
        load_dataset("npz", str(tmp_path / "huge.npz"))


def test_a_torch_file_that_inflates_past_its_limit_is_refused_before_loading(tmp_path):
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(100_000)}, buf)
    with pytest.raises(ValueError, match="would inflate to"):
        load_tensors(buf.getvalue(), 1000)
    assert load_tensors(buf.getvalue(), 10**7)["w"].shape == (100_000,)


def test_an_empty_server_split_is_refused(tmp_path):
    np.save(tmp_path / "server_indices.npy", np.zeros(0, np.int64))
    torch.save({"w": torch.zeros(2)}, tmp_path / "model.pt")
    (tmp_path / "pretrain.json").write_text(json.dumps({"dataset": "digits", "model": "x"}))
    with pytest.raises(InitError, match="holds no indices"):
        load_init(tmp_path)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["train", "--lr", "1e308"], "--lr"),
        (["train", "--lr-gamma", "inf"], "--lr-gamma"),
        (["--threads", "100000", "train"], "--threads"),
        (["export", "RUN", "--out", "O", "--budget", "2M", "--workers", "0"], "--workers"),
        (["export", "RUN", "--out", "O", "--budget", "2M", "--workers", "-3"], "--workers"),
    ],
)
def test_flags_out_of_range_are_one_line(argv, needle, capsys, tmp_path):
    extra = ["--out", str(tmp_path / "r")] if "train" in argv else []
    _knnper([*argv, *extra], capsys, needle)


def test_spread_errors_name_spread(copy, capsys, tmp_path):
    _knnper(
        [
            "export",
            str(copy),
            "--out",
            str(tmp_path / "o"),
            "--profile",
            "lognormal",
            "--reference",
            "2M",
            "--spread",
            "-1",
        ],
        capsys,
        "--spread",
    )


def test_min_train_clients_past_the_run_is_refused():
    with pytest.raises(FlowerConfigError, match="min-train-clients"):
        FlowerSettings(run=RunConfig(clients=3), run_dir="r", min_train_clients=99).check()


@pytest.mark.parametrize(
    "argv",
    [
        ["pretrain", "--out", "FILE"],
        ["evaluate", "RUN", "--methods", "fedavg", "--json", "FILE/x.json"],
        ["deploy", "config", "--out", "r", "--write", "FILE/run.toml"],
    ],
)
def test_outputs_under_a_file_are_one_line(argv, copy, capsys, tmp_path):
    (tmp_path / "FILE").write_text("a file")
    argv = [
        str(tmp_path / a) if a.startswith("FILE") else str(copy) if a == "RUN" else a for a in argv
    ]
    _knnper(["--no-progress", *argv], capsys)


def test_deploy_certs_under_a_file_is_one_line(capsys, tmp_path):
    pytest.importorskip("cryptography")
    (tmp_path / "FILE").write_text("a file")
    _knnper(
        ["deploy", "certs", "--host", "localhost", "--out", str(tmp_path / "FILE" / "c")], capsys
    )


def test_a_relative_init_is_recorded_absolute(tmp_path, monkeypatch):
    from knnper_cli.main import build_parser
    from knnper_cli.training_args import config_from_args

    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["train", "--init", "pre", "--out", "r"])
    assert config_from_args(args).init == str(tmp_path / "pre")


def test_keygen_leaves_no_private_key_when_the_public_one_cannot_be_written(tmp_path):
    pytest.importorskip("cryptography")
    from edge_runtime.signing import generate_key_pair

    (tmp_path / "afile").write_text("a file, not a folder")
    with pytest.raises(OSError):  # missing folders are made; one under a file cannot be
        generate_key_pair(tmp_path / "k.pem", tmp_path / "afile" / "k.pub")
    assert not (tmp_path / "k.pem").exists()


def test_planted_symlinks_at_old_temporary_names_are_never_followed(copy, tmp_path):
    """knn_config.json.tmp, model.pt.tmp and the journal's .tmp were fixed names: a symlink
    planted there made a write land outside the run. Temporaries are now unique and created
    with O_EXCL, so the planted links and their targets stay untouched."""
    from export.journal import ExportJournal
    from fed_train.knn_choice import KNN_CONFIG_FILE, load_or_choose
    from fed_train.knn_request import KNNRequest

    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    names = [KNN_CONFIG_FILE + ".tmp", "model.pt.tmp", "export.journal.jsonl.tmp"]
    for name in names:
        (copy / name).symlink_to(victim)
    run = load_run(copy)
    load_or_choose(copy, run.model, run.clients(), KNNRequest("paper"))
    from fed_train.run import save_model

    save_model(copy, run.model, {k: v.numpy() for k, v in run.model.state_dict().items()})
    ExportJournal(copy / "export.journal.jsonl").finished({"x": 1}, {}, lambda c, r: True)
    assert victim.read_text() == "mine"
    assert all((copy / name).is_symlink() for name in names)
    assert load_run(copy).partition.num_clients == 3


def test_open_exclusive_refuses_a_planted_name(tmp_path):
    from edge_runtime._io import open_exclusive

    (tmp_path / "t").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError):
        open_exclusive(tmp_path / "t")
    assert not (tmp_path / "elsewhere").exists()


def test_a_path_writer_replaces_whole_or_leaves_the_old_file(tmp_path):
    """hnswlib's save_index and a download write to a name: they get a unique temporary one,
    renamed over the file only once written; a writer that fails leaves no temporary behind."""
    from edge_runtime._io import write_path_atomic

    def disk_full_midway(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError("no space left on device")

    final = tmp_path / "index.bin"
    final.write_bytes(b"old")
    with pytest.raises(OSError):
        write_path_atomic(final, disk_full_midway)
    assert final.read_bytes() == b"old" and sorted(tmp_path.iterdir()) == [final]
    write_path_atomic(final, lambda tmp: tmp.write_bytes(b"new"))
    assert final.read_bytes() == b"new" and sorted(tmp_path.iterdir()) == [final]


def test_an_edited_clients_count_is_refused(copy, capsys):
    _edit_config(copy, clients=5)
    _knnper(
        ["evaluate", str(copy), "--methods", "fedavg"],
        capsys,
        "'clients' is 5 but the run was trained with 3",
    )


def test_resuming_with_other_flags_names_the_flag_not_an_untouched_file(copy, capsys, tmp_path):
    """Another --clients blamed config.json ('says clients is 3'); --continue-from R --out R
    blamed --init; a continued run whose parent was deleted named only a config.json."""
    train = ["train", "--dataset", "digits", "--max-train", "600", "--out", str(copy)]
    _knnper([*train, "--clients", "4"], capsys, "holds a run of 3 clients, not --clients 4")
    _knnper([*train, "--continue-from", str(copy)], capsys, f"--continue-from {copy} is --out")
    _edit_config(copy, continue_from=str(tmp_path / "deleted"))
    _knnper(
        ["evaluate", str(copy), "--methods", "fedavg"],
        capsys,
        f"the run this one continues (--continue-from {tmp_path / 'deleted'})",
        "config.json is not readable JSON",
    )


def test_public_data_is_x_train_and_y_train_checked_before_any_bundle(tmp_path, capsys):
    """--help says x_train, y_train: test arrays were required; labels out of the run's range
    failed with a reshape error after every bundle was written; without --upgrade-from the
    file was silently unused."""
    from types import SimpleNamespace

    from export.errors import ExportError
    from export.upgrade_map import server_data

    run = SimpleNamespace(
        config=RunConfig(dataset="digits", clients=3),
        dataset=SimpleNamespace(num_classes=10, x_train=np.zeros((1, 8, 8, 1), np.uint8)),
    )
    x = np.random.default_rng(0).integers(0, 17, (40, 8, 8, 1)).astype(np.uint8)
    np.savez(tmp_path / "public.npz", x_train=x, y_train=np.arange(40) % 10)
    np.savez(tmp_path / "wide.npz", x_train=x, y_train=np.arange(40) % 12)
    got_x, got_y = server_data(run, str(tmp_path / "public.npz"))
    assert got_x.shape == (40, 8, 8, 1) and list(got_y[:12]) == [*range(10), 0, 1]
    with pytest.raises(ExportError, match="label 11 is out of range for 10 classes") as err:
        server_data(run, str(tmp_path / "wide.npz"))
    assert "\n" not in str(err.value) and "wide.npz" in str(err.value)
    _knnper(
        ["export", str(tmp_path / "run"), "--out", str(tmp_path / "o"), "--budget", "1M"]
        + ["--public-data", str(tmp_path / "public.npz")],
        capsys,
        "give --upgrade-from OLD_EXPORT too",
    )


def _ctrl_c_as_typed() -> None:
    """The child takes Ctrl-C as a terminal delivers it, even when pytest runs as a background
    job (started with SIGINT ignored, which children inherit)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a blocked one is inherited


def _repo_env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


@pytest.mark.parametrize("delay", [0.3, 1.0, 2.0, 2.5, 4.0])
def test_ctrl_c_while_the_heavy_modules_import_is_one_line_and_130(delay, tmp_path):
    """The first seconds of `knnper` import torch and the command modules: Ctrl-C there used
    to print a traceback from inside the import. Later it is the command's own handling, which
    also covers the first optimizer's lazy `torch._dynamo` import (about 2 to 3 s in here:
    Ctrl-C there surfaced as a RuntimeError traceback, or as an exit by SIGINT, -2)."""
    import signal
    import subprocess
    import sys
    import time

    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "knnper_cli.main",
            "--no-progress",
            "train",
            "--dataset",
            "digits",
            "--clients",
            "3",
            "--rounds",
            "50",
            "--out",
            str(tmp_path / "run"),
        ],
        env=_repo_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ctrl_c_as_typed,
    )
    time.sleep(delay)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    lines = [line for line in err.splitlines() if not line.startswith(("INFO", "WARNING"))]
    assert child.returncode == 130, err
    assert "Traceback" not in err and len(lines) == 1 and "interrupted" in lines[0], err


def test_the_early_ctrl_c_handler_is_in_place_before_numpy_imports():
    """knnper-edge's entry point installs it importing the standard library only, then
    imports the command line (numpy, onnxruntime) under it: one line and 130."""
    import signal
    import subprocess
    import sys

    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, edge_runtime.console, "
            "knnper_cli.main; print(sorted({'numpy', 'torch', 'onnxruntime'} "
            "& set(sys.modules)))",
        ],
        env=_repo_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip() == "[]", probe.stderr
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from edge_runtime.interrupt import "
            "exit_on_interrupt\nwith exit_on_interrupt('knnper-edge'):\n"
            "    print('importing', flush=True); time.sleep(60)",
        ],
        env=_repo_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ctrl_c_as_typed,
    )
    assert child.stdout.readline() == "importing\n"
    child.send_signal(signal.SIGINT)
    try:
        _, err = child.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # what the child did with SIGINT, for the report
        status = Path(f"/proc/{child.pid}/status").read_text()
        child.kill()
        raise AssertionError(
            [line for line in status.splitlines() if line.startswith("Sig")]
        ) from None
    assert child.returncode == 130 and err == "knnper-edge: interrupted\n", err


CTRL_C_IN_THE_PACKAGE_IMPORT = """
import os, signal, sys

class CtrlCAtTheFirstImport:  # as a Ctrl-C landing while edge_runtime's __init__ imports
    def find_spec(self, name, path=None, target=None):
        if name == "edge_runtime.face":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlCAtTheFirstImport())
sys.argv = [os.path.join(os.path.dirname(sys.executable), sys.argv[1]), "--version"]
if sys.argv[0].endswith("knnper"):
    from knnper_cli.console import main
else:
    from edge_runtime.console import main
sys.exit(main())
"""


@pytest.mark.parametrize("script", ["knnper-edge", "knnper"])
def test_ctrl_c_while_the_console_script_imports_its_package_is_one_line(script):
    """5 of 20 Ctrl-Cs at 0.14-0.25 s printed a traceback: the console scripts' handler came
    after `import edge_runtime` (the package's face). The package installs it first, for the
    console scripts only."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_IN_THE_PACKAGE_IMPORT, script],
        env=_repo_env(),
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_ctrl_c_as_typed,
    )
    assert done.returncode == 130 and done.stderr == f"{script}: interrupted\n", done.stderr


CTRL_C_IN_A_FORK_HOOK = """
import os, signal, sys
from pathlib import Path
from fed_train.deploy import Processes

def ctrl_c_now():  # as a terminal's Ctrl-C landing while the child is being forked
    if not getattr(ctrl_c_now, "sent", False):
        ctrl_c_now.sent = True
        os.kill(os.getpid(), signal.SIGINT)

os.register_at_fork(after_in_parent=ctrl_c_now)
procs = Processes(dict(os.environ), Path(sys.argv[1]))
check = "import signal; print(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))"
try:
    procs.start("child", [sys.executable, "-c", check])
except KeyboardInterrupt:
    procs.running["child"].wait(timeout=60)
    print("interrupted, child kept:", sorted(procs.running))
"""


def test_ctrl_c_while_deploy_starts_a_process_is_not_lost(tmp_path):
    """Python runs fork hooks around a start with a preexec function, and a KeyboardInterrupt
    raised inside one is printed and dropped: a Ctrl-C there was lost and `knnper deploy` ran
    on (seen in CI). Now it arrives once the child is recorded, and the child takes Ctrl-C."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_IN_A_FORK_HOOK, str(tmp_path)],
        env=_repo_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout == "interrupted, child kept: ['child']\n", done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
    assert (tmp_path / "child.log").read_text() == "False\n"


def test_output_paths_are_checked_before_any_work(run_dir, tmp_path, capsys, monkeypatch):
    """`evaluate --json FILE/x.json` used to fail only after the whole evaluation."""
    import fed_train.run

    def no_work(*args, **kwargs):
        raise AssertionError("the run was loaded before the output path was checked")

    monkeypatch.setattr(fed_train.run, "load_dataset", no_work)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, needle in (
        (["evaluate", str(run_dir), "--json", str(afile / "x.json")], "afile is not a directory"),
        (["evaluate", str(run_dir), "--json", str(tmp_path)], "is a directory, not a file"),
        (
            ["export", str(run_dir), "--out", str(afile), "--budget", "2M"],
            "exists and is not a directory",
        ),
        (
            ["client-data", str(run_dir), "--client", "0", "--out", str(afile / "d")],
            "afile is not a directory",
        ),
    ):
        _knnper(argv, capsys, needle)
    assert afile.read_text() == "x"


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--k", str(2**63), "--k: must be at most 9223372036854775807"),
        ("--k", "0", ">= 1"),
        ("--sigma", "1e-320", "must be a number from 1e-30 to 1e+30"),
        ("--sigma", "1e31", "must be a number from 1e-30 to 1e+30"),
        ("--sigma", "nan", "a finite number > 0"),
    ],
)
def test_k_and_sigma_no_device_could_run_are_refused_at_parse_time(
    run_dir, tmp_path, capsys, flag, value, needle
):
    _knnper(
        ["export", str(run_dir), "--out", str(tmp_path / "o"), "--budget", "2M", flag, value],
        capsys,
        needle,
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("flag", "value"), [("--k", str(2**63)), ("--sigma", "1e-320")])
def test_device_init_refuses_the_same_k_and_sigma(flag, value, capsys):
    from edge_runtime.cli import main as edge_main

    code = edge_main(
        [
            "init",
            "--encoder",
            "e.onnx",
            "--data",
            "d.npz",
            "--budget",
            "1M",
            "--out",
            "o",
            "--input-spec",
            "s.json",
            flag,
            value,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and flag in err, err


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [
        ("--seed", "-1", "--seed: must be from 0 to 4294967295"),
        ("--seed", str(2**70), "--seed: must be from 0 to 4294967295"),
        ("--rounds", str(10**23), "--rounds: must be at most 9223372036854775807"),
        ("--momentum", "nan", "--momentum: must be from 0 to"),
        ("--weight-decay", "inf", "--weight-decay: must be from 0 to"),
    ],
)
def test_numeric_training_flags_are_bounded_at_parse_time(tmp_path, capsys, flag, value, needle):
    _knnper(
        ["train", "--dataset", "digits", "--out", str(tmp_path / "r"), flag, value], capsys, needle
    )
    assert not (tmp_path / "r").exists()


def test_a_killed_writers_temporaries_are_removed_at_the_next_start(copy, tmp_path):
    """Unique temporary names are never reused: the next train removes those whose writer is
    gone, keeps a live writer's, and never follows a link."""
    import os
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = [
        copy / f"model.pt.tmp-{gone.pid}-0123abcd",
        copy / "checkpoints" / f"round_0001.pt.tmp-{gone.pid}-89abcdef",
    ]
    live = copy / f"knn_config.json.tmp-{os.getpid()}-0123abcd"
    link = copy / f"metrics.jsonl.tmp-{gone.pid}-00000000"
    for path in (*dead, live):
        path.write_bytes(b"half")
    (tmp_path / "target").write_text("mine")
    link.symlink_to(tmp_path / "target")
    train(CONFIG, copy, progress=False)
    assert not any(p.exists() for p in dead)
    assert live.exists() and link.is_symlink() and (tmp_path / "target").read_text() == "mine"


def test_an_error_raised_by_ctrl_c_inside_an_import_counts_as_ctrl_c():
    """Python 3.11 wraps an exception raised in __set_name__ (a KeyboardInterrupt inside a
    class body of a lazily imported module) in a RuntimeError caused by it."""
    from knnper_cli.main import _from_interrupt

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:
            raise RuntimeError("Error calling __set_name__") from interrupt
    except RuntimeError as err:
        assert _from_interrupt(err)
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ImportError("initialization failed") from None
    except ImportError as err:
        assert _from_interrupt(err)  # still its context
    assert not _from_interrupt(RuntimeError("a real failure"))


def test_outputs_that_are_not_regular_files_are_refused_before_any_work(
    run_dir, tmp_path, capsys, monkeypatch
):
    """An atomic rename over a pipe, a device (as root, /dev/null itself) or a link to one
    replaced it with a regular file."""
    import os
    import stat

    import fed_train.run

    def no_work(*args, **kwargs):
        raise AssertionError("the run was loaded before the output path was checked")

    monkeypatch.setattr(fed_train.run, "load_dataset", no_work)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "fifo")
    outs = [tmp_path / "fifo", tmp_path / "link"]
    try:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        outs.append(tmp_path / "null")
    except PermissionError:
        pass
    kinds = {p: os.lstat(p).st_mode for p in outs}
    for out in outs:
        _knnper(
            ["evaluate", str(run_dir), "--json", str(out)], capsys, str(out), "not a regular file"
        )
        _knnper(
            [
                "deploy",
                "config",
                "--dataset",
                "digits",
                "--out",
                str(tmp_path / "fl"),
                "--write",
                str(out),
            ],
            capsys,
            str(out),
            "not a regular file",
        )
    assert {p: os.lstat(p).st_mode for p in outs} == kinds
    assert sorted(tmp_path.iterdir()) == sorted(outs)


def test_json_and_toml_go_to_standard_output_or_through_a_link(run_dir, tmp_path, capsys):
    assert knnper_cli.main(["evaluate", str(run_dir), "--methods", "fedavg", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["seen"]["fedavg"] and "| fedavg |" in err  # stdout: one document
    (tmp_path / "real.toml").write_text("old")
    (tmp_path / "link.toml").symlink_to(tmp_path / "real.toml")
    for write in ("/dev/stdout", str(tmp_path / "link.toml")):
        assert (
            knnper_cli.main(
                [
                    "deploy",
                    "config",
                    "--dataset",
                    "digits",
                    "--out",
                    str(tmp_path / "fl"),
                    "--write",
                    write,
                ]
            )
            == 0
        )
    assert "run-dir" in capsys.readouterr().out
    assert (tmp_path / "link.toml").is_symlink()
    assert "run-dir" in (tmp_path / "real.toml").read_text()


def test_local_model_journal_belongs_to_the_runs_data(run_dir):
    """Another run's RUN/eval/local.jsonl with the same training flags and seed was reused for
    a different partition: its key now names the clients' data."""
    from fed_train.run_evaluation import _local_cache_key

    recorded = json.loads((run_dir / "config.json").read_text())["data_sha256"]
    assert _local_cache_key(load_run(run_dir))["data_sha256"] == recorded


def test_ctrl_c_from_the_first_statement_to_the_interpreters_exit_is_one_line():
    """3 of 22 Ctrl-Cs within 0.2 s printed a traceback: the console script imported
    knnper_cli.main (logging, argparse, the package face) before its handler, and a Ctrl-C
    during the interpreter's exit came from an exit handler. Now the entry point's module
    imports only the handler, and after the command returns a Ctrl-C is still one line."""
    import signal
    import subprocess
    import sys

    import tomllib

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "scripts"
    ]
    assert scripts["knnper"] == "knnper_cli.console:main"
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; before = set(sys.modules); "
            "import knnper_cli.console; print(sorted({'logging', 'argparse', "
            "'knnper_cli.main'} & (set(sys.modules) - before)))",
        ],
        env=_repo_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip() == "[]", probe.stderr
    for module in ("knnper_cli.console", "edge_runtime.console"):
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import atexit, sys, time\n"
                f"from {module} import main\n"
                "atexit.register(lambda: (print('exiting', flush=True), time.sleep(60)))\n"
                "sys.argv[1:] = ['--version']\nsys.exit(main())",
            ],
            env=_repo_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_ctrl_c_as_typed,
        )
        assert child.stdout.readline().strip()  # the version
        assert child.stdout.readline() == "exiting\n"
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
        assert child.returncode == 130 and err.endswith("interrupted\n"), err
        assert "Traceback" not in err, err
