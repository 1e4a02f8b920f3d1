"""The x86 side of .ci/arm: bundles the real exporter writes for each model it supports, at test
scale, the inputs to compare them on, and what the device runtime answers here.

    python -m tests.helpers.arm_cases OUT

Models: the digits CNN, the Fashion-MNIST CNN (if Debian's dataset-fashion-mnist is installed)
and MobileNet-v2-gn on CIFAR-10 (if ../shared/data/cifar10/cifar10.npz is there), each trained
for a round or two on a few hundred images. Backends: every one the exporter writes (flat
int8 / fp16 / fp32, HNSW and ProtoNN; .ci/arm cross-compiles hnswlib for the emulated userland,
as hnswlib publishes no aarch64 wheels); for MobileNet-v2-gn flat int8, HNSW and ProtoNN (its
int8 export takes minutes here, and the flat dtypes differ from flat int8 only in the
datastore, which the small CNNs cover). Inputs: 200 per
model (120 real test images, 60 uniform random, 20 extreme: all 0, all 255, checkerboards).
OUT/cases.json lists each case's files and the models skipped with their reason;
tests/test_arm_device.py reads it under emulated ARM.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from edge_runtime.runtime import Runtime
from export.exporter import ExportSettings, export_run
from export.sizing import SearchSpace
from fed_train.algorithms.base import TrainingConfig
from fed_train.run import RunConfig, load_run, train

REPO = Path(__file__).resolve().parents[2]
CIFAR10 = REPO.parent / "shared" / "data" / "cifar10" / "cifar10.npz"
FASHION = Path("/usr/share/datasets/fashion-mnist")
SPACES = {
    "flat-int8": SearchSpace(backends=("flat",), flat_dtypes=("int8",)),
    "flat-fp16": SearchSpace(backends=("flat",), flat_dtypes=("fp16",)),
    "flat-fp32": SearchSpace(backends=("flat",), flat_dtypes=("fp32",)),
    "hnsw": SearchSpace(backends=("hnsw",), hnsw_M=(8,)),
    "protonn": SearchSpace(
        backends=("protonn",), protonn_dims=(8,), protonn_fractions=(0.3,), protonn_steps=30
    ),
}
ROUND = TrainingConfig(rounds=1, epochs=1, batch_size=16, lr=0.05, momentum=0.9)
INPUTS = 200  # compared per model
# name -> (run config, the backends exported, why it cannot run here or None)
MODELS = {
    "digits": (
        RunConfig(dataset="digits", clients=4, seed=0, training=ROUND),
        list(SPACES),
        None,
    ),
    "fashion-mnist": (
        RunConfig(dataset="fashion-mnist", max_train=1200, clients=4, seed=0, training=ROUND),
        list(SPACES),
        None if FASHION.is_dir() else f"{FASHION} is absent (dataset-fashion-mnist)",
    ),
    "cifar10-mobilenet-v2-gn": (
        RunConfig(
            dataset="npz",
            data=str(CIFAR10),
            max_train=400,
            clients=4,
            seed=0,
            model="mobilenet-v2-gn",
            training=ROUND,
        ),
        ["flat-int8", "hnsw", "protonn"],
        None if CIFAR10.is_file() else f"{CIFAR10} is absent",
    ),
}


def comparison_inputs(x_test: np.ndarray, total: int, seed: int = 0) -> np.ndarray:
    """`total` raw uint8 images: 60% real, 30% uniform random, 10% extreme."""
    shape = x_test.shape[1:]
    real, extremes = total * 6 // 10, total // 10
    rng = np.random.default_rng(seed)
    random = rng.integers(0, 256, size=(total - real - extremes, *shape), dtype=np.uint8)
    grid = (np.indices(shape[:2]).sum(axis=0) % 2).astype(np.uint8)[..., None]
    patterns = [np.zeros(shape), np.full(shape, 255), 255 * grid, 255 * (1 - grid)]
    extreme = np.stack([np.broadcast_to(patterns[i % 4], shape) for i in range(extremes)])
    return np.ascontiguousarray(
        np.concatenate([x_test[:real], random, extreme.astype(np.uint8)]), dtype=np.uint8
    )


def write_cases(out: Path) -> dict:
    """Train, export and answer every model that can run here; returns what cases.json holds."""
    cases, skipped = [], {}
    for name, (config, backends, absent) in MODELS.items():
        if absent:
            skipped[name] = absent
            continue
        started = time.perf_counter()
        root = out / name
        train(config, root / "run", progress=False)
        run = load_run(root / "run")
        x = comparison_inputs(np.asarray(run.dataset.x_test), INPUTS)
        np.save(root / "inputs.npy", x)
        for backend in backends:
            settings = ExportSettings(space=SPACES[backend], calibration_samples=64)
            report = export_run(
                run, root / backend, {0: 10**7}, settings, clients="0", progress=False
            )
            bundle = root / backend / report["clients"][0]["bundle"]
            runtime = Runtime.load(bundle, intra_op_threads=1)
            case = {
                "name": f"{name}/{backend}",
                "bundle": str(bundle),
                "inputs": str(root / "inputs.npy"),
                "probabilities": str(root / f"{backend}.probabilities.npy"),
            }
            np.save(case["probabilities"], runtime.predict_proba(x))
            if backend == "hnsw":  # the encoder's own outputs, once per model (its session)
                z, logits = runtime.embed(x)
                case["embedding"], case["logits"] = (
                    str(root / f"encoder.{what}.npy") for what in ("embedding", "logits")
                )
                np.save(case["embedding"], z)
                np.save(case["logits"], logits)
            cases.append(case)
        print(f"{name}: {len(backends)} bundles in {time.perf_counter() - started:.0f} s")
    return {"cases": cases, "skipped": skipped}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.helpers.arm_cases OUT", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    record = write_cases(out)
    (out / "cases.json").write_text(json.dumps(record, indent=1))
    for name, reason in record["skipped"].items():
        print(f"skipped {name}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
