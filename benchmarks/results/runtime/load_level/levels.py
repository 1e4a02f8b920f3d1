"""The shipped encoder (saved by `optimize_encoder`, as `knnper export` writes it) at batch 1:
loaded as saved (graph optimization off, the device's encoder session until 29 November) against
loaded at ORT_ENABLE_ALL (edge_runtime.encoder.RUNTIME_LEVEL, now), with the encoder before
optimization at ORT_ENABLE_ALL beside them; and the whole predictor over the bundle's 1,000
keys at ORT_ENABLE_BASIC (until now, for an encoder saved optimized) against ORT_ENABLE_ALL.
Interleaved call by call in one process; outputs compared bit for bit; session creation timed.

    python benchmarks/runtime_latency.py --out OUT --sizes 1000 --recipes flat:int8 \
        --reps 10 --warmup 5 --batch-reps 1 --threads 1 --keep-bundles [--encoder fp32]
    python benchmarks/results/runtime/load_level/levels.py OUT/bundles/flat-1000
"""

import gc
import sys
import time

import numpy as np
import onnxruntime as ort

sys.path.insert(0, ".")
from edge_runtime.encoder import open_session, optimize_encoder, session_options
from edge_runtime.predictor_graph import build_predictor
from edge_runtime.preprocess import prepare_input
from edge_runtime.runtime import Runtime
from experiments.benchmark_support import machine_info, machine_line

L = ort.GraphOptimizationLevel
bundle = sys.argv[1]
rt = Runtime.load(bundle, intra_op_threads=1)
plain = open(f"{bundle}/encoder.onnx", "rb").read()
shipped = optimize_encoder(plain)
spec = rt.manifest.input
rng = np.random.default_rng(0)
raw = [rng.integers(0, 256, (1, *spec.shape), dtype=np.uint8) for _ in range(200)]
prepared = [prepare_input(x, spec) for x in raw]


def encoder_session(model, level):
    session = open_session(model, session_options(1, level), "the encoder")
    name = session.get_inputs()[0].name
    return lambda i: session.run(None, {name: prepared[i]})


def predictor_session(level):
    graph = build_predictor(
        rt.manifest, rt.datastore, shipped, samples="stored", probabilities="float64"
    )
    run = open_session(graph, session_options(1, level), "the predictor").run
    feeds = rt.datastore.graph_feeds()

    def call(i):
        feeds["input"] = raw[i]
        return run(["probabilities", "embedding"], feeds)

    return call


paths = {
    "shipped encoder as saved": encoder_session(shipped, L.ORT_DISABLE_ALL),
    "shipped encoder at ALL": encoder_session(shipped, L.ORT_ENABLE_ALL),
    "encoder before optimization at ALL": encoder_session(plain, L.ORT_ENABLE_ALL),
    "predictor at BASIC": predictor_session(L.ORT_ENABLE_BASIC),
    "predictor at ALL": predictor_session(L.ORT_ENABLE_ALL),
}
print(machine_line(machine_info()))
print(f"encoder {rt.manifest.input.shape} -> {rt.manifest.embedding_dim}, {len(rt.datastore)} keys")
for a, b in (
    ("shipped encoder as saved", "shipped encoder at ALL"),
    ("shipped encoder as saved", "encoder before optimization at ALL"),
    ("predictor at BASIC", "predictor at ALL"),
):
    pairs = [(u, v) for i in range(200) for u, v in zip(paths[a](i), paths[b](i), strict=True)]
    same = all(np.array_equal(u, v) for u, v in pairs)
    most = max(float(np.abs(u.astype(np.float64) - v).max()) for u, v in pairs)
    print(f"{a} vs {b}: outputs identical on 200 inputs: {same} (max |difference| {most:.3g})")
for level in ("DISABLE_ALL", "ENABLE_BASIC", "ENABLE_ALL"):
    t0 = time.perf_counter()
    for _ in range(20):
        open_session(shipped, session_options(1, getattr(L, f"ORT_{level}")), "the encoder")
    print(f"shipped encoder session created at {level}: {(time.perf_counter() - t0) * 50:.2f} ms")
gc.disable()
for round_ in range(3):
    times = {name: [] for name in paths}
    for r in range(2000):
        for name in list(paths) if r % 2 else list(paths)[::-1]:
            t0 = time.perf_counter()
            paths[name](r % 200)
            times[name].append(time.perf_counter() - t0)
    med = {name: 1e6 * np.median(t[200:]) for name, t in times.items()}
    print(f"round {round_ + 1} (us): " + ", ".join(f"{n} {v:.1f}" for n, v in med.items()))
print("load", open("/proc/loadavg").read().split()[:3])
