"""`knnper deploy local`: a whole Flower federation on this machine, for trying the deployment
and for tests. It starts a real `flower-superlink` and one `flower-supernode` per client, all on
127.0.0.1, submits the Flower App with `flwr run`, follows the run to its end and stops every
process it started (also on Ctrl-C and on failure). Secure by default: TLS with certificates
made for this federation, and SuperNode authentication so that only the SuperNodes whose keys
were registered may join; `--insecure` turns both off."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_runtime._io import (
    open_append,
    parse_json,
    read_json,
    read_regular,
    write_json_atomic,
    write_text_atomic,
)
from edge_runtime.cli_help import install_hint
from fed_train.errors import KnnperError
from fed_train.flower.pki import NodeKey, ServerTLS, make_node_key, make_server_tls
from fed_train.flower.settings import FlowerConfigError, FlowerSettings
from fed_train.progress import Progress
from fed_train.run import open_run
from fed_train.simulation import MAX_METRICS_BYTES
from fed_train.workers import ignoring_ctrl_c

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # a local federation never listens elsewhere
APP_DIR = Path(__file__).parent / "flower" / "app"
CONNECTION = "knnper-local"
MARKER = "KNNPER_FEDERATION"  # set in every process's environment: tests find stragglers by it
LOG_DIR = "flower_logs"
STOP_SECONDS = 10.0  # SIGTERM grace before SIGKILL
CLI_SECONDS = 120.0  # one `flwr` command (register, run, ls)
POLL_SECONDS = 1.0
MAX_FLOWER_FILE_BYTES = 16 << 20  # flower.json: the run's record and its result table
PR_SET_PDEATHSIG = 1  # prctl option, <linux/prctl.h>


class DeployError(KnnperError, RuntimeError):
    """The federation could not start or its run failed; the message says which and why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, process: subprocess.Popen, timeout: float, name: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DeployError(f"{name} exited with code {process.returncode} while starting")
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex((HOST, port)) == 0:
                return
        time.sleep(0.2)
    raise DeployError(f"{name} did not listen on {HOST}:{port} within {timeout:g} s")


try:  # looked up here, not in the forked child, where only async-signal-safe work belongs
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None


def _child_setup(mask: set[signal.Signals]) -> Callable[[], None]:
    """What a started child runs before exec: the parent's signal mask from before the start
    (`Processes.start` holds Ctrl-C while it forks), and on Linux the kernel's SIGTERM when the
    deploying process dies, even by SIGKILL, so a killed `knnper deploy` cannot leave a
    federation running. Elsewhere the stop in `finally` is the only guard."""

    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)

    return setup


@dataclass
class Processes:
    """Every process the federation starts, each in its own session (process group), so that
    stopping one also stops what it spawned (SuperExec, ServerApp and ClientApp processes)."""

    env: dict[str, str]
    log_dir: Path
    running: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        """Ctrl-C is held until the child is in `running`: Python runs its fork hooks around a
        start with a preexec function, and a KeyboardInterrupt raised inside one is printed and
        dropped, so the Ctrl-C was lost and the federation ran on. Held, it arrives after."""
        log_file = open_append(self.log_dir / f"{name}.log")  # the child owns it
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.running[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=_child_setup(mask),
            )
        finally:
            log_file.close()
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        process = self.running[name]
        self._write_pids()
        return process

    def _write_pids(self) -> None:
        pids = {name: p.pid for name, p in self.running.items()}
        write_text_atomic(self.log_dir / "processes.json", json.dumps(pids, indent=2))

    def run_cli(self, argv: list[str], timeout: float = CLI_SECONDS) -> dict[str, Any]:
        """A `flwr` command with --format json; its JSON answer, or a DeployError."""
        try:
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                env=self.env,
                timeout=timeout,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired as err:
            raise DeployError(
                f"`{' '.join(argv[:3])}` did not answer within {timeout:g} s"
            ) from err
        try:
            answer = json.loads(done.stdout[done.stdout.index("{") :])
        except ValueError:
            answer = {}
        if done.returncode != 0 or not answer.get("success"):
            detail = answer.get("error-message") or (done.stderr or done.stdout).strip()
            raise DeployError(
                f"`{' '.join(argv[:3])}` failed: "
                f"{detail.splitlines()[-1] if detail else done.returncode}"
            )
        return answer

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        process = self.running.get(name)
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                pass

    def stop_all(self) -> None:
        """SIGTERM every group, wait (bounded), then SIGKILL what is left; a further Ctrl-C
        waits for this rather than leave processes behind."""
        with ignoring_ctrl_c():
            self._stop_all()

    def _stop_all(self) -> None:
        for name in reversed(list(self.running)):
            self.stop(name)
        deadline = time.monotonic() + STOP_SECONDS
        for process in self.running.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for name, process in self.running.items():
            try:  # the group, not only the leader: its children may outlive a dead leader
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            except PermissionError:
                log.warning("cannot kill the processes of %s", name)
            process.wait(timeout=STOP_SECONDS)


