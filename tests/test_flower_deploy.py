"""A real Flower federation on loopback: `flower-superlink` and `flower-supernode` processes with
TLS and SuperNode authentication, started by `knnper deploy local` or by its building blocks.
Every test checks that no process it caused is left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")
if shutil.which("flower-superlink") is None or shutil.which("flower-supernode") is None:
    pytest.skip("flwr's executables are not on PATH", allow_module_level=True)

from fed_train.deploy import (  # noqa: E402
    MARKER,
    Processes,
    free_port,
    register_supernode,
    start_superlink,
    start_supernode,
)
from fed_train.flower.pki import make_node_key, make_server_tls  # noqa: E402
from fed_train.simulation import load_checkpoint  # noqa: E402
from knnper_cli.main import main  # noqa: E402

pytestmark = pytest.mark.slow
KNNPER = [sys.executable, "-m", "knnper_cli.main"]
TRAINING_FLAGS = [
    "--dataset",
    "digits",
    "--clients",
    "2",  # each SuperNode is a process, and each message to it starts another
    "--unseen-fraction",
    "0",
    "--rounds",
    "2",
    "--local-epochs",
    "1",
    "--batch-size",
    "16",
    "--lr",
    "0.05",
    "--momentum",
    "0.9",
    "--milestones",
    "0.5",
    "--seed",
    "0",
]


def _leftovers(marker: str) -> list[str]:
    """Live (not zombie) processes whose environment carries this federation's marker."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if f"{MARKER}={marker}".encode() not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                found.append(f"{proc.name} {(proc / 'cmdline').read_bytes()[:80]!r}")
        except OSError:
            continue
    return found


def _wait_until_gone(marker: str, timeout: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := _leftovers(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.5)


def test_a_supernode_whose_key_is_not_registered_is_refused(tmp_path):
    marker = str(tmp_path)
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "home"), MARKER: marker}
    procs = Processes(env, tmp_path)
    try:
        tls = make_server_tls(tmp_path / "pki")
        port = start_superlink(procs, tls, free_port(), timeout=60)
        member, stranger = (
            make_node_key(tmp_path / "pki", "member"),
            make_node_key(tmp_path / "pki", "stranger"),
        )
        register_supernode(procs, member)
        start_supernode(procs, "member", port, tls, member, "partition-id=0 num-partitions=1")
        refused = start_supernode(
            procs, "stranger", port, tls, stranger, "partition-id=0 num-partitions=1"
        )
        assert refused.wait(timeout=90) != 0
        assert "Failed to activate SuperNode" in (tmp_path / "stranger.log").read_text()
        nodes = procs.run_cli(["flwr", "supernode", "ls", "knnper-local", "--format", "json"])
        assert [n["status"] for n in nodes["nodes"]] in (["online"], ["registered"])
        assert procs.running["member"].poll() is None  # the registered one stays connected
    finally:
        procs.stop_all()
    assert _wait_until_gone(marker) == []


# kNN-Per's setting chosen in one message round, not five (each costs Flower's floor, about 6 s
# here); the automatic choices' rounds are tests/test_flower.py's, on an in-process grid
KNN_SETTING = ["--base", "global", "--lambda-rule", "client", "--lambda-estimator", "val"]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """`knnper deploy local` with 2 SuperNodes; the one serving client 1 is killed as soon as
    round 1 is logged, so round 2 and the evaluation go on with the one that answers."""
    root = tmp_path_factory.mktemp("deploy")
    run = root / "run"
    command = [
        *KNNPER,
        "--threads",
        "1",
        "--no-progress",
        "deploy",
        "local",
        *TRAINING_FLAGS,
        "--checkpoint-every",
        "1",
        "--min-train-clients",
        "1",
        "--round-timeout",
        "25",  # round 1 takes about 10 s here; the dead node costs this wait twice
        *KNN_SETTING,
        "--out",
        str(run),
    ]
    deploy = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = run / "metrics.jsonl"
        _wait_for(
            lambda: metrics.is_file() and metrics.read_text().strip(),
            300,
            "round 1 of the Flower run",
        )
        pids = json.loads((run / "flower_logs" / "processes.json").read_text())
        os.killpg(pids["supernode-1"], signal.SIGKILL)
        output, _ = deploy.communicate(timeout=300)
    finally:
        if deploy.poll() is None:
            deploy.send_signal(signal.SIGINT)
            deploy.wait(timeout=60)
    return run, deploy.returncode, output


