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

from edge_runtime.encoder import Encoder, optimize_encoder
from edge_runtime.preprocess import prepare_input
from experiments import benchmark_support as C
from export.onnx_export import export_onnx
from export.quantize import calibration_inputs, quantize_int8
from fed_train.run import load_run

COLUMNS = (
    "encoder",
    "bytes",
    "test_accuracy",
    "argmax_agreement_fp32",
    "min_cosine_fp32",
    "b1_p50_ms",
    "b1_p90_ms",
    "b1_vs_before",
    "test_images",
    "reps",
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("run", help="run directory written by `knnper train` (or `knnper demo`)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--reps", type=C.positive_int, default=2000, help="timed batch-1 calls")
    p.add_argument("--warmup", type=C.positive_int, default=100, help="untimed batch-1 calls")
    p.add_argument("--threads", type=C.positive_int, default=1, help="onnxruntime threads")
    p.add_argument("--calibration-samples", type=C.positive_int, default=256)
    p.add_argument("--test-limit", type=C.positive_int, default=None, help="first N test images")
    return p.parse_args(argv)


def write_encoders(run, directory: Path, samples: int) -> dict[str, Path]:
    """fp32, the previous int8 form ("before") and the exporter's ("exact"), optimized as a
    bundle's encoder is."""
    calibration = calibration_inputs(run.clients(), samples, seed=0)
    paths = {"fp32": directory / "fp32.onnx"}
    export_onnx(run.model, calibration, paths["fp32"])
    paths["int8 before"] = quantize_int8(
        paths["fp32"], directory / "before.onnx", calibration, previous_form=True
    )
    paths["int8 exact"] = quantize_int8(paths["fp32"], directory / "exact.onnx", calibration)
    for path in paths.values():
        path.write_bytes(optimize_encoder(path.read_bytes()))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started, machine = C.start_benchmark(args.out, args.threads)
    run = load_run(args.run)
    limit = args.test_limit or len(run.dataset.y_test)
    x = prepare_input(run.dataset.x_test[:limit], run.dataset.input_spec)
    y = np.asarray(run.dataset.y_test[:limit])
    with tempfile.TemporaryDirectory(prefix="knnper-int8-form-") as tmp:
        paths = write_encoders(run, Path(tmp), args.calibration_samples)
        encoders = {
            name: Encoder(path.read_bytes(), intra_op_threads=args.threads)
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
                "b1_p50_ms": round(1e3 * float(np.median(times[name])), 4),
                "b1_p90_ms": round(1e3 * float(np.percentile(times[name], 90)), 4),
                "b1_vs_before": round(
                    float(np.median(times[name]) / np.median(times["int8 before"])), 3
                ),
                "test_images": len(y),
                "reps": args.reps,
            }
        )
    end = C.machine_info()
    head = C.report_head(
        "int8 encoder forms: the previous one and the one exact on every CPU",
        machine,
        end,
        f"Run {args.run}; {args.threads} onnxruntime thread(s); latencies are "
        "medians of interleaved calls on this CPU only.",
    )
    table = C.markdown_table(rows, [(c, c, "") for c in COLUMNS])
    C.write_results(
        args,
        started,
        C.report_text(head, table),
        report="int8_form.md",
        record="run.json",
        tables={"int8_form.csv": (rows, COLUMNS)},
        machine=machine,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
