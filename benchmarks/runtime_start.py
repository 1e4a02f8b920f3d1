"""Process start to first prediction, and batch-1 latency against the encoder alone.

    python benchmarks/runtime_start.py --out OUT [--run RUN] [--starts 15] [--reps 1000]

Bundles: the small CNN as an int8 ONNX encoder (the exporter's), a flat datastore of its
embeddings of Fashion-MNIST images (copies plus noise past the real images).
- Start: a fresh `python -c` process imports edge_runtime, loads the bundle (verifying every
  file) and predicts one image; the time from spawning it to its first prediction (wall clock,
  median of --starts processes), with the child's own split into imports, load and first call.
  Two encoders: saved optimized by onnxruntime as export writes it (session created with
  optimization off) and the same encoder not optimized (optimized at every load).
- Batch 1: in one process, Runtime.predict_proba on one image against the encoder alone
  (Runtime.embed: input checks, normalisation and the ONNX session), interleaved call by call;
  target: end to end within 1.5x of the encoder alone at 1k keys.
Outputs in OUT: start.csv, batch1.csv, start.md, start_run.json.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edge_runtime.portable import build_portable
from edge_runtime.preprocess import prepare_input
from edge_runtime.runtime import Runtime
from experiments import benchmark_support as C

log = logging.getLogger("benchmarks.start")

CHILD = """
import time, sys
start = time.time()
import numpy as np
from edge_runtime.runtime import Runtime
imported = time.time()
rt = Runtime.load(sys.argv[1])
loaded = time.time()
rt.predict_proba(np.load(sys.argv[2], allow_pickle=False))
done = time.time()
print(f'{{"start": {start}, "imported": {imported}, "loaded": {loaded}, "done": {done}}}')
"""

# each table's CSV columns and markdown table, one declaration: (key, header, format)
START_TABLE = [
    ("encoder", "bundle encoder", ""),
    ("runs", "processes", ""),
    ("spawn_to_first_ms", "spawn to first prediction ms", ".1f"),
    ("interpreter_ms", "interpreter start ms", ".1f"),
    ("imports_ms", "imports ms", ".1f"),
    ("load_ms", "Runtime.load ms", ".1f"),
    ("first_predict_ms", "first call ms", ".1f"),
]
B1_TABLE = [
    ("recipe", "recipe", ""),
    ("keys", "keys", ","),
    ("encoder_ms", "encoder alone p50 ms", ".3f"),
    ("end_to_end_ms", "end to end p50 ms", ".3f"),
    ("ratio", "end to end / encoder", ".2f"),
    ("within_1_5", "<= 1.5x", ""),
    ("within_1_15", "<= 1.15x", ""),
    ("numpy_head_ms", "encoder + numpy head p50 ms", ".3f"),
    ("numpy_head_ratio", "numpy head / encoder", ".2f"),
    ("portable_ms", "portable predictor p50 ms", ".3f"),
    ("portable_ratio", "portable / encoder", ".2f"),
]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = C.device_parser(__doc__)
    p.add_argument("--starts", type=C.positive_int, default=15, help="processes per encoder")
    p.add_argument("--reps", type=C.positive_int, default=1000, help="timed batch-1 calls")
    p.add_argument("--recipes", nargs="+", default=["flat:fp32", "flat:int8"])
    p.add_argument("--sizes", type=C.positive_int, nargs="+", default=[1000, 10_000])
    args = p.parse_args(argv)
    if args.smoke:
        args.starts, args.reps, args.sizes = 2, 20, [200]
    return args


def spawn_to_first(bundle: Path, image: Path, starts: int) -> dict[str, float]:
    runs = []
    for _ in range(starts):
        spawned = time.time()
        t = C.run_child(CHILD, [str(bundle), str(image)], threads=1, timeout=120)
        runs.append(
            {
                "spawn_to_first_ms": t["done"] - spawned,
                "interpreter_ms": t["start"] - spawned,
                "imports_ms": t["imported"] - t["start"],
                "load_ms": t["loaded"] - t["imported"],
                "first_predict_ms": t["done"] - t["loaded"],
            }
        )
    return {key: 1e3 * float(np.median([r[key] for r in runs])) for key in runs[0]}


def batch1(rt: Runtime, images: np.ndarray, reps: int) -> dict[str, float]:
    """Median seconds per call of the encoder alone, the runtime end to end and the portable
    predictor (the same prediction as one onnxruntime session), interleaved."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    portable = ort.InferenceSession(build_portable(rt), options, providers=["CPUExecutionProvider"])
    paths = {
        "encoder": rt.embed,
        "end_to_end": rt.predict_proba,
        "numpy_head": lambda x: rt.posterior(*rt.embed(x)),
        "portable": lambda x: portable.run(["probabilities"], {"input": x}),
    }
    return C.interleaved_medians(paths, images, reps, warmup=20)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started, machine, gm, pool = C.start_device_benchmark(
        args, threads=1, queries=200, smoke_train=2000
    )
    spec, num_classes = gm.spec, gm.num_classes
    pool_idx, z_pool, y_pool = pool.pool_idx, pool.z, pool.y
    singles = [pool.queries[i : i + 1] for i in range(len(pool.queries))]
    starts, b1 = [], []
    with tempfile.TemporaryDirectory(prefix="knnper-start-", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        calib = prepare_input(C.images(gm.dataset, pool_idx[:256]), spec)
        plain = C.export_encoder(gm.model, calib, work / "encoder")
        optimized = C.shipped_encoder(plain)
        image = work / "image.npy"
        np.save(image, pool.queries[:1], allow_pickle=False)
        z, y = C.replicate_keys(z_pool, y_pool, min(args.sizes), noise=0.01, seed=args.seed)
        first = C.build_datastore(args.recipes[0], z, y, num_classes, seed=args.seed)
        for name, encoder in (("optimized at export", optimized), ("not optimized", plain)):
            C.write_benchmark_bundle(work / name, encoder, first, spec)
            starts.append(
                {
                    "encoder": name,
                    "runs": args.starts,
                    **spawn_to_first(work / name, image, args.starts),
                }
            )
            log.info("%s: %.1f ms spawn to first prediction", name, starts[-1]["spawn_to_first_ms"])
        for size in args.sizes:
            z, y = C.replicate_keys(z_pool, y_pool, size, noise=0.01, seed=args.seed)
            for recipe in args.recipes:
                ds = C.build_datastore(recipe, z, y, num_classes, seed=args.seed)
                path = work / f"b1-{size}-{recipe.replace(':', '_')}"
                C.write_benchmark_bundle(path, optimized, ds, spec)
                t = batch1(Runtime.load(path), singles, args.reps)
                enc, e2e = t["encoder"], t["end_to_end"]
                b1.append(
                    {
                        "recipe": recipe,
                        "keys": size,
                        "encoder_ms": 1e3 * enc,
                        "end_to_end_ms": 1e3 * e2e,
                        "ratio": e2e / enc,
                        "within_1_5": "yes" if e2e <= 1.5 * enc else "no",
                        "within_1_15": "yes" if e2e <= 1.15 * enc else "no",
                        "numpy_head_ms": 1e3 * t["numpy_head"],
                        "numpy_head_ratio": t["numpy_head"] / enc,
                        "portable_ms": 1e3 * t["portable"],
                        "portable_ratio": t["portable"] / enc,
                    }
                )
                log.info(
                    "%s x %d: encoder %.3f ms, end to end %.3f ms",
                    recipe,
                    size,
                    b1[-1]["encoder_ms"],
                    b1[-1]["end_to_end_ms"],
                )
    machine_end = C.machine_info()
    text = report(starts, b1, args, gm.source, machine, machine_end, time.time() - started)
    C.write_results(
        args,
        started,
        text,
        report="start.md",
        record="start_run.json",
        tables={"start.csv": (starts, START_TABLE), "batch1.csv": (b1, B1_TABLE)},
        machine=machine,
        machine_end=machine_end,
        weights=gm.source,
    )
    return 0


def report(
    starts: list[dict],
    b1: list[dict],
    args: argparse.Namespace,
    weights: str,
    machine: dict,
    machine_end: dict,
    seconds: float,
) -> str:
    return C.report_text(
        C.report_head(
            "Edge runtime: process start to first prediction, batch-1 latency vs the encoder",
            machine,
            machine_end,
            "One thread for onnxruntime and BLAS. "
            f"Took {seconds:.0f} s. Weights: {weights}; int8 ONNX encoder.",
        ),
        f"Start: medians over {args.starts} fresh processes per encoder, each loading a "
        f"{args.recipes[0]} bundle of {min(args.sizes):,} keys and predicting one image.",
        C.markdown_table(starts, START_TABLE),
        f"Batch 1: medians of {args.reps} interleaved calls; encoder alone = Runtime.embed "
        "(input checks, normalisation, ONNX session); end to end = Runtime.predict_proba (one "
        "onnxruntime session for flat fp32 / int8); numpy head = the encoder then the numpy "
        "kNN head (the reference path, used for HNSW and fp16); "
        "portable predictor = the same prediction as one onnxruntime session "
        "(knnper-edge export-onnx, keys baked in, raw uint8 input).",
        C.markdown_table(b1, B1_TABLE),
    )


if __name__ == "__main__":
    sys.exit(main())
