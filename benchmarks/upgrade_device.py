"""Time and peak private memory of `Runtime.upgrade` on a device: a 10,000-key flat:int8 bundle
carried to a new encoder by a key map, each measurement in a fresh process.

    python benchmarks/upgrade_device.py --out OUT [--keys 10000] [--repeats 3] [--encoder cnn]
    python benchmarks/upgrade_device.py --smoke --out OUT     # tiny sizes: checks the pipeline

The encoders (seeds 0 and 1) are built with onnx.helper: two float MLPs (784 -> 128, tanh), or
with --encoder cnn two of fed_train's SmallCNN (the encoder `knnper train` gives images;
cnn-int8: quantized as `knnper export` ships it), on
28x28 grey images (random pixels: time and memory do not depend on the values); the bundle's
budget is the tightest the runtime's memory model gives it (encoder + the datastore's
estimate_nbytes), as benchmarks/runtime_memory.py sets it; the map is a least-squares one on
2,000 other images. Each child loads the bundle, upgrades it in place (load of the release,
the map applied in chunks, re-quantized, written, verified, swapped in, reloaded) and reports
the upgrade's wall time. Its RssAnon is sampled every millisecond by this process; the floor is
a child that loads a one-key bundle of the same encoder (the runtime and one session, no keys).

Targets (issue 39): under 1 s, and peak private memory above the floor within the bundle's
budget_bytes + 2 MiB. Outputs in OUT: upgrade.md (table, command, machine) and run.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edge_runtime._io import write_text_atomic
from edge_runtime.bundle import write_bundle
from edge_runtime.datastores import make_datastore
from edge_runtime.encoder import Encoder
from edge_runtime.keymap import FORMS, KeyMap
from edge_runtime.manifest import BundleFields
from edge_runtime.preprocess import InputSpec, prepare_input
from edge_runtime.versions import ModelVersion
from experiments.benchmark_support import machine_info, machine_line, run_sampled

REPO = Path(__file__).resolve().parents[1]
SPEC = {"kind": "image", "shape": [28, 28, 1], "dtype": "uint8", "mean": [0.5], "std": [0.25]}
DIM, CLASSES = 128, 10
MIB = 1 << 20

_CHILD = """
import json, sys, time
from edge_runtime.runtime import Runtime
rt = Runtime.load(sys.argv[1], intra_op_threads=1)
if len(sys.argv) > 2:
    start = time.perf_counter()
    report = rt.upgrade(sys.argv[2], key_map=sys.argv[3])
    print(json.dumps({"seconds": time.perf_counter() - start, "carried": report.carried,
                      "evicted": report.evicted}))
else:
    print(json.dumps({}))
