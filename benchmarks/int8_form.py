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
from collections.abc import Sequence

from experiments import benchmark_support as C
from experiments import encoder_forms as E

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
    E.compare_encoders(
        args,
        FORMS,
        ("b1_vs_before", "int8 before"),
        COLUMNS,
        "int8 encoder forms: the previous one and the one exact on every CPU",
        "int8_form",
        limit=args.test_limit,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
