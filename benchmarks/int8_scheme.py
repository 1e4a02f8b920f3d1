"""The int8 encoder's weight scheme, side by side: 8-bit weights (what the exporter wrote before;
uint8 x int8 pair sums saturate on AVX2), 7-bit weights (reduce_range, the exporter's scheme
now) and uint8 weights, against the float32 encoder, on one run's global model.

    python benchmarks/int8_scheme.py RUN --out OUT [--reps 3000] [--threads 1]

Each encoder is exported as the exporter writes it (quantize_int8 calibrated on the training
clients' train splits, then optimize_encoder), and answers every test image of the run's data
set: its test accuracy, its argmax agreement with float32, the smallest cosine of its embedding
to float32's, and the largest pair sum of uint8 x int8 products its weights allow (past 32767 a
16-bit lane saturates). Batch-1 latency: the encoders' onnxruntime sessions alone, on the same
test images, interleaved call by call (experiments.benchmark_support.interleaved_times).

Outputs in OUT: int8_scheme.csv, int8_scheme.md (the table, command line, machine), run.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx

from edge_runtime.preprocess import prepare_input
from experiments import benchmark_support as C
from experiments import encoder_forms as E
from export.quantize import INT16_MAX, int8_weights, pair_sum_bound
from fed_train.run import load_run

SCHEMES = ("int8", "int7", "uint8")  # export.quantize.WEIGHT_SCHEMES, the exporter's is int7
COLUMNS = (
    *E.ACCURACY,
    "largest_pair_sum",
    "pair_sums_fit_int16",
    *E.LATENCY,
    "b1_vs_int8",
    *E.COUNTS,
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = C.script_parser(__doc__)
    E.add_encoder_arguments(p, reps=3000, warmup=200)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started, machine = C.start_benchmark(args.out, args.threads)
    run = load_run(args.run)
    x = prepare_input(run.dataset.x_test, run.dataset.input_spec)
    y = np.asarray(run.dataset.y_test)
    with tempfile.TemporaryDirectory(prefix="knnper-int8-scheme-") as tmp:
        forms = {scheme: {"weights": scheme} for scheme in SCHEMES}
        paths = E.write_encoders(run, Path(tmp), args.calibration_samples, forms)
        rows = E.encoder_rows(paths, x, y, args, baseline="int8")
        for row in rows:
            # None: no int8 weights (float32, or uint8 weights: uint8 x uint8 kernels widen to
            # 16 bits)
            weights = int8_weights(onnx.load(paths[row["encoder"]])).values()
            bound = max(map(pair_sum_bound, weights), default=None)
            row["largest_pair_sum"] = bound
            row["pair_sums_fit_int16"] = None if bound is None else bound <= INT16_MAX
            row["b1_vs_int8"] = row.pop("b1_vs")
    title = "int8 weight schemes: accuracy and batch-1 latency"
    E.write_encoder_report(args, started, machine, rows, COLUMNS, title, "int8_scheme")
    return 0


if __name__ == "__main__":
    sys.exit(main())
