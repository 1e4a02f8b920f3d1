"""The int8 encoder's form, side by side: the one the exporter wrote before (first layer float,
residual adds fused into QLinearAdd, GroupNorm's statistics in float: each rounds by the CPU's
kernel) and the one it writes now (first layer quantized, adds as float Sums, GroupNorm from
the integers: the same integers on x86 and ARM), against the float32 encoder, on one run's
global model.

    python benchmarks/int8_form.py RUN --out OUT [--reps 2000] [--threads 1] [--test-limit N]

Each encoder is exported as the exporter writes it (quantize_int8 calibrated on the training
clients' train splits, then optimize_encoder) and answers the run's test images: test accuracy,
argmax agreement with float32, the smallest cosine of its embedding to float32's. Batch-1
latency: the encoders' onnxruntime sessions alone, interleaved call by call
(experiments.benchmark_support.interleaved_times).

Outputs in OUT: int8_form.csv, int8_form.md (the table, command line, machine), run.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edge_runtime.preprocess import prepare_input
from experiments import benchmark_support as C
from experiments import encoder_forms as E
from fed_train.run import load_run

COLUMNS = (*E.ACCURACY, *E.LATENCY, "b1_vs_before", *E.COUNTS)
# fp32, the previous int8 form ("before") and the exporter's ("exact")
FORMS = {"int8 before": {"previous_form": True}, "int8 exact": {}}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = C.script_parser(__doc__)
    E.add_encoder_arguments(p, reps=2000, warmup=100)
    p.add_argument("--test-limit", type=C.positive_int, default=None, help="first N test images")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started, machine = C.start_benchmark(args.out, args.threads)
    run = load_run(args.run)
    limit = args.test_limit or len(run.dataset.y_test)
    x = prepare_input(run.dataset.x_test[:limit], run.dataset.input_spec)
    y = np.asarray(run.dataset.y_test[:limit])
    with tempfile.TemporaryDirectory(prefix="knnper-int8-form-") as tmp:
        paths = E.write_encoders(run, Path(tmp), args.calibration_samples, FORMS)
        rows = E.encoder_rows(paths, x, y, args, baseline="int8 before")
    for row in rows:
        row["b1_vs_before"] = row.pop("b1_vs")
    title = "int8 encoder forms: the previous one and the one exact on every CPU"
    E.write_encoder_report(args, started, machine, rows, COLUMNS, title, "int8_form")
    return 0


if __name__ == "__main__":
    sys.exit(main())