@dataclass
class LocalFederation:
    """Settings of `knnper deploy local` beyond the run's own (FlowerSettings)."""

    clients: int
    insecure: bool = False
    startup_timeout: float = 60.0
    superlink_port: int | None = None
    device: str = "cpu"  # every SuperNode's node config `device`
    app_dir: Path = APP_DIR  # benchmarks swap in an empty ClientApp to measure Flower's floor
    bundle_dir: Path | None = None  # node i keeps its own bundle in bundle_dir/node-i
    trusted_key: Path | None = None  # every node's node config `trusted-key` (a public key)


def _connection_toml(port: int, ca_cert: Path | None) -> str:
    lines = [
        "[superlink]",
        f'default = "{CONNECTION}"',
        f"[superlink.{CONNECTION}]",
        f'address = "{HOST}:{port}"',
    ]
    # the CA's path lies under TMPDIR, which may hold a `"` or a backslash
    lines.append(
        "insecure = true"
        if ca_cert is None
        else f"root-certificates = {node_config_value(str(ca_cert))}"
    )
    return "\n".join(lines) + "\n"


def run_config_toml(settings: FlowerSettings) -> str:
    """The settings as `flwr run --run-config FILE` takes them: a string quoted as TOML (JSON's
    \\u escapes of a character beyond U+FFFF are surrogates, which TOML refuses), the other
    scalars as JSON writes them, which is TOML too. A path that is no UTF-8 (Python keeps its
    bytes as lone surrogates) has no TOML spelling: refused here, before any process starts."""
    lines = []
    for key, value in settings.to_run_config().items():
        if not isinstance(value, str):
            lines.append(f"{key} = {json.dumps(value)}\n")
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise FlowerConfigError(
                f"{key} {value!r} is not UTF-8, which Flower's run config (TOML) must be: rename it"
            ) from None
        lines.append(f"{key} = {node_config_value(value)}\n")
    return "".join(lines)


def _run_timeout(settings: FlowerSettings) -> float:
    """The longest a healthy run can take: connecting, every round and the evaluation at their
    timeouts, plus a margin for starting the apps."""
    rounds = 0 if settings.release else settings.run.training.rounds
    return settings.connect_timeout + (rounds + 1) * settings.round_timeout + 120.0


def rounds_logged(run_dir: Path) -> list[dict[str, Any]]:
    """The rounds the ServerApp has logged so far (metrics.jsonl; a torn last line skipped)."""
    try:
        raw = read_regular(run_dir / "metrics.jsonl", MAX_METRICS_BYTES)
    except OSError:  # not written yet (or not a file: the ServerApp will say so)
        return []
    rows = []
    for line in (raw or b"").splitlines():
        try:
            rows.append(parse_json(line, strict=False))
        except ValueError:
            break
    return rows


