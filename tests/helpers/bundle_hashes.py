"""The sha256 of every file the exporter writes for one fixed digits run and fixed flags, one
export per datastore kind (flat at three budgets: fp32, fp16, int8 keys; HNSW; ProtoNN; both
encoder precisions) and per kNN-Per setting that changes a bundle (the linear base; l2
normalisation with a pooled lambda rule and the leave-one-out estimator): a restructuring that
should not change what a device receives is checked by running this before and after it and
comparing the two JSON files.

    python -m tests.helpers.bundle_hashes WORKDIR OUT.json
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

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


def main(work: Path, out: Path) -> None:
    run = work / "run"
    if not (run / "model.pt").exists():
        _knnper("train", *TRAIN, "--out", str(run))
    hashes = {}
    for name, flags in EXPORTS:
        target = work / name
        if not target.exists():
            _knnper("export", str(run), "--out", str(target), *flags, *COMMON)
        hashes[name] = file_hashes(target)
    out.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
