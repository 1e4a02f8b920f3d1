"""Where the int8 head's batch-1 time goes: the predictor session of one int8 bundle against the
same graph over its keys widened to float32, and against the int8 graph with the query's
quantisation left out (a Relu in its place: wrong products, timing only), interleaved call by
call in one process, plus the encoder alone (numpy normalisation + the encoder's own session),
as runtime_latency.py times it. It ran at a53d800 and patches that commit's graph
(`_quantised_query`, which quantize_linear.py's commit replaced): rerun it there.

    python benchmarks/runtime_latency.py --out OUT --sizes 1000 --recipes flat:int8 \
        --reps 10 --warmup 5 --batch-reps 1 --threads 1 --keep-bundles
    python benchmarks/results/runtime/last_mib/int8_head/attribution.py OUT/bundles/flat-1000
"""

import gc
import sys
import time

import numpy as np
import onnxruntime as ort

sys.path.insert(0, ".")
from edge_runtime import predictor_graph
from edge_runtime.datastores.flat import FlatDatastore
from edge_runtime.encoder import Encoder, open_session, session_options
from edge_runtime.knn import softmax
from edge_runtime.preprocess import prepare_input
from edge_runtime.runtime import Runtime
from experiments.benchmark_support import machine_info, machine_line

bundle = sys.argv[1]
rt = Runtime.load(bundle, intra_op_threads=1)
ds, manifest = rt.datastore, rt.manifest
encoder = open(f"{bundle}/encoder.onnx", "rb").read()
widened = FlatDatastore(manifest.num_classes, k=ds.k, sigma=ds.sigma, dtype="fp32")
widened.fit(ds.keys(), ds.labels_.astype(np.int64))


def session(store):
    model = predictor_graph.build_predictor(
        manifest, store, encoder, samples="stored", probabilities="float64"
    )
    level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    run = open_session(model, session_options(1, level), "predictor").run
    feeds = store.graph_feeds()

    def call(x):
        feeds["input"] = x
        return run(["probabilities"], feeds)

    return call


paths = {"int8 head": session(ds), "float32 head": session(widened)}
quantised = predictor_graph._quantised_query
predictor_graph._quantised_query = lambda g, q, scale: (g.node("Relu", [q]), g.const([[1.0]]))
paths["int8 head, query not quantised"] = session(ds)
predictor_graph._quantised_query = quantised
alone = Encoder(f"{bundle}/encoder.onnx", intra_op_threads=1)
spec = manifest.input
paths["encoder alone"] = lambda x: softmax(alone.run(prepare_input(x, spec))[1])
rng = np.random.default_rng(0)
inputs = [rng.integers(0, 256, (1, *spec.shape), dtype=np.uint8) for _ in range(200)]
print(machine_line(machine_info()))
print(f"{len(ds)} int8 keys of dimension {ds.embedding_dim_}; medians of 2,700 calls per round")
gc.disable()
for round_ in range(4):
    times = {name: [] for name in paths}
    for r in range(3000):
        order = list(paths) if r % 2 else list(paths)[::-1]
        for name in order:
            t0 = time.perf_counter()
            paths[name](inputs[r % 200])
            times[name].append(time.perf_counter() - t0)
    med = {name: 1e6 * np.median(t[300:]) for name, t in times.items()}
    base = med["float32 head"]
    print(
        f"round {round_ + 1}: float32 head {base:.1f} us, encoder alone {med['encoder alone']:.1f}"
        " us; over the float32 head: "
        + ", ".join(f"{n} {v - base:+.1f} us" for n, v in med.items() if "int8" in n)
    )
print("load", open("/proc/loadavg").read().split()[:3])
