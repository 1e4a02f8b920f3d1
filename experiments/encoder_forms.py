"""Encoders of one model side by side (int8_form.py, int8_scheme.py): what each answers against
float32's, and its batch-1 latency interleaved with the others'."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime.encoder import Encoder, optimize_encoder
from experiments import benchmark_support as C
from export.onnx_export import export_onnx
from export.quantize import calibration_inputs, quantize_int8

# the columns every encoder's row has; the scripts add their own and a `b1_vs_*` ratio
ACCURACY = ("encoder", "bytes", "test_accuracy", "argmax_agreement_fp32", "min_cosine_fp32")
LATENCY = ("b1_p50_ms", "b1_p90_ms")
COUNTS = ("test_images", "reps")


def add_encoder_arguments(p: argparse.ArgumentParser, reps: int, warmup: int) -> None:
    p.add_argument("run", help="run directory written by `knnper train` (or `knnper demo`)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--reps", type=C.positive_int, default=reps, help="timed batch-1 calls")
    p.add_argument("--warmup", type=C.positive_int, default=warmup, help="untimed batch-1 calls")
    p.add_argument("--threads", type=C.positive_int, default=1, help="onnxruntime threads")
    p.add_argument("--calibration-samples", type=C.positive_int, default=256)


def write_encoders(
    run: Any, directory: Path, samples: int, forms: dict[str, dict[str, Any]]
) -> dict[str, Path]:
    """fp32 and one int8 encoder per form (name: quantize_int8's keywords), calibrated on the
    training clients' train splits and optimized as a bundle's encoder is."""
    calibration = calibration_inputs(run.clients(), samples, seed=0)
    paths = {"fp32": directory / "fp32.onnx"}
    export_onnx(run.model, calibration, paths["fp32"])
    for i, (name, keywords) in enumerate(forms.items()):
        paths[name] = quantize_int8(paths["fp32"], directory / f"{i}.onnx", calibration, **keywords)
    for path in paths.values():
        path.write_bytes(optimize_encoder(path.read_bytes()))
    return paths


def encoder_rows(
    paths: dict[str, Path], x: np.ndarray, y: np.ndarray, args: argparse.Namespace, baseline: str
) -> list[dict[str, Any]]:
    """One row per encoder: ACCURACY, LATENCY and COUNTS' columns, and `b1_vs`, its median
    batch-1 time over `baseline`'s."""
    encoders = {n: Encoder(p.read_bytes(), intra_op_threads=args.threads) for n, p in paths.items()}
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
                "bytes": paths[name].stat().st_size,
                "test_accuracy": round(float(np.mean(logits.argmax(1) == y)), 5),
                "argmax_agreement_fp32": round(
                    float(np.mean(logits.argmax(1) == l32.argmax(1))), 5
                ),
                "min_cosine_fp32": round(float(cosine.min()), 5),
                "b1_p50_ms": round(1e3 * float(np.median(times[name])), 4),
                "b1_p90_ms": round(1e3 * float(np.percentile(times[name], 90)), 4),
                "b1_vs": round(float(np.median(times[name]) / np.median(times[baseline])), 3),
                "test_images": len(y),
                "reps": args.reps,
            }
        )
    return rows


def write_encoder_report(
    args: argparse.Namespace,
    started: float,
    machine: dict[str, Any],
    rows: list[dict[str, Any]],
    columns: tuple[str, ...],
    title: str,
    name: str,
) -> None:
    """OUT/NAME.csv, OUT/NAME.md (the table under `title`, the command line, the machine) and
    OUT/run.json."""
    head = C.report_head(
        title,
        machine,
        C.machine_info(),
        f"Run {args.run}; {args.threads} onnxruntime thread(s); latencies are "
        "medians of interleaved calls on this CPU only.",
    )
    C.write_results(
        args,
        started,
        C.report_text(head, C.markdown_table(rows, [(c, c, "") for c in columns])),
        report=f"{name}.md",
        record="run.json",
        tables={f"{name}.csv": (rows, columns)},
        machine=machine,
    )
