"""The flat datastore's scan against this machine's memory speed, int8 against float32 keys, the
top-k switch point and BLAS threads at batch 1. One process, one run: every figure is
a ratio to another measured in the same run.

    python benchmarks/runtime_scan.py --out OUT [--sizes 1000 10000 100000] [--dim 128]
        [--batches 1 32]

- Memory read speed: np.max over a 1 GiB float32 array (one core; the median of 5 passes).
- Scan: the batch-1 distance step (one query's products with every key) over keys as the
  runtime holds them, [p, n] in their stored dtype; its speed is the key bytes read per second.
  The product over keys stored [n, p] (the runtime's earlier layout) is timed beside it.
- Integer scan: int8 keys through onnxruntime's MatMulInteger as the runtime's single session
  runs it (keys fed as an input, the query quantised to 7 bits; predictor_graph), against the
  numpy float32 scan; at each batch size in --batches.
- kneighbors: the whole batch-1 search (distances, top-k, ordering) per dtype.
- Top-k: np.argpartition against the blockwise top-k on one row of distances, k = 10, for a
  range of row lengths; the runtime switches where blockwise starts to win
  (edge_runtime/knn.py, _BLOCKWISE_MIN_KEYS_PER_K).
- BLAS threads: the batch-1 search at 1 and at 2 BLAS threads.
Timings interleave the variants call by call and report medians. Keys are Gaussian (speed does
not depend on their values). Outputs in OUT: scan.csv, topk.csv, scan.md, scan_run.json.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from threadpoolctl import threadpool_limits

from edge_runtime import onnx_proto as P
from edge_runtime.datastores import FlatDatastore
from edge_runtime.knn import _BLOCK, blockwise_topk, key_products
from edge_runtime.predictor_graph import _Graph, _int8_products
from experiments import benchmark_support as C

log = logging.getLogger("benchmarks.scan")

# topk.csv's columns and the report's top-k table, one declaration: (key, header, format)
TOPK_TABLE = [
    ("keys", "keys", ","),
    ("k", "k", ""),
    ("argpartition_ms", "argpartition ms", ".4f"),
    ("blockwise_ms", "blockwise ms", ".4f"),
    ("blockwise_speedup", "argpartition / blockwise", ".2f"),
]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = C.script_parser(__doc__)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--sizes", type=C.positive_int, nargs="+", default=[1000, 10_000, 100_000])
    p.add_argument("--dim", type=C.positive_int, default=128, help="embedding dimension")
    p.add_argument(
        "--batches", type=C.positive_int, nargs="+", default=[1], help="queries per scan"
    )
    p.add_argument(
        "--topk-sizes",
        type=C.positive_int,
        nargs="+",
        default=[1000, 2000, 3000, 5000, 7000, 10_000, 20_000, 50_000, 100_000],
    )
    p.add_argument("--reps", type=C.positive_int, default=200, help="timed calls per variant")
    p.add_argument("--memory-gib", type=float, default=1.0, help="array size of the read test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes to check the pipeline")
    args = p.parse_args(argv)
    if args.smoke:
        args.sizes, args.topk_sizes, args.reps, args.memory_gib = [1000], [1000, 5000], 5, 0.05
        args.batches = [1, 4]
    return args


def medians(paths: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median seconds per call of each path (they take no input), after one warm-up call."""
    return C.interleaved_medians(
        {name: lambda _, fn=fn: fn() for name, fn in paths.items()}, [None], reps, warmup=1
    )


