"""Latency and throughput of the on-device personalized prediction: edge_runtime's
Runtime (ONNX encoder + datastore kNN + interpolation) against the same prediction made with the
float32 torch model, for flat, hnsw and protonn datastores of 1k, 10k and 100k keys.

    python benchmarks/runtime_latency.py --out OUT [--run RUN] [--threads 1]
    python benchmarks/runtime_latency.py --smoke --out OUT        # tiny sizes: checks the pipeline

Per datastore recipe and size, one bundle is written with edge_runtime.bundle.write_bundle (an
int8 QDQ encoder from export.onnx_export + export.quantize by default) and loaded with
Runtime.load. Two paths answer the same raw uint8 images:
- runtime: Runtime.predict_proba(x): input checks and normalisation, the ONNX encoder, the
  datastore's local posterior, softmax, interpolation with the bundle's lambda.
- torch: the same prepare_input, the float32 torch model's embed + head, then the very same
  datastore object's predict_proba, softmax and interpolate (the numpy kNN code is shared, so
  the ratio is what the ONNX encoder and the runtime's own overheads give).
A row with backend "none" times the encoders alone (the ONNX encoder's own session on
prepare_input's output + softmax, against torch embed + head + softmax): the global model,
lambda = 0. Each datastore row also times that encoder alone in the same loop as its runtime
(b1_over_encoder: runtime p50 / encoder-alone p50, both from one loop, so a change of load
between rows does not move it; target 1.15x at 1k keys, issue 49).

Timing: time.perf_counter around each call, after warm-up calls, with the garbage collector off;
the two paths alternate call by call (and which goes first alternates), so a change of load on
the machine hits both alike. Batch 1: p50 and p99 over --reps calls, each on a different held-out
test image. Batch 256: throughput = 256 / median time of --batch-reps calls. onnxruntime, torch,
numpy's BLAS and hnswlib all get --threads threads.

Keys: embeddings of Fashion-MNIST training (and test) images by the torch model; the images
used as queries are held out. Past the 70k images minus the queries, keys are copies plus
Gaussian noise (--noise times each dimension's std), so "100k keys" are 100k distinct vectors
that look like embeddings. Without --run the weights are random: latency does not depend on
the weight values (nor on ProtoNN's, which is trained for only --protonn-steps steps here).

Outputs in OUT: latency.csv, latency.md (the table, command line, machine), run.json.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime.knn import softmax
from edge_runtime.preprocess import prepare_input
from edge_runtime.runtime import Runtime
from experiments import benchmark_support as C

log = logging.getLogger("benchmarks.latency")

COLUMNS = (
    "backend recipe keys stored encoder threads b1_p50_ms_runtime b1_p99_ms_runtime "
    "b1_p50_ms_torch b1_p99_ms_torch speedup_b1_p50 speedup_b1_p99 b1_p50_ms_encoder "
    "b1_over_encoder b256_ms_runtime b256_ms_torch throughput_runtime throughput_torch "
    "speedup_throughput argmax_agreement accuracy_runtime accuracy_torch encoder_bytes "
    "datastore_bytes reps batch_reps"
).split()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = C.datastore_sizes_parser(
        __doc__, "tiny settings (200 keys, few calls) to check the pipeline end to end"
    )
    p.add_argument(
        "--threads",
        type=C.positive_int,
        default=1,
        help="threads for onnxruntime, torch, BLAS and hnswlib alike",
    )
    p.add_argument("--reps", type=C.positive_int, default=1000, help="timed batch-1 calls")
    p.add_argument("--warmup", type=C.positive_int, default=50, help="untimed batch-1 calls")
    p.add_argument("--batch", type=C.positive_int, default=256, help="throughput batch size")
    p.add_argument("--batch-reps", type=C.positive_int, default=20, help="timed batch calls")
    p.add_argument(
        "--queries",
        type=C.positive_int,
        default=1000,
        help="held-out test images used as queries (never stored as keys)",
    )
    p.add_argument("--lam", type=float, default=0.5, help="the bundles' lambda")
    p.add_argument(
        "--keep-bundles",
        action="store_true",
        help="keep the bundles in OUT/bundles (default: a temporary directory)",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.sizes, args.reps, args.warmup, args.batch_reps = [200], 10, 2, 2
        args.queries, args.protonn_steps = min(args.queries, args.batch), 5
    if args.queries < args.batch:
        p.error(f"--queries ({args.queries}) must be at least --batch ({args.batch})")
    return args


def measure(
    runtime_fn: Callable,
    torch_fn: Callable,
    queries: np.ndarray,
    args: argparse.Namespace,
    encoder_fn: Callable | None = None,
) -> dict[str, float]:
    """Batch-1 percentiles and batch throughput of both paths; with `encoder_fn` (the
    encoder alone) also timed in the batch-1 loop, the runtime's p50 over its p50."""
    paths = {"runtime": runtime_fn, "torch": torch_fn}
    singles = [queries[i : i + 1] for i in range(len(queries))]
    with_encoder = paths if encoder_fn is None else {**paths, "encoder": encoder_fn}
    b1 = C.interleaved_times(with_encoder, singles, args.reps, args.warmup)
    batches = [
        queries[s : s + args.batch] for s in range(0, len(queries) - args.batch + 1, args.batch)
    ]
    bb = C.interleaved_times(paths, batches, args.batch_reps, min(args.warmup, 3))
    row: dict[str, float] = {}
    for name in paths:
        row[f"b1_p50_ms_{name}"] = 1e3 * float(np.percentile(b1[name], 50))
        row[f"b1_p99_ms_{name}"] = 1e3 * float(np.percentile(b1[name], 99))
        median = float(np.median(bb[name]))
        row[f"b{args.batch}_ms_{name}"] = 1e3 * median
        row[f"throughput_{name}"] = args.batch / median
    row["speedup_b1_p50"] = row["b1_p50_ms_torch"] / row["b1_p50_ms_runtime"]
    row["speedup_b1_p99"] = row["b1_p99_ms_torch"] / row["b1_p99_ms_runtime"]
    row["speedup_throughput"] = row["throughput_runtime"] / row["throughput_torch"]
    if encoder_fn is not None:
        row["b1_p50_ms_encoder"] = 1e3 * float(np.percentile(b1["encoder"], 50))
        row["b1_over_encoder"] = row["b1_p50_ms_runtime"] / row["b1_p50_ms_encoder"]
    return row


