"""Encoders of one model side by side (int8_form.py, int8_scheme.py): what each answers against
float32's, and its batch-1 latency interleaved with the others'."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime.encoder import Encoder, optimize_encoder
from edge_runtime.preprocess import prepare_input
from experiments import benchmark_support as C
from export.onnx_export import export_onnx
from export.quantize import calibration_inputs, quantize_int8
from fed_train.run import load_run

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


def compare_encoders(
    args: argparse.Namespace,
    forms: dict[str, dict[str, Any]],
    baseline: tuple[str, str],
    columns: tuple[str, ...],
    title: str,
    name: str,
    limit: int | None = None,
    extra: Callable[[Path], dict[str, Any]] | None = None,
) -> None:
    """The whole comparison: fp32 and the int8 `forms` of the run's model (write_encoders) on
    its first `limit` test images (all by default), each row with `extra(its file)`'s columns;
    writes OUT/NAME.csv, OUT/NAME.md (the table under `title`, the command, the machine) and
    OUT/run.json."""
    started, machine = C.start_benchmark(args.out, args.threads)
    run = load_run(args.run)
    limit = limit or len(run.dataset.y_test)
    x = prepare_input(run.dataset.x_test[:limit], run.dataset.input_spec)
    y = np.asarray(run.dataset.y_test[:limit])
    with tempfile.TemporaryDirectory(prefix=f"knnper-{name}-") as tmp:
        paths = write_encoders(run, Path(tmp), args.calibration_samples, forms)
        encoders = {
            f: Encoder(p.read_bytes(), intra_op_threads=args.threads) for f, p in paths.items()
        }
        outputs = {form: enc.run(x) for form, enc in encoders.items()}
        singles = [x[i : i + 1] for i in range(len(x))]
        times = C.interleaved_times(
            {form: enc.run for form, enc in encoders.items()}, singles, args.reps, args.warmup
        )
        z32, l32 = outputs["fp32"]
        rows = []
        for form, (z, logits) in outputs.items():
            cosine = (z * z32).sum(1) / (
                np.linalg.norm(z, axis=1) * np.linalg.norm(z32, axis=1) + 1e-12
            )
            rows.append(
                {
                    "encoder": form,
                    "bytes": paths[form].stat().st_size,
                    "test_accuracy": round(float(np.mean(logits.argmax(1) == y)), 5),
                    "argmax_agreement_fp32": round(
                        float(np.mean(logits.argmax(1) == l32.argmax(1))), 5
                    ),
                    "min_cosine_fp32": round(float(cosine.min()), 5),
                    "b1_p50_ms": round(1e3 * float(np.median(times[form])), 4),
                    "b1_p90_ms": round(1e3 * float(np.percentile(times[form], 90)), 4),
                    baseline[0]: round(
                        float(np.median(times[form]) / np.median(times[baseline[1]])), 3
                    ),
                    "test_images": len(y),
                    "reps": args.reps,
                    **(extra(paths[form]) if extra else {}),
                }
            )
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