def memory_read_speed(gib: float) -> float:
    """Bytes per second np.max reads from a float32 array far larger than the caches."""
    big = np.ones(int(gib * 2**30) // 4, dtype=np.float32)
    seconds = medians({"max": big.max}, 5)["max"]
    return big.nbytes / seconds


def integer_scan_session(scale: np.ndarray, dim: int) -> ort.InferenceSession:
    """The runtime's integer scan of int8 keys (predictor_graph) alone, keys as an input."""
    g = _Graph(17)
    g.input("q", P.FLOAT, ["m", dim])
    g.input("keys_t", P.INT8, [dim, "n"])
    g.input("key_offsets", P.INT32, ["n"])
    g.nodes.append(
        P.node("Identity", [_int8_products(g, "q", "keys_t", "key_offsets", scale)], ["products"])
    )
    graph = P.graph(
        "scan", g.nodes, g.inputs, [P.value_info("products", P.FLOAT, None)], g.initializers
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(
        P.model(graph, ir_version=8, opsets={"": 17}, producer="bench"),
        options,
        providers=["CPUExecutionProvider"],
    )


def scan_rows(
    args: argparse.Namespace, rng: np.random.Generator, memory_bps: float
) -> list[dict[str, Any]]:
    rows = []
    for n in args.sizes:
        z = rng.normal(size=(n, args.dim)).astype(np.float32)
        y = rng.integers(0, 10, n)
        stores = {
            dtype: FlatDatastore(10, dtype=dtype).fit(z, y) for dtype in ("fp32", "fp16", "int8")
        }
        del z
        int8 = stores["int8"]
        session = integer_scan_session(int8.scale_, args.dim)
        for batch in args.batches:
            q = rng.normal(size=(batch, args.dim)).astype(np.float32)
            scans = {
                d: (lambda ds=ds, q=q: key_products(q, ds.keys_t_, ds.scale_))
                for d, ds in stores.items()
            }
            scans["integer"] = lambda q=q, s=session, ds=int8: s.run(
                None, {"q": q, "keys_t": ds.keys_t_, "key_offsets": ds.key_offsets_}
            )
            if batch == 1:
                keys_np = stores["fp32"].keys()  # [n, p], the runtime's earlier layout
                scans["np_layout"] = lambda q=q, keys=keys_np: q @ keys.T
            scan = medians(scans, args.reps)
            search = search2 = {}
            if batch == 1:
                del keys_np
                searches = {d: (lambda ds=ds, q=q: ds.kneighbors(q)) for d, ds in stores.items()}
                search = medians(searches, args.reps)
                with threadpool_limits(limits=2, user_api="blas"):
                    search2 = medians(searches, args.reps)
            for dtype, ds in stores.items():
                nbytes = ds.keys_t_.nbytes
                fp32 = dtype == "fp32"
                rows.append(
                    {
                        "keys": n,
                        "batch": batch,
                        "dim": args.dim,
                        "dtype": dtype,
                        "key_bytes": nbytes,
                        "scan_ms": 1e3 * scan[dtype],
                        "integer_scan_ms": 1e3 * scan["integer"] if dtype == "int8" else None,
                        "fp32_over_integer": scan["fp32"] / scan["integer"]
                        if dtype == "int8"
                        else None,
                        "scan_gb_s": nbytes / scan[dtype] / 1e9,
                        "memory_gb_s": memory_bps / 1e9,
                        "scan_share_of_memory": nbytes / scan[dtype] / memory_bps,
                        "scan_ms_np_layout": 1e3 * scan["np_layout"]
                        if fp32 and batch == 1
                        else None,
                        "layout_speedup": scan["np_layout"] / scan[dtype]
                        if fp32 and batch == 1
                        else None,
                        "kneighbors_ms": 1e3 * search[dtype] if search else None,
                        "kneighbors_ms_2_threads": 1e3 * search2[dtype] if search2 else None,
                        "threads_2_over_1": search2[dtype] / search[dtype] if search else None,
                        "scan_ms_vs_fp32": scan[dtype] / scan["fp32"],
                        "bytes_vs_fp32": nbytes / stores["fp32"].keys_t_.nbytes,
                    }
                )
                log.info(
                    "%d keys, batch %d, %s: scan %.3f ms%s",
                    n,
                    batch,
                    dtype,
                    rows[-1]["scan_ms"],
                    f", integer {1e3 * scan['integer']:.3f} ms" if dtype == "int8" else "",
                )
    return rows


def topk_rows(args: argparse.Namespace, rng: np.random.Generator) -> list[dict[str, Any]]:
    rows, k = [], 10
    for n in args.topk_sizes:
        if n // _BLOCK < k:
            continue  # too few blocks of distances for a blockwise top-k
        sq = rng.random((1, n)).astype(np.float32)
        t = medians(
            {
                "argpartition": lambda sq=sq: np.argpartition(sq, k - 1, axis=1)[:, :k],
                "blockwise": lambda sq=sq: blockwise_topk(sq, k),
            },
            args.reps,
        )
        rows.append(
            {
                "keys": n,
                "k": k,
                "argpartition_ms": 1e3 * t["argpartition"],
                "blockwise_ms": 1e3 * t["blockwise"],
                "blockwise_speedup": t["argpartition"] / t["blockwise"],
            }
        )
        log.info(
            "top-%d of %d: argpartition %.4f ms, blockwise %.4f ms",
            k,
            n,
            rows[-1]["argpartition_ms"],
            rows[-1]["blockwise_ms"],
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started, machine = C.start_benchmark(args.out, threads=1)
    rng = np.random.default_rng(args.seed)
    with threadpool_limits(limits=1, user_api="blas"):
        memory_bps = memory_read_speed(args.memory_gib)
        log.info("memory read speed: %.2f GB/s", memory_bps / 1e9)
        scans = scan_rows(args, rng, memory_bps)
        topk = topk_rows(args, rng)
    machine_end = C.machine_info()
    text = report(scans, topk, memory_bps, machine, machine_end, time.time() - started)
    C.write_results(
        args,
        started,
        text,
        report="scan.md",
        record="scan_run.json",
        tables={"scan.csv": (scans, None), "topk.csv": (topk, TOPK_TABLE)},
        machine=machine,
        machine_end=machine_end,
        memory_read_gb_s=memory_bps / 1e9,
    )
    return 0


def report(
    scans: list[dict],
    topk: list[dict],
    memory_bps: float,
    machine: dict,
    machine_end: dict,
    seconds: float,
) -> str:
    scan_table = C.markdown_table(
        scans,
        [
            ("keys", "keys", ","),
            ("batch", "batch", ""),
            ("dtype", "dtype", ""),
            ("key_bytes", "key bytes", ","),
            ("scan_ms", "numpy scan ms", ".3f"),
            ("integer_scan_ms", "integer scan ms (onnxruntime)", ".3f"),
            ("fp32_over_integer", "fp32 numpy / integer", ".2f"),
            ("scan_gb_s", "scan GB/s", ".2f"),
            ("scan_share_of_memory", "share of memory speed", ".2f"),
            ("scan_ms_np_layout", "[n, p] scan ms", ".3f"),
            ("layout_speedup", "[p, n] speedup", ".2f"),
            ("scan_ms_vs_fp32", "scan time / fp32", ".2f"),
            ("bytes_vs_fp32", "bytes / fp32", ".2f"),
            ("kneighbors_ms", "search ms, 1 BLAS thread", ".3f"),
            ("kneighbors_ms_2_threads", "search ms, 2 threads", ".3f"),
            ("threads_2_over_1", "2 threads / 1", ".2f"),
        ],
    )
    return C.report_text(
        C.report_head(
            "Flat scan at batch 1: memory speed, int8 vs float32, top-k, BLAS threads",
            machine,
            machine_end,
            f"One BLAS thread unless a column says otherwise. Took {seconds:.0f} s.",
        ),
        f"Memory read speed (np.max over a float32 array far larger than the caches, one core): "
        f"{memory_bps / 1e9:.2f} GB/s. Scan = one query's distance products with every key, "
        "over the keys as the runtime holds them ([p, n], stored dtype; int8 and fp16 widened "
        "a block at a time; int8: the query quantised to 7 bits); integer scan = int8 keys "
        "through onnxruntime's MatMulInteger as the runtime's single session runs it; "
        "GB/s = key bytes / numpy scan time. [n, p] scan = the float32 product "
        "over keys stored [n, p], the runtime's earlier layout. Search = the whole batch-1 "
        "kneighbors (distances, top-k, ordering).",
        scan_table,
        "Top-k of one row of distances (k = 10): argpartition / blockwise > 1 means the "
        "blockwise top-k is faster.",
        C.markdown_table(topk, TOPK_TABLE),
    )


if __name__ == "__main__":
    sys.exit(main())
