"""The sha256 of every file the exporter writes for one fixed digits run and fixed flags, one
export per datastore kind (flat at three budgets: fp32, fp16, int8 keys; HNSW; ProtoNN; both
encoder precisions) and per kNN-Per setting that changes a bundle (the linear base; l2
normalisation with a pooled lambda rule and the leave-one-out estimator), a signed export (a
fixed key: Ed25519 signs deterministically), one that keeps raw inputs, a device's own bundle
from `knnper-edge init --like`, and a second run's release (`--upgrade-from` the first, its key
map) with a device upgraded to it (its keys mapped; the two runs' input normalisations differ, so
kept inputs cannot be re-embedded across them): a restructuring that should not change what a
device receives is checked by running this before and after it and comparing the two JSON files.

    python -m tests.helpers.bundle_hashes WORKDIR OUT.json
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

TRAIN = [
    "--dataset",
    "digits",
    "--clients",
    "6",
    "--rounds",
    "2",
    "--local-epochs",
    "1",
    "--batch-size",
    "16",
    "--lr",
    "0.05",
    "--seed",
    "0",
    "--device",
    "cpu",
]
# (name, flags): a budget in bytes over the encoder decides the key precision of a flat store.
EXPORTS = [
    ("flat-fp32", ["--backend", "flat", "--budget", "4MB", "--quantize", "fp32"]),
    ("flat-huge", ["--backend", "flat", "--budget", "60MB"]),
    ("flat-large", ["--backend", "flat", "--budget", "4MB"]),
    ("flat-mid", ["--backend", "flat", "--budget", "140kB"]),
    ("flat-small", ["--backend", "flat", "--budget", "110kB"]),
    ("hnsw", ["--backend", "hnsw", "--budget", "4MB"]),
    ("protonn", ["--backend", "protonn", "--budget", "120kB"]),
    ("auto", ["--backend", "auto", "--budget", "130kB"]),
    # the client's own encoder (its linear head inside) and the sizer's head on its logits
    ("flat-linear", ["--backend", "flat", "--budget", "4MB", "--base", "linear"]),
    # normalisation inside the encoder, a pooled lambda rule, the leave-one-out estimator
    (
        "flat-l2-pooled",
        [
            *("--backend", "flat", "--budget", "140kB", "--normalize", "l2"),
            *("--lambda-rule", "pooled", "--lambda-estimator", "loo+val"),
        ],
    ),
]
COMMON = ["--clients", "0,1,5", "--knn-config", "paper", "--seed", "0"]
# a fixed Ed25519 key (its 32-byte seed), so that a signed export's bytes repeat
SIGNING_SEED = bytes(range(32))


def _knnper(*argv: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "knnper_cli.main", "--no-progress", *argv],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 per file; an append-only journal's lines sorted first (parallel workers finish
    clients in any order)."""

    def content(path: Path) -> bytes:
        data = path.read_bytes()
        return b"".join(sorted(data.splitlines(True))) if path.suffix == ".jsonl" else data

    return {
        str(p.relative_to(root)): hashlib.sha256(content(p)).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _edge(*argv: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "edge_runtime.cli", *argv], check=True, stdout=subprocess.DEVNULL
    )


def _inputs(work: Path) -> tuple[Path, Path]:
    """A fixed signing key's PEM file, and the digits training split as an .npz (x, y and
    x_train, y_train: a device's data for `init`, the server's for a key map; test arrays
    too, which --public-data required before it read the training ones only)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from fed_train.data import load_dataset

    work.mkdir(parents=True, exist_ok=True)
    key, data = work / "signing.pem", work / "digits.npz"
    if not key.exists():
        private = ed25519.Ed25519PrivateKey.from_private_bytes(SIGNING_SEED)
        key.write_bytes(
            private.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    if not data.exists():
        ds = load_dataset("digits", None, seed=0)
        x, y = ds.x_train[:300], ds.y_train[:300]
        with data.open("wb") as f:
            np.savez(f, x=x, y=y, x_train=x, y_train=y, x_test=x, y_test=y)
    return key, data


def _device_bundles(work: Path, run2: Path, data: Path) -> dict[str, list[str]]:
    """What only a device writes, each in a folder of its own under `work`: a bundle from
    `init --like`, and a bundle of the first run upgraded to the second run's release."""
    steps = {
        "init-like": [
            *("init", "--like", str(work / "flat-large" / "client_0000")),
            *("--encoder", str(work / "flat-large" / "encoder.onnx"), "--data", str(data)),
            *("--budget", "200kB", "--out", str(work / "init-like" / "device")),
        ],
        "upgraded-mapped": ["flat-large", "--force"],
    }
    for name, argv in steps.items():
        target = work / name
        if target.exists():
            continue
        target.mkdir()
        if name.startswith("upgraded"):
            shutil.copytree(work / argv[0] / "client_0000", target / "device")
            release = work / "release-2" / "client_0000"
            argv = ["upgrade", str(target / "device"), "--to", str(release), *argv[1:]]
        _edge(*argv)
    return steps


def main(work: Path, out: Path) -> None:
    run, run2 = work / "run", work / "run-2"
    key, data = _inputs(work)
    for target, seed in ((run, "0"), (run2, "1")):
        if not (target / "model.pt").exists():
            _knnper("train", *TRAIN[:-4], "--seed", seed, *TRAIN[-2:], "--out", str(target))
    exports = [
        *((name, run, flags) for name, flags in EXPORTS),
        ("signed", run, ["--backend", "flat", "--budget", "4MB", "--signing-key", str(key)]),
        ("keep-inputs", run, ["--backend", "flat", "--budget", "4MB", "--keep-inputs"]),
        (
            "release-2",
            run2,
            [
                *("--backend", "flat", "--budget", "4MB", "--keep-inputs"),
                *("--upgrade-from", str(work / "flat-large"), "--public-data", str(data)),
            ],
        ),
    ]
    hashes = {}
    for name, source, flags in exports:
        target = work / name
        if not target.exists():
            _knnper("export", str(source), "--out", str(target), *flags, *COMMON)
        hashes[name] = file_hashes(target)
    for name in _device_bundles(work, run2, data):
        hashes[name] = file_hashes(work / name)
    out.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
