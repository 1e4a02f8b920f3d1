"""The int8 head's query rounded, shifted and cast by one QuantizeLinear (the graph since this
script's commit) against Round, Add and Cast (the graph before it): the predictor session of
one int8 bundle in both forms, the same graph over its keys widened to float32, and the encoder
alone as runtime_latency.py times it, interleaved call by call in one process; both forms'
probabilities compared bit for bit on a batch of 64.

    python benchmarks/runtime_latency.py --out OUT --sizes 1000 --recipes flat:int8 \
        --reps 10 --warmup 5 --batch-reps 1 --threads 1 --keep-bundles
    python benchmarks/results/runtime/last_mib/int8_head/quantize_linear.py OUT/bundles/flat-1000
"""

import sys

import numpy as np

sys.path.insert(0, ".")
from edge_runtime import onnx_proto as P
from edge_runtime import predictor_graph as pg
from edge_runtime.datastores.flat import FlatDatastore
from edge_runtime.encoder import RUNTIME_LEVEL, open_session, session_options
from edge_runtime.knn import QUERY_SHIFT
from edge_runtime.runtime import Runtime
from experiments.benchmark_support import (
    encoder_alone,
    interleaved_medians,
    machine_info,
    machine_line,
)

bundle = sys.argv[1]
rt = Runtime.load(bundle, intra_op_threads=1)
ds, manifest = rt.datastore, rt.manifest
encoder = open(f"{bundle}/encoder.onnx", "rb").read()
widened = FlatDatastore(manifest.num_classes, k=ds.k, sigma=ds.sigma, dtype="fp32")
widened.fit(ds.keys(), ds.labels_.astype(np.int64))


def session(store):
    model = pg.build_predictor(manifest, store, encoder, samples="stored", probabilities="float64")
    run = open_session(model, session_options(1, RUNTIME_LEVEL), "predictor").run
    feeds = store.graph_feeds()

    def call(x):
        feeds["input"] = x
        return run(["probabilities"], feeds)[0]

    return call


def round_add_cast(g, q, keys_t, key_offsets, scale):
    """The int8 products as the graph built them before: Round, Add, Cast to uint8."""
    ratio, s = pg._query_over_scale(g, q, scale)
    rounded = g.node("Round", [ratio])
    shifted = g.cast(g.node("Add", [rounded, g.const(float(QUERY_SHIFT))]), P.UINT8)
    exact = g.node("Sub", [g.node("MatMulInteger", [shifted, keys_t]), key_offsets])
    return g.node("Mul", [g.cast(exact, P.FLOAT), g.node("Mul", [s, g.const(-2.0)])])


paths = {"QuantizeLinear": session(ds)}
quantize_linear = pg._int8_products
pg._int8_products = round_add_cast
paths["Round, Add, Cast"] = session(ds)
pg._int8_products = quantize_linear
paths["float32 head"] = session(widened)
spec = manifest.input
paths["encoder alone"] = encoder_alone(f"{bundle}/encoder.onnx", spec, 1)
rng = np.random.default_rng(0)
batch = rng.integers(0, 256, (64, *spec.shape), dtype=np.uint8)
same = np.array_equal(paths["QuantizeLinear"](batch), paths["Round, Add, Cast"](batch))
print(machine_line(machine_info()))
print(f"{len(ds)} int8 keys of dimension {ds.embedding_dim_}; medians of 2,700 calls per round")
print(f"probabilities of both int8 forms on 64 inputs identical bit for bit: {same}")
inputs = [rng.integers(0, 256, (1, *spec.shape), dtype=np.uint8) for _ in range(200)]
for round_ in range(4):
    med = {name: 1e6 * t for name, t in interleaved_medians(paths, inputs, 2700, 300).items()}
    alone_us = med["encoder alone"]
    print(
        f"round {round_ + 1}: "
        + ", ".join(
            f"{n} {v:.1f} us ({v / alone_us:.3f}x the encoder alone)" for n, v in med.items()
        )
    )
print("load", open("/proc/loadavg").read().split()[:3])