def agreement(
    runtime_fn: Callable, torch_fn: Callable, queries: np.ndarray, y: np.ndarray, batch: int
) -> dict[str, float]:
    a = np.concatenate(
        [runtime_fn(queries[s : s + batch]).argmax(1) for s in range(0, len(queries), batch)]
    )
    b = np.concatenate(
        [torch_fn(queries[s : s + batch]).argmax(1) for s in range(0, len(queries), batch)]
    )
    return {
        "argmax_agreement": float(np.mean(a == b)),
        "accuracy_runtime": float(np.mean(a == y)),
        "accuracy_torch": float(np.mean(b == y)),
    }


def timed_row(
    paths: tuple[Callable, Callable],
    pool: Any,
    args: argparse.Namespace,
    encoder_fn: Callable | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """One table row: `fields`, then both paths (runtime, torch) timed (measure, with
    `encoder_fn` in the batch-1 loop) and compared (agreement) on the pool's held-out queries."""
    runtime_fn, torch_fn = paths
    row = {**fields, **measure(runtime_fn, torch_fn, pool.queries, args, encoder_fn)}
    row.update(agreement(runtime_fn, torch_fn, pool.queries, pool.query_labels, args.batch))
    log.info("%s", _summary(row))
    return row


def bundle_row(
    recipe: str,
    keys: tuple[np.ndarray, np.ndarray],
    encoder: Path,
    bundles: Path,
    gm: Any,
    fns: tuple[Callable, Callable],
    pool: Any,
    args: argparse.Namespace,
    base: dict[str, Any],
) -> dict[str, Any]:
    """A bundle of `recipe` over `keys` (embeddings, labels), loaded by Runtime and timed
    against the torch path through the same datastore; `fns`: the torch model's (embeddings,
    logits) and the encoder alone, timed in the same batch-1 loop."""
    (z, y), (torch_logits, encoder_fn) = keys, fns
    backend = C.recipe_label(recipe)
    log.info("building %s with %d keys", recipe, len(z))
    t0 = time.perf_counter()
    ds = C.build_datastore(
        recipe, z, y, gm.num_classes, seed=args.seed, protonn_steps=args.protonn_steps
    )
    path = bundles / f"{backend}-{len(z)}"
    manifest = C.write_benchmark_bundle(path, encoder, ds, gm.spec, lam=args.lam)
    rt = Runtime.load(path, intra_op_threads=args.threads)
    if backend == "hnsw":
        rt.datastore.num_threads = args.threads
    log.info("built and loaded in %.1f s; timing", time.perf_counter() - t0)

    def torch_path(x: np.ndarray) -> np.ndarray:
        zq, logits = torch_logits(x)
        return rt.head.predict_proba(zq, softmax(logits))

    row = timed_row(
        (rt.predict_proba, torch_path),
        pool,
        args,
        encoder_fn,
        backend=backend,
        recipe=manifest.recipe,
        keys=len(z),
        stored=len(rt.datastore),
        datastore_bytes=manifest.footprint.datastore,
        **base,
    )
    if not args.keep_bundles:
        shutil.rmtree(path, ignore_errors=True)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # the thread count for torch, BLAS and OpenMP; onnxruntime and hnswlib get it below
    started, machine_start, gm, pool = C.start_device_benchmark(
        args, threads=args.threads, queries=args.queries, smoke_train=1000
    )
    import torch  # after argparse, so --help is instant

    spec, model = gm.spec, gm.model
    work = Path(tempfile.mkdtemp(prefix="knnper-latency-"))
    bundles = args.out / "bundles" if args.keep_bundles else work / "bundles"
    rows: list[dict[str, Any]] = []
    try:
        calib = prepare_input(
            C.images(gm.dataset, pool.pool_idx[: 64 if args.smoke else 256]), spec
        )
        encoder = C.shipped_encoder(
            C.export_encoder(model, calib, work / "encoder", encoder=args.encoder)
        )

        def torch_logits(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            with torch.inference_mode():
                z = model.embed(torch.from_numpy(prepare_input(x, spec)))
                return z.numpy(), model.head(z).numpy()

        base = {
            "encoder": args.encoder,
            "threads": args.threads,
            "reps": args.reps,
            "batch_reps": args.batch_reps,
            "encoder_bytes": encoder.stat().st_size,
        }
        rt_global = C.encoder_alone(encoder, spec, args.threads)

        def torch_global(x: np.ndarray) -> np.ndarray:
            return softmax(torch_logits(x)[1])

        log.info("timing the encoders alone")
        alone = {"backend": "none", "recipe": "encoder only (lambda=0)", "keys": 0, "stored": 0}
        paths = (rt_global, torch_global)
        rows.append(timed_row(paths, pool, args, None, **alone, datastore_bytes=0, **base))
        for size in args.sizes:
            keys = C.replicate_keys(pool.z, pool.y, size, noise=args.noise, seed=args.seed)
            for recipe in args.recipes:
                fns = (torch_logits, rt_global)
                rows.append(bundle_row(recipe, keys, encoder, bundles, gm, fns, pool, args, base))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    machine_end = C.machine_info()
    columns = [c.replace("b256", f"b{args.batch}") for c in COLUMNS]
    text = report(rows, args, gm.source, machine_start, machine_end, time.time() - started)
    C.write_results(
        args,
        started,
        text,
        report="latency.md",
        record="run.json",
        tables={"latency.csv": (rows, columns)},
        machine_start=machine_start,
        machine_end=machine_end,
        weights=gm.source,
    )
    return 0


def _summary(row: dict[str, Any]) -> str:
    return (
        f"{row['recipe']} x {row['keys']}: batch-1 p50 {row['b1_p50_ms_runtime']:.3f} ms vs "
        f"torch {row['b1_p50_ms_torch']:.3f} ms ({row['speedup_b1_p50']:.2f}x), throughput "
        f"{row['throughput_runtime']:.0f}/s vs {row['throughput_torch']:.0f}/s"
    )


def report(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    weights: str,
    machine_start: dict,
    machine_end: dict,
    seconds: float,
) -> str:
    b = args.batch
    table = C.markdown_table(
        rows,
        [
            ("backend", "backend", ""),
            ("recipe", "recipe", ""),
            ("keys", "keys", ","),
            ("b1_p50_ms_runtime", "b1 p50 ms runtime", ".3f"),
            ("b1_p50_ms_torch", "b1 p50 ms torch", ".3f"),
            ("speedup_b1_p50", "p50 speedup", ".2f"),
            ("b1_p99_ms_runtime", "b1 p99 ms runtime", ".3f"),
            ("b1_p99_ms_torch", "b1 p99 ms torch", ".3f"),
            ("speedup_b1_p99", "p99 speedup", ".2f"),
            ("b1_p50_ms_encoder", "b1 p50 ms encoder alone (same loop)", ".3f"),
            ("b1_over_encoder", "runtime / encoder alone", ".2f"),
            ("throughput_runtime", f"b{b} samples/s runtime", ".0f"),
            ("throughput_torch", f"b{b} samples/s torch", ".0f"),
            ("speedup_throughput", "throughput ratio", ".2f"),
            ("argmax_agreement", "argmax agree", ".3f"),
        ],
    )
    return C.report_text(
        C.report_head(
            "Edge runtime latency: Runtime vs the torch float32 path",
            machine_start,
            machine_end,
            f"Threads: {args.threads} for onnxruntime, torch, BLAS and "
            f"hnswlib. Took {seconds:.0f} s.",
        ),
        f"Weights: {weights} (latency does not depend on the weight values). Encoder: "
        f"{args.encoder} ONNX, saved optimized as `knnper export` ships it. Keys: torch "
        "embeddings of Fashion-MNIST images; sizes beyond the real images are copies plus "
        f"noise ({args.noise} x per-dimension std). Queries: "
        f"{args.queries} held-out test images. Speedup = torch time / runtime time "
        "(throughput ratio = runtime / torch); > 1 means the runtime is faster. argmax agree: "
        "share of the queries on which both paths predict the same class (the int8 encoder "
        "against float32 torch; with random weights the logits are nearly flat and flip "
        "easily, so read it only with --run).",
        f"Batch 1: {args.reps} timed calls per path ({args.warmup} warm-up), interleaved. "
        f"Batch {b}: median of {args.batch_reps} calls.",
        table,
    )


if __name__ == "__main__":
    sys.exit(main())