def test_deploy_local_completes_with_the_clients_that_answer(deployed):
    run, returncode, output = deployed
    assert returncode == 0, output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["clients"] for r in rows] == [2, 1]
    record = json.loads((run / "flower.json").read_text())
    assert record["status"] == "completed"
    assert record["superlink_run"]["status"] == "finished:completed"
    assert record["evaluation"]["missing_clients"] == [1]
    assert record["superlink_run"]["network-traffic"]["total-bytes"] > 0


def test_every_process_of_the_federation_is_gone(deployed):
    run, _, _ = deployed
    assert _wait_until_gone(str(run)) == []


def test_the_flower_round_equals_the_simulation_round(deployed, tmp_path):
    """Round 1 had every client: its checkpoint equals `knnper train`'s bit for bit."""
    run, _, _ = deployed
    sim = tmp_path / "sim"
    # in this process (torch is imported already), on one thread as the Flower run's apps
    argv = ["train", *TRAINING_FLAGS, "--checkpoint-every", "1", "--out", str(sim)]
    assert main(["--threads", "1", "--no-progress", *argv]) == 0
    assert (run / "config.json").read_text() == (sim / "config.json").read_text()
    flower = load_checkpoint(run / "checkpoints" / "round_0001.pt").weights
    simulated = load_checkpoint(sim / "checkpoints" / "round_0001.pt").weights
    for name, w in simulated.items():
        np.testing.assert_array_equal(flower[name], w)


def test_knnper_evaluate_on_the_flower_run_agrees_with_the_federated_evaluation(deployed, tmp_path):
    run, _, _ = deployed
    out = tmp_path / "evaluation.json"
    argv = ["evaluate", str(run), "--methods", "fedavg", "knnper", *KNN_SETTING, "--json", str(out)]
    assert main(["--threads", "1", "--no-progress", *argv]) == 0  # in this process
    server = {c["client_id"]: c for c in json.loads(out.read_text())["clients"]}
    federated = json.loads((run / "flower.json").read_text())["evaluation"]["clients"]
    assert [c["client_id"] for c in federated] == [0]
    for row in federated:
        for method in ("fedavg", "knnper"):
            assert abs(row[method] - server[row["client_id"]][method]) <= 1e-6
        assert row["knnper_lambda"] == server[row["client_id"]]["knnper_lambda"]
    assert np.isfinite(row["knnper"])


def _ctrl_c_as_typed() -> None:
    """The child takes Ctrl-C as a terminal would deliver it, even where pytest itself runs as a
    background job (which starts with SIGINT ignored, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a blocked one is inherited


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_stopping_deploy_stops_every_process(tmp_path, sig):
    """Ctrl-C unwinds and stops the federation; a SIGKILLed deploy cannot, so the kernel stops
    its children (parent-death signal) and they stop theirs."""
    run = tmp_path / "run"
    deploy = subprocess.Popen(
        [*KNNPER, "--no-progress", "deploy", "local", *TRAINING_FLAGS, "--out", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_ctrl_c_as_typed,
    )
    try:
        pids = run / "flower_logs" / "processes.json"
        _wait_for(
            lambda: pids.is_file() and "supernode-0" in pids.read_text(),
            120,
            "a SuperNode to start",
        )
        deploy.send_signal(sig)
        output, _ = deploy.communicate(timeout=60)
    finally:
        if deploy.poll() is None:
            deploy.kill()
    if sig == signal.SIGINT:
        assert deploy.returncode == 130, output
        assert output.strip().splitlines()[-1].startswith("knnper: interrupted")
    assert _wait_until_gone(str(run), timeout=30) == []


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--algorithm", "fedsgd"], "unknown algorithm 'fedsgd'"),
        (["--algorithm", "local"], "does not train federatedly"),
        (["--dataset", "fashion-mnist", "--data", "/nonexistent/fmnist"], "/nonexistent/fmnist"),
        (["--eval-methods", "magic"], "unknown evaluation method"),
        (["--clients", "0"], "must be >= 1"),
    ],
)
def test_bad_deploy_configuration_fails_before_any_process_starts(tmp_path, capsys, flags, message):
    run = tmp_path / "run"
    try:
        code = main(["deploy", "local", "--out", str(run), *flags])
    except SystemExit as exited:  # a flag argparse refuses while parsing
        code = exited.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (run / "flower_logs").exists()


def test_knnper_export_works_on_the_flower_run(deployed, tmp_path):
    run, _, _ = deployed
    out = tmp_path / "bundles"
    argv = ["export", str(run), "--out", str(out), "--budget", "1M", "--backend", "flat"]
    argv += ["--clients", "0", "--workers", "1"]
    assert main(["--threads", "1", "--no-progress", *argv]) == 0  # in this process
    assert (out / "client_0000" / "manifest.json").is_file()