"""


def mlp_encoder(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.05, (784, DIM)).astype(np.float32), "w1"),
        numpy_helper.from_array(np.zeros(DIM, np.float32), "b1"),
        numpy_helper.from_array(rng.normal(0, 0.3, (DIM, CLASSES)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Flatten", ["input"], ["flat"], axis=1),
        helper.make_node("MatMul", ["flat", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Tanh", ["hb"], ["embedding"]),
        helper.make_node("MatMul", ["embedding", "w2"], ["logits"]),
    ]
    return _save(nodes, inits, "mlp", path)


def _save(nodes: list, inits: list, name: str, path: Path) -> Path:
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, 28, 28])],
        [
            helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", DIM]),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def cnn_encoder(path: Path, seed: int, width: int = 16) -> Path:
    """fed_train.models.SmallCNN's graph for 28x28x1 (two 3x3 conv blocks, each ReLU and a 2x2
    max-pool, then a 128-wide hidden layer): the encoder `knnper train` gives image data."""
    rng = np.random.default_rng(seed)
    flat = 2 * width * 7 * 7
    arrays = {
        "c1": rng.normal(0, 0.3, (width, 1, 3, 3)),
        "k1": np.zeros(width),
        "c2": rng.normal(0, 0.1, (2 * width, width, 3, 3)),
        "k2": np.zeros(2 * width),
        "w1": rng.normal(0, 0.03, (flat, DIM)),
        "b1": np.zeros(DIM),
        "w2": rng.normal(0, 0.3, (DIM, CLASSES)),
    }
    inits = [numpy_helper.from_array(a.astype(np.float32), name) for name, a in arrays.items()]
    nodes = []
    for i, previous in ((1, "input"), (2, "p1")):
        nodes += [
            helper.make_node("Conv", [previous, f"c{i}", f"k{i}"], [f"v{i}"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", [f"v{i}"], [f"r{i}"]),
            helper.make_node("MaxPool", [f"r{i}"], [f"p{i}"], kernel_shape=[2, 2], strides=[2, 2]),
        ]
    nodes += [
        helper.make_node("Flatten", ["p2"], ["flat"], axis=1),
        helper.make_node("MatMul", ["flat", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["embedding"]),
        helper.make_node("MatMul", ["embedding", "w2"], ["logits"]),
    ]
    return _save(nodes, inits, "cnn", path)


def cnn_int8_encoder(path: Path, seed: int) -> Path:
    """The SmallCNN quantized as `knnper export` ships it (export.quantize: QDQ, int7 weights,
    the first layer and the head float), calibrated on 64 images."""
    from export.quantize import quantize_int8

    fp32 = cnn_encoder(path.with_suffix(".fp32.onnx"), seed)
    return quantize_int8(fp32, path, prepare_input(images(64, 50 + seed)[0], SPEC))


ENCODERS = {"mlp": mlp_encoder, "cnn": cnn_encoder, "cnn-int8": cnn_int8_encoder}


def images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, (n, 28, 28, 1), dtype=np.uint8),
        rng.integers(0, CLASSES, n).astype(np.int64),
    )


def bundle(out: Path, encoder: Path, n: int, seed: int) -> Path:
    x, y = images(n, seed)
    z, _ = Encoder(encoder).run(prepare_input(x, SPEC))
    ds = make_datastore(f"flat:int8:n{n}", CLASSES).fit(z, y)
    budget = encoder.stat().st_size + ds.estimate_nbytes(n, DIM)
    write_bundle(out, BundleFields(0, InputSpec(SPEC), 0.5, budget, "fifo"), encoder, ds)
    return out


def key_map(old: Path, new: Path, out: Path, form: str = "linear") -> Path:
    x, _ = images(2000, 99)
    xp = prepare_input(x, SPEC)
    z_old, z_new = Encoder(old).run(xp)[0], Encoder(new).run(xp)[0]
    a = np.hstack([z_old, np.ones((len(z_old), 1), np.float32)])
    coef = np.linalg.lstsq(a, z_new, rcond=None)[0].astype(np.float32)
    KeyMap(
        coef[:-1],
        coef[-1],
        ModelVersion.of_encoder(old.read_bytes()),
        ModelVersion.of_encoder(new.read_bytes()),
        "map the keys",
        dict.fromkeys(("mapped", "stale", "re-embedded", "global"), 0.0),
        form=form,
        extra=(
            {}
            if form == "linear"
            else {  # a correction per class: the arrays' size, not their values, is measured
                "class_weight": np.full((CLASSES, DIM, DIM), 1e-3, np.float32),
                "class_bias": np.zeros((CLASSES, DIM), np.float32),
            }
        ),
    ).save(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="results directory")
    p.add_argument("--keys", type=int, default=10_000, help="keys in the device's bundle")
    p.add_argument("--repeats", type=int, default=3, help="upgrades measured (fresh copies)")
    p.add_argument("--smoke", action="store_true", help="200 keys, one repeat")
    p.add_argument(
        "--form", choices=FORMS, default="linear", help="the key map's form (edge_runtime.keymap)"
    )
    p.add_argument(
        "--encoder", choices=sorted(ENCODERS), default="mlp", help="the two versions' encoders"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.keys, args.repeats = 200, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="knnper-upgrade-bench-") as tmp:
        work = Path(tmp)
        build = ENCODERS[args.encoder]
        old, new = build(work / "old.onnx", 0), build(work / "new.onnx", 1)
        pristine = bundle(work / "pristine", old, args.keys, 0)
        release = bundle(work / "release", new, 50, 1)
        floor_bundle = bundle(work / "floor", old, 1, 2)
        mapping = key_map(old, new, work / "map.npz", args.form)
        budget = json.loads((pristine / "manifest.json").read_text())["budget_bytes"]
        map_bytes = mapping.stat().st_size
        rows = []
        for _ in range(args.repeats):
            floor = run_sampled(_CHILD, [str(floor_bundle)], threads=1)["peak_private_kib"]
            device = work / "device"
            shutil.rmtree(device, ignore_errors=True)
            shutil.copytree(pristine, device)
            result = run_sampled(_CHILD, [str(device), str(release), str(mapping)], threads=1)
            rows.append(
                {
                    **result,
                    "floor_private_kib": floor,
                    "above_floor_mib": (result["peak_private_kib"] - floor) / 1024,
                }
            )
    seconds = statistics.median(r["seconds"] for r in rows)
    above = max(r["above_floor_mib"] for r in rows)
    limit = budget / MIB + 2
    summary = {
        "keys": args.keys,
        "form": args.form,
        "encoder": args.encoder,
        "map_bytes": map_bytes,
        "budget_bytes": budget,
        "median_seconds": seconds,
        "max_above_floor_mib": above,
        "memory_limit_mib": limit,
        "time_target_met": seconds < 1.0,
        "memory_target_met": above <= limit,
        "cpu": machine_line(machine_info()),
        "python": platform.python_version(),
        "runs": rows,
        "command": " ".join(["python", "benchmarks/upgrade_device.py", *(argv or sys.argv[1:])]),
    }
    write_text_atomic(out / "run.json", json.dumps(summary, indent=2) + "\n")
    table = [
        f"Upgrade of a {args.keys}-key flat:int8 bundle (dim {DIM}, {args.encoder} encoder) by "
        f"a {args.form} key map "
        f"({map_bytes} bytes), "
        f"{args.repeats} fresh processes; CPU: {summary['cpu']}.",
        "",
        "| median time | target | peak private above floor | budget + 2 MiB |",
        "|---|---|---|---|",
        f"| {seconds:.3f} s | < 1 s ({'met' if seconds < 1 else 'missed'}) | "
        f"{above:.2f} MiB | {limit:.2f} MiB ({'met' if above <= limit else 'missed'}) |",
        "",
        f"Command: `{summary['command']}`",
        "",
    ]
    write_text_atomic(out / "upgrade.md", "\n".join(table))
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
