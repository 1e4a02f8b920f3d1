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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx

from experiments import benchmark_support as C
from experiments import encoder_forms as E
from export.quantize import INT16_MAX, int8_weights, pair_sum_bound

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


def pair_sums(path: Path) -> dict[str, Any]:
    """The largest uint8 x int8 pair sum the encoder's weights allow, and whether it fits a
    16-bit lane (None: no int8 weights: float32, or uint8 weights, whose kernels widen)."""
    bound = max(map(pair_sum_bound, int8_weights(onnx.load(path)).values()), default=None)
    return {
        "largest_pair_sum": bound,
        "pair_sums_fit_int16": None if bound is None else bound <= INT16_MAX,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    E.compare_encoders(
        args,
        {scheme: {"weights": scheme} for scheme in SCHEMES},
        ("b1_vs_int8", "int8"),
        COLUMNS,
        "int8 weight schemes: accuracy and batch-1 latency",
        "int8_scheme",
        extra=pair_sums,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
