"""What refitting the linear head costs a device's `add`: one labelled image added (fifo, the
datastore's size unchanged) to a bundle with the linear base against the same bundle with the
global base, interleaved call by call.

    python benchmarks/head_refit.py --out OUT [--run RUN] [--sizes 500 2000 5000] [--reps 20]

Bundles: the small CNN as an int8 ONNX encoder (the exporter's), a flat int8 datastore of its
embeddings of Fashion-MNIST images (copies plus noise past the real images). The linear bundle's
encoder carries a linear head fitted on the stored keys (l2 = DEFAULT_L2, as export writes it);
its `add` then refits the head on the stored keys, writes linear_head.<generation>.npz and opens
a new session with the head in it. The global bundle's `add` does the rest alone. Also timed:
the head's fit alone (LinearHead.fit on the same keys) and its L-BFGS iterations.
Outputs in OUT: head_refit.csv, head_refit.md, head_refit_run.json.
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

from edge_runtime.knn_provenance import KNNProvenance
from edge_runtime.linear_head import DEFAULT_L2, LinearHead
from edge_runtime.preprocess import prepare_input
from edge_runtime.runtime import Runtime
from experiments import benchmark_support as C
from export.personal_encoder import with_linear_head

log = logging.getLogger("benchmarks.head_refit")

RECIPE = "flat:int8"
# head_refit.csv's columns and head_refit.md's table, one declaration: (key, header, format)
TABLE = [
    ("keys", "stored keys", ","),
    ("add_global_ms", "add, global base p50 ms", ".1f"),
    ("add_linear_ms", "add, linear base (refit) p50 ms", ".1f"),
    ("ratio", "linear / global", ".2f"),
    ("refit_extra_ms", "refit adds ms", ".1f"),
    ("fit_ms", "LinearHead.fit alone ms", ".1f"),
    ("lbfgs_iterations", "L-BFGS iterations", "d"),
]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = C.device_parser(__doc__)
    p.add_argument(
        "--sizes", type=C.positive_int, nargs="+", default=[500, 2000, 5000], help="stored keys"
    )
    p.add_argument("--reps", type=C.positive_int, default=20, help="timed adds per bundle")
    args = p.parse_args(argv)
    if args.smoke:
        args.sizes, args.reps = [100], 2
    return args


def linear_base_record(l2: float) -> KNNProvenance:
    """The manifest's record of a linear base, as the exporter writes it."""

    def flag(value):
        return {"value": value, "source": "flag"}

    return KNNProvenance(
        {
            "k": flag(10),
            "sigma": flag(1.0),
            "normalize": flag("none"),
            "lambda_estimator": flag("val"),
            "base": flag("linear"),
            "l2": flag(l2),
        }
    )


def time_adds(
    bundles: dict[str, Path], images: np.ndarray, labels: np.ndarray, reps: int
) -> dict[str, float]:
    """Median seconds of one `add` per bundle, alternating which goes first."""
    runtimes = {name: Runtime.load(path) for name, path in bundles.items()}
    adds = {name: lambda xy, rt=rt: rt.add(*xy, strategy="fifo") for name, rt in runtimes.items()}
    samples = [(images[i][None], labels[i][None]) for i in range(len(images))]
    return C.interleaved_medians(adds, samples, reps, warmup=0)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started, machine, gm, pool = C.start_device_benchmark(
        args, threads=1, queries=50, smoke_train=2000
    )
    spec, num_classes = gm.spec, gm.num_classes
    rows = []
    with tempfile.TemporaryDirectory(prefix="knnper-refit-", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        calib = prepare_input(C.images(gm.dataset, pool.pool_idx[:256]), spec)
        encoder = C.export_encoder(gm.model, calib, work / "encoder")
        for size in args.sizes:
            z, y = C.replicate_keys(pool.z, pool.y, size, noise=0.01, seed=args.seed)
            ds = C.build_datastore(RECIPE, z, y, num_classes, seed=args.seed)
            t0 = time.perf_counter()
            head = LinearHead(num_classes, l2=DEFAULT_L2).fit(ds.keys(), ds.labels_)
            fit = time.perf_counter() - t0
            personal = work / f"personal-{size}.onnx"
            personal.write_bytes(with_linear_head(encoder, head))
            bundles = {"global": work / f"global-{size}", "linear": work / f"linear-{size}"}
            C.write_benchmark_bundle(bundles["global"], encoder, ds, spec)
            C.write_benchmark_bundle(
                bundles["linear"], personal, ds, spec, knn_choice=linear_base_record(DEFAULT_L2)
            )
            t = time_adds(bundles, pool.queries, pool.query_labels, args.reps)
            rows.append(
                {
                    "keys": size,
                    "add_global_ms": 1e3 * t["global"],
                    "add_linear_ms": 1e3 * t["linear"],
                    "ratio": t["linear"] / t["global"],
                    "refit_extra_ms": 1e3 * (t["linear"] - t["global"]),
                    "fit_ms": 1e3 * fit,
                    "lbfgs_iterations": head.n_iter_,
                }
            )
            log.info(
                "%d keys: add %.1f ms global, %.1f ms linear (fit alone %.1f ms)",
                size,
                rows[-1]["add_global_ms"],
                rows[-1]["add_linear_ms"],
                rows[-1]["fit_ms"],
            )
    machine_end = C.machine_info()
    text = report(rows, args, gm.source, machine, machine_end, time.time() - started)
    C.write_results(
        args,
        started,
        text,
        report="head_refit.md",
        record="head_refit_run.json",
        tables={"head_refit.csv": (rows, TABLE)},
        machine=machine,
        machine_end=machine_end,
        weights=gm.source,
    )
    return 0


def report(
    rows: list[dict],
    args: argparse.Namespace,
    weights: str,
    machine: dict,
    machine_end: dict,
    seconds: float,
) -> str:
    return C.report_text(
        C.report_head(
            "Edge runtime: what refitting the linear head adds to `add`",
            machine,
            machine_end,
            "One thread for onnxruntime and BLAS. "
            f"Took {seconds:.0f} s. Weights: {weights}; int8 ONNX encoder, "
            f"{RECIPE} datastore.",
        ),
        f"Medians of {args.reps} interleaved `add` calls of one image each (fifo: the "
        "datastore keeps its size); each commits the bundle crash-safely. The linear bundle's "
        "also refits the head on every stored key, writes its file and opens a new session.",
        C.markdown_table(rows, TABLE),
    )


if __name__ == "__main__":
    sys.exit(main())
