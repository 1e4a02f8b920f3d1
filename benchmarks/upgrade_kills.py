"""`knnper-edge upgrade` killed at random instants while processes predict from the same bundle:
after every kill the bundle must load as the old version or the new, with every label it held,
and no reader may ever fail or see a mix.

    python benchmarks/upgrade_kills.py --out OUT [--kills 50] [--readers 20] [--keys 3000]
    python benchmarks/upgrade_kills.py --smoke --out OUT       # 6 kills, 2 readers

Each round copies the pristine old-version bundle into place (unless the last kill left it old),
starts `python -c Runtime.load(B).upgrade(RELEASE, key_map=MAP)`, sends it SIGKILL after a
random delay drawn from [0, 1.2 x the median time an unkilled upgrade takes with the readers
at work) once its process has loaded the bundle, then loads the bundle
and checks it. Readers run the whole time: each loads the bundle and predicts in a loop and
reports every encoder it saw and any failure. Outputs in OUT: kills.md and run.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_runtime._io import exchange_directories, write_text_atomic
from edge_runtime.locking import directory_lock
from edge_runtime.runtime import Runtime
from edge_runtime.versions import encoder_sha256
from experiments.benchmark_support import child_env

sys.path.insert(0, str(Path(__file__).resolve().parent))
from upgrade_device import bundle, key_map, mlp_encoder  # noqa: E402

_UPGRADER = """
import sys, time
from edge_runtime.runtime import Runtime
rt = Runtime.load(sys.argv[1], intra_op_threads=1)
print("ready", flush=True)
start = time.perf_counter()
rt.upgrade(sys.argv[2], key_map=sys.argv[3])
print(time.perf_counter() - start, flush=True)
"""

_READER = """
import json, sys, time
import numpy as np
from edge_runtime.runtime import Runtime
path, stop = sys.argv[1], sys.argv[2]
x = np.random.default_rng(0).integers(0, 256, (2, 28, 28, 1), dtype=np.uint8)
seen, loads, failures, count = set(), 0, [], 0
import os
print("ready", flush=True)
while not os.path.exists(stop):
    try:
        rt = Runtime.load(path, intra_op_threads=1)
        assert rt.predict_proba(x).shape == (2, 10)
        seen.add(rt.manifest.files["encoder.onnx"])
        loads += 1
    except Exception as exc:  # every failure is counted, none is expected
        count += 1
        if len(failures) < 5:
            failures.append(f"{type(exc).__name__}: {exc}")
print(json.dumps({"seen": sorted(seen), "loads": loads, "failures": failures,
                  "failure_count": count}))
"""


def _reset(device: Path, pristine: Path) -> None:
    """Put the old version back while readers run: a copy beside it, swapped in under the
    bundle's lock in one step, as an upgrade does (a plain delete-and-copy would show the
    readers a half-copied folder)."""
    fresh = device.parent / f".{device.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    shutil.copytree(pristine, fresh)
    with directory_lock(device, exclusive=True):
        if not exchange_directories(fresh, device):
            raise SystemExit("this system cannot swap directories atomically (renameat2)")
    shutil.rmtree(fresh)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="results directory")
    p.add_argument("--kills", type=int, default=50, help="upgrades killed")
    p.add_argument("--readers", type=int, default=20, help="processes predicting meanwhile")
    p.add_argument("--keys", type=int, default=3000, help="keys in the device's bundle")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill instants")
    p.add_argument("--smoke", action="store_true", help="3 kills, 1 reader, 300 keys")
    args = p.parse_args(argv)
    if args.smoke:
        args.kills, args.readers, args.keys = 3, 1, 300
    return args


@dataclass(frozen=True)
class Setup:
    """The device's bundle, the pristine old version it is reset to, the release and key map
    an upgrade applies, each encoder's sha256 by version name, and the labels it must keep."""

    device: Path
    pristine: Path
    release: Path
    mapping: Path
    versions: dict[str, str]
    labels: np.ndarray

    def upgrader(self) -> list[str]:
        """The command of one upgrade process (it prints "ready" once it has loaded)."""
        return [
            sys.executable,
            "-c",
            _UPGRADER,
            *map(str, (self.device, self.release, self.mapping)),
        ]


