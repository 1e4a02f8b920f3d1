"""int8 keys baked into the predictor session as constants (packed once by onnxruntime) against
the same keys fed as inputs (repacked on every call): `Runtime.predict_proba` of one int8 bundle
loaded both ways (predictor.BAKED_KEY_BYTES at its value, then 0), and the encoder alone as
runtime_latency.py times it, interleaved call by call in one process; both runtimes'
probabilities compared bit for bit on a batch of 64. Then what baking costs `add` (a new
session for the samples it commits): 20 adds of one labelled image to a copy of the bundle,
each way, alternating.

    python benchmarks/runtime_latency.py --out OUT --sizes 1000 --recipes flat:int8 \
        --reps 10 --warmup 5 --batch-reps 1 --threads 1 --keep-bundles
    python benchmarks/results/runtime/last_mib/baked/baked.py OUT/bundles/flat-1000
"""

import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, ".")
from edge_runtime import predictor
from edge_runtime.runtime import Runtime
from experiments.benchmark_support import (
    encoder_alone,
    interleaved_medians,
    machine_info,
    machine_line,
)

bundle = sys.argv[1]
baked = Runtime.load(bundle, intra_op_threads=1)
limit, predictor.BAKED_KEY_BYTES = predictor.BAKED_KEY_BYTES, 0
fed = Runtime.load(bundle, intra_op_threads=1)
predictor.BAKED_KEY_BYTES = limit
spec = baked.manifest.input
paths = {
    "baked": baked.predict_proba,
    "fed": fed.predict_proba,
    "encoder alone": encoder_alone(f"{bundle}/encoder.onnx", spec, 1),
}
rng = np.random.default_rng(0)
batch = rng.integers(0, 256, (64, *spec.shape), dtype=np.uint8)
same = np.array_equal(baked.predict_proba(batch), fed.predict_proba(batch))
print(machine_line(machine_info()))
print(f"{len(baked.datastore)} int8 keys, {baked.datastore.keys_t_.nbytes} bytes; medians of 2,700")
print(f"inputs of the baked session: {[i.name for i in baked.predictor.session.get_inputs()]}")
print(f"probabilities baked and fed on 64 inputs identical bit for bit: {same}")
inputs = [rng.integers(0, 256, (1, *spec.shape), dtype=np.uint8) for _ in range(200)]
for round_ in range(4):
    med = {name: 1e6 * t for name, t in interleaved_medians(paths, inputs, 2700, 300).items()}
    alone_us = med["encoder alone"]
    print(
        f"round {round_ + 1}: "
        + ", ".join(f"{n} {v:.1f} us ({v / alone_us:.3f}x)" for n, v in med.items())
    )
with tempfile.TemporaryDirectory(prefix="knnper-") as tmp:
    runtimes = {}
    for name, limit_bytes in (("baked", limit), ("fed", 0)):
        predictor.BAKED_KEY_BYTES = limit_bytes
        runtimes[name] = Runtime.load(shutil.copytree(bundle, f"{tmp}/{name}"))
    predictor.BAKED_KEY_BYTES = limit
    adds = {name: [] for name in runtimes}
    for r in range(20):
        for name, rt in runtimes.items():
            t0 = time.perf_counter()
            rt.add(inputs[r], np.array([r % rt.num_classes]), strategy="concatenate")
            adds[name].append(time.perf_counter() - t0)
    print(
        "add of one image, median of 20: "
        + ", ".join(f"{n} {1e3 * np.median(t):.1f} ms" for n, t in adds.items())
        + f"; the baked runtime still baked: {runtimes['baked'].predictor.baked}"
    )
print("load", open("/proc/loadavg").read().split()[:3])
