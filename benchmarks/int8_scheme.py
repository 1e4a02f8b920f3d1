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

from edge_runtime.encoder import Encoder, optimize_encoder
from edge_runtime.preprocess import prepare_input
from experiments import benchmark_support as C
from export.onnx_export import export_onnx
from export.quantize import (
    INT16_MAX,
    calibration_inputs,
    int8_weights,
    pair_sum_bound,
    quantize_int8,
)
from fed_train.run import load_run

SCHEMES = ("int8", "int7", "uint8")  # export.quantize.WEIGHT_SCHEMES, the exporter's is int7
COLUMNS = (
    "encoder",
    "bytes",
    "test_accuracy",
    "argmax_agreement_fp32",
    "min_cosine_fp32",
    "largest_pair_sum",
    "pair_sums_fit_int16",
    "b1_p50_ms",
    "b1_p90_ms",
    "b1_vs_int8",
    "test_images",
    "reps",
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("run", help="run directory written by `knnper train` (or `knnper demo`)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--reps", type=C.positive_int, default=3000, help="timed batch-1 calls")
    p.add_argument("--warmup", type=C.positive_int, default=200, help="untimed batch-1 calls")
    p.add_argument("--threads", type=C.positive_int, default=1, help="onnxruntime threads")
    p.add_argument("--calibration-samples", type=C.positive_int, default=256)
    return p.parse_args(argv)


def write_encoders(run, directory: Path, samples: int) -> dict[str, Path]:
    """fp32 and one int8 encoder per scheme, each optimized as a bundle's is."""
    calibration = calibration_inputs(run.clients(), samples, seed=0)
    paths = {"fp32": directory / "fp32.onnx"}
    export_onnx(run.model, calibration, paths["fp32"])
    for scheme in SCHEMES:
        paths[scheme] = quantize_int8(
            paths["fp32"], directory / f"{scheme}.onnx", calibration, weights=scheme
        )
    for path in paths.values():
        path.write_bytes(optimize_encoder(path.read_bytes()))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started, machine = C.start_benchmark(args.out, args.threads)
    run = load_run(args.run)
    x = prepare_input(run.dataset.x_test, run.dataset.input_spec)
    y = np.asarray(run.dataset.y_test)
    with tempfile.TemporaryDirectory(prefix="knnper-int8-scheme-") as tmp:
        paths = write_encoders(run, Path(tmp), args.calibration_samples)
        encoders = {
            name: Encoder(path.read_bytes(), intra_op_threads=args.threads)
            for name, path in paths.items()
        }
        # None: no int8 weights (float32, or uint8 weights: uint8 x uint8 kernels widen to 16 bits)
        bounds = {
            name: max(map(pair_sum_bound, int8_weights(onnx.load(path)).values()), default=None)
            for name, path in paths.items()
        }
        sizes = {name: path.stat().st_size for name, path in paths.items()}
    outputs = {name: enc.run(x) for name, enc in encoders.items()}
    singles = [x[i : i + 1] for i in range(len(x))]
    times = C.interleaved_times(
        {name: enc.run for name, enc in encoders.items()}, singles, args.reps, args.warmup
    )
    z32, l32 = outputs["fp32"]
    rows = []
    for name, (z, logits) in outputs.items():
        cosine = (z * z32).sum(1) / (
            np.linalg.norm(z, axis=1) * np.linalg.norm(z32, axis=1) + 1e-12
        )
        rows.append(
            {
                "encoder": name,
                "bytes": sizes[name],
                "test_accuracy": round(float(np.mean(logits.argmax(1) == y)), 5),
                "argmax_agreement_fp32": round(
                    float(np.mean(logits.argmax(1) == l32.argmax(1))), 5
                ),
                "min_cosine_fp32": round(float(cosine.min()), 5),
                "largest_pair_sum": bounds[name],
                "pair_sums_fit_int16": None if bounds[name] is None else bounds[name] <= INT16_MAX,
                "b1_p50_ms": round(1e3 * float(np.median(times[name])), 4),
                "b1_p90_ms": round(1e3 * float(np.percentile(times[name], 90)), 4),
                "b1_vs_int8": round(float(np.median(times[name]) / np.median(times["int8"])), 3),
                "test_images": len(y),
                "reps": args.reps,
            }
        )
    end = C.machine_info()
    head = C.report_head(
        "int8 weight schemes: accuracy and batch-1 latency",
        machine,
        end,
        f"Run {args.run}; {args.threads} onnxruntime thread(s); latencies are "
        "medians of interleaved calls on this CPU only.",
    )
    table = C.markdown_table(rows, [(c, c, "") for c in COLUMNS])
    text = C.report_text(head, table)
    C.write_results(
        args,
        started,
        text,
        report="int8_scheme.md",
        record="run.json",
        tables={"int8_scheme.csv": (rows, COLUMNS)},
        machine=machine,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