def set_up(work: Path, keys: int) -> Setup:
    """An old and a new encoder, a `keys`-key bundle of the old one copied into place as the
    device's, and a release of the new one with its key map."""
    old, new = mlp_encoder(work / "old.onnx", 0), mlp_encoder(work / "new.onnx", 1)
    pristine = bundle(work / "pristine", old, keys, 0)
    release = bundle(work / "release", new, 50, 1)
    mapping = key_map(old, new, work / "map.npz")
    versions = {encoder_sha256(p.read_bytes()): name for name, p in (("old", old), ("new", new))}
    labels = Runtime.load(pristine).datastore.labels_.copy()
    device = work / "devices" / "device"
    device.parent.mkdir()
    shutil.copytree(pristine, device)
    return Setup(device, pristine, release, mapping, versions, labels)


def unkilled_seconds(setup: Setup) -> list[float]:
    """How long three upgrades take, unkilled, with the readers at work."""
    durations = []
    for _ in range(3):
        done = subprocess.run(
            setup.upgrader(),
            env=child_env(1),
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        durations.append(float(done.stdout.split()[-1]))
        _reset(setup.device, setup.pristine)
    return durations


def kill_once(setup: Setup, delay: float, problems: list[str]) -> dict:
    """One upgrade sent SIGKILL `delay` seconds after it loaded the bundle, then the bundle
    loaded and checked (what is wrong appended to `problems`); reset unless left old."""
    proc = subprocess.Popen(
        setup.upgrader(),
        env=child_env(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    proc.stdout.readline()  # loaded: the upgrade starts now
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    try:
        rt = Runtime.load(setup.device, intra_op_threads=1)
        version = setup.versions[rt.manifest.files["encoder.onnx"]]
        if not np.array_equal(rt.datastore.labels_, setup.labels):
            problems.append(f"kill at {delay:.3f} s: labels differ")
    except Exception as exc:  # noqa: BLE001 - every failure is the finding
        version = "broken"
        problems.append(f"kill at {delay:.3f} s: {type(exc).__name__}: {exc}")
    if version != "old":
        _reset(setup.device, setup.pristine)
    return {"delay_s": delay, "version": version, "finished": proc.returncode == 0}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory(prefix="knnper-upgrade-kills-") as tmp:
        work = Path(tmp)
        setup = set_up(work, args.keys)
        stop = work / "stop"
        readers = [
            subprocess.Popen(
                [sys.executable, "-c", _READER, str(setup.device), str(stop)],
                env=child_env(1),
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(args.readers)
        ]
        for reader in readers:  # every reader predicts before the first upgrade
            reader.stdout.readline()
        durations = unkilled_seconds(setup)
        span = 1.2 * float(np.median(durations))  # some kills come after the commit
        problems: list[str] = []
        outcomes = [
            kill_once(setup, float(rng.uniform(0, span)), problems) for _ in range(args.kills)
        ]
        stop.touch()
        reads = [
            json.loads(r.communicate(timeout=120)[0].strip().splitlines()[-1]) for r in readers
        ]
    counts = {v: sum(o["version"] == v for o in outcomes) for v in ("old", "new", "broken")}
    reader_failures = sum(r["failure_count"] for r in reads)
    summary = {
        "kills": args.kills,
        "readers": args.readers,
        "keys": args.keys,
        "unkilled_upgrade_s": durations,
        "outcomes": counts,
        "problems": problems,
        "reader_loads": sum(r["loads"] for r in reads),
        "reader_failures": reader_failures,
        "reader_failure_examples": [f for r in reads for f in r["failures"]][:5],
        "readers_saw": sorted({setup.versions.get(s, s) for r in reads for s in r["seen"]}),
        "command": " ".join(
            ["python benchmarks/upgrade_kills.py", *(argv if argv is not None else sys.argv[1:])]
        ),
    }
    write_text_atomic(out / "run.json", json.dumps(summary, indent=2) + "\n")
    verdict = "passed" if not problems and not reader_failures else "FAILED"
    text = "\n".join(
        [
            f"{args.kills} SIGKILLs of `upgrade` ({args.keys}-key flat:int8 bundle, kill instants "
            f"uniform in [0, {span:.3f} s) after the upgrader loaded the bundle) with "
            f"{args.readers} processes predicting: {verdict}.",
            "",
            "| left as old | left as new | broken | reader loads | reader failures |",
            "|---|---|---|---|---|",
            f"| {counts['old']} | {counts['new']} | {counts['broken']} | "
            f"{summary['reader_loads']} | {reader_failures} |",
            "",
            f"Readers saw: {', '.join(summary['readers_saw'])}. Command: `{summary['command']}`",
            "",
        ]
    )
    write_text_atomic(out / "kills.md", text)
    print(text)
    return 0 if verdict == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