def _read_flower_file(path: Path) -> dict[str, Any]:
    """flower.json, which the ServerApp writes: a JSON object (ValueError otherwise)."""
    record = read_json(path, limit=MAX_FLOWER_FILE_BYTES, fix="run the deployment again")
    if not isinstance(record, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return record


def _follow_run(
    procs: Processes, run_id: str, run_dir: Path, timeout: float, bar: Progress
) -> dict[str, Any]:
    """Wait for the run to finish, counting its rounds on `bar`; the run's real status comes
    from the SuperLink, since `flwr run` returns as soon as the run is submitted."""
    deadline = time.monotonic() + timeout
    last_ls = 0.0
    flower_file = run_dir / "flower.json"
    while time.monotonic() < deadline:
        while bar.done < min(len(rounds_logged(run_dir)), bar.total or 0):
            bar.update()
        if procs.running["superlink"].poll() is not None:
            raise DeployError(
                f"the SuperLink exited with code "
                f"{procs.running['superlink'].returncode} during the run"
            )
        done = False
        try:
            done = _read_flower_file(flower_file).get("status") in ("completed", "failed")
        except (OSError, ValueError):
            pass  # not written yet
        if done or time.monotonic() - last_ls > 15.0:
            last_ls = time.monotonic()
            listing = procs.run_cli(
                ["flwr", "ls", CONNECTION, "--run-id", run_id, "--format", "json"]
            )
            run = listing["runs"][0]
            if str(run["status"]).startswith("finished"):
                return run
        time.sleep(POLL_SECONDS)
    raise DeployError(f"the run did not finish within {timeout:g} s")


def start_superlink(procs: Processes, tls: ServerTLS | None, port: int, timeout: float) -> int:
    """The SuperLink on HOST:port, and the `flwr` CLI's connection to it (in FLWR_HOME)."""
    home = Path(procs.env["FLWR_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    write_text_atomic(home / "config.toml", _connection_toml(port, tls.ca_cert if tls else None))
    argv = [
        "flower-superlink",
        "--host",
        HOST,
        "--port",
        str(port),
        "--disable-runtime-dependency-installation",
    ]
    argv += (
        [
            "--ssl-ca-certfile",
            str(tls.ca_cert),
            "--ssl-certfile",
            str(tls.cert),
            "--ssl-keyfile",
            str(tls.key),
            "--enable-supernode-auth",
        ]
        if tls
        else ["--insecure"]
    )
    wait_for_port(port, procs.start("superlink", argv), timeout, "the SuperLink")
    return port


def register_supernode(procs: Processes, key: NodeKey) -> None:
    """Only SuperNodes whose public key the SuperLink has registered may join."""
    procs.run_cli(
        ["flwr", "supernode", "register", str(key.public), CONNECTION, "--format", "json"]
    )


def start_supernode(
    procs: Processes,
    name: str,
    port: int,
    tls: ServerTLS | None,
    key: NodeKey | None,
    node_config: str,
) -> subprocess.Popen:
    argv = [
        "flower-supernode",
        "--superlink",
        f"{HOST}:{port}",
        "--host",
        HOST,
        "--port",
        str(free_port()),
        "--node-config",
        node_config,
    ]
    argv += ["--root-certificates", str(tls.ca_cert)] if tls else ["--insecure"]
    if key is not None:
        argv += ["--auth-supernode-private-key", str(key.private)]
    return procs.start(name, argv)


def node_bundle_dir(bundle_dir: Path, node: int) -> Path:
    """Where the local federation's node `node` keeps its own bundle."""
    return bundle_dir / f"node-{node}"


# what TOML cannot read inside a quoted value, or flwr's parser cuts it at
_NODE_CONFIG_ESCAPES = {c: f"\\u{ord(c):04x}" for c in ('"', "\\", "\x7f", *map(chr, range(32)))}


def node_config_value(text: str) -> str:
    """`text` quoted for `flower-supernode --node-config`, to come back whole on the node.
    flwr (common.config.parse_config_args) takes a value from its opening `"` to the next `"`,
    knowing no escapes, and reads the pair as TOML: so a `"`, a backslash (an escape to TOML)
    and the control characters TOML refuses in a string (a newline among them) are written as
    TOML's \\uXXXX escapes. Anything else stays inside the quotes as it is: spaces, `=` and
    `,`, and other scripts' letters, which argv carries as their bytes (a name that is no UTF-8
    as well, as Python decodes and encodes file names)."""
    return '"' + "".join(_NODE_CONFIG_ESCAPES.get(c, c) for c in text) + '"'


def node_config(federation: LocalFederation, node: int) -> str:
    """Node `node`'s --node-config: its partition, its device and, for release pushes, where it
    keeps its bundle and the key it trusts."""
    values: dict[str, str] = {"device": federation.device}
    if federation.bundle_dir is not None:
        values["bundle-dir"] = str(node_bundle_dir(federation.bundle_dir.resolve(), node))
    if federation.trusted_key is not None:
        values["trusted-key"] = str(federation.trusted_key.resolve())
    return f"partition-id={node} num-partitions={federation.clients} " + " ".join(
        f"{key}={node_config_value(value)}" for key, value in values.items()
    )


def deploy_local(
    settings: FlowerSettings, federation: LocalFederation, *, progress: bool = False
) -> dict[str, Any]:
    """Run `settings` on a local federation; returns flower.json's record with the SuperLink's
    account of the run (status, bytes) added."""
    settings.check()
    if federation.clients != settings.run.clients:
        raise FlowerConfigError(
            f"--clients {federation.clients} differs from the run's {settings.run.clients} clients"
        )
    for tool in ("flower-superlink", "flower-supernode", "flwr"):
        if shutil.which(tool) is None:
            raise DeployError(f"{tool} is not installed: {install_hint('flower')}")
    node_configs = [node_config(federation, i) for i in range(federation.clients)]
    run_dir = Path(settings.run_dir).resolve()
    settings.run_dir = str(run_dir)
    run_toml_text = run_config_toml(settings)
    if settings.release:  # pushing an export: run_dir only records it
        run_dir.mkdir(parents=True, exist_ok=True)
    else:  # a bad data set or run directory fails before any process
        open_run(settings.run, run_dir)
    log_dir = run_dir / LOG_DIR
    log_dir.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="knnper-flower-"))  # 0700: keys and the CLI's home
    env = {
        **os.environ,
        "FLWR_HOME": str(work / "home"),
        MARKER: str(run_dir),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = Processes(env, log_dir)
    try:
        port, tls = _start_federation(procs, federation, work / "pki", node_configs)
        run_toml = work / "run.toml"
        write_text_atomic(run_toml, run_toml_text)
        submitted = procs.run_cli(
            [
                "flwr",
                "run",
                str(federation.app_dir),
                CONNECTION,
                "--run-config",
                str(run_toml),
                "--format",
                "json",
            ]
        )
        run_id = str(submitted["run-id"])
        log.info(
            "run %s submitted to the SuperLink on %s:%d (%s)",
            run_id,
            HOST,
            port,
            "TLS, SuperNode authentication" if tls else "insecure",
        )
        rounds = 0 if settings.release else settings.run.training.rounds
        with Progress(
            rounds,
            desc="deploy local",
            unit="round",
            enabled=progress,
            initial=min(len(rounds_logged(run_dir)), rounds),
        ) as bar:
            status = _follow_run(procs, run_id, run_dir, _run_timeout(settings), bar)
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    return _finished_record(run_dir, status, log_dir)


def _start_federation(
    procs: Processes, federation: LocalFederation, pki: Path, node_configs: list[str]
) -> tuple[int, ServerTLS | None]:
    """The SuperLink and one SuperNode per client, each node registered with a key of its own
    unless the federation is insecure; returns the SuperLink's port and its TLS files."""
    tls = make_server_tls(pki, HOST) if not federation.insecure else None
    port = start_superlink(
        procs, tls, federation.superlink_port or free_port(), federation.startup_timeout
    )
    keys = [
        make_node_key(pki, f"supernode-{i}") if tls else None for i in range(federation.clients)
    ]
    if tls:  # one `flwr` process per key, a few at a time: each spends seconds starting
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(lambda key: register_supernode(procs, key), keys))
    for i, key in enumerate(keys):
        start_supernode(procs, f"supernode-{i}", port, tls, key, node_configs[i])
    return port, tls


def _finished_record(run_dir: Path, status: dict[str, Any], log_dir: Path) -> dict[str, Any]:
    """flower.json's record with the SuperLink's `status` added, written back; DeployError
    unless both the SuperLink and the ServerApp say the run completed."""
    try:
        record = _read_flower_file(run_dir / "flower.json")
    except FileNotFoundError:
        record = {}
    except (OSError, ValueError) as err:
        raise DeployError(f"{run_dir / 'flower.json'}: {err}") from None
    record["superlink_run"] = status
    write_json_atomic(run_dir / "flower.json", record)
    if status["status"] != "finished:completed" or record.get("status") != "completed":
        reason = record.get("error") or status.get("status-details") or status["status"]
        raise DeployError(f"the Flower run {status['status']}: {reason} (logs in {log_dir})")
    return record
