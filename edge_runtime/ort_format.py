"""onnxruntime's ORT format of the portable predictor, for its mobile packages (Android, iOS) and
its minimal and reduced builds, which read no .onnx file.

    knnper-edge export-onnx BUNDLE --out predictor.ort --format ort

The graph is optimized once, here, at a portable level (ORT_ENABLE_BASIC: constant folding; the
encoder's fusions are already in it; not the runtime's own ORT_ENABLE_ALL, whose CPU-specific
layout would be baked in, so one file serves x86 and ARM), then saved in ORT format; a minimal
build runs what it is given. Beside it, `<out>.required_operators.config` lists the operators a
reduced build must include (`--include_ops_by_config` of onnxruntime's build script), one
"domain;opset;Op,Op" line per domain and opset, read from the same optimized graph.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnxruntime as ort

from .encoder import open_session, session_options

MODEL_FORMATS = ("onnx", "ort")  # what `knnper-edge export-onnx --format` writes
LEVEL = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
CONFIG_SUFFIX = ".required_operators.config"


def to_ort(model: bytes) -> tuple[bytes, str]:
    """ONNX model bytes -> (the ORT-format model, its required-operators config text)."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="knnper-ort-") as tmp:
        saved = {}
        for form in ("ORT", "ONNX"):
            options = session_options(1, LEVEL)
            options.optimized_model_filepath = os.path.join(tmp, f"model.{form.lower()}")
            options.add_session_config_entry("session.save_model_format", form)
            open_session(model, options, "the predictor")
            saved[form] = Path(options.optimized_model_filepath).read_bytes()
    return saved["ORT"], required_operators(onnx.load_from_string(saved["ONNX"]))


def required_operators(model) -> str:
    """The config a reduced onnxruntime build takes: per domain and opset, the sorted operator
    types the model's nodes use. An ONNX operator is listed under the opset its definition
    dates from (what onnxruntime registers its kernel by); another domain's under the model's
    opset of it."""
    from onnx import defs

    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    used: dict[tuple[str, int], set[str]] = {}
    for node in model.graph.node:
        domain = node.domain or "ai.onnx"
        since = opsets[domain]
        if domain == "ai.onnx":
            since = defs.get_schema(node.op_type, since, "").since_version
        used.setdefault((domain, since), set()).add(node.op_type)
    lines = ["# operators the predictor uses (onnxruntime's --include_ops_by_config)"]
    lines += [f"{d};{v};{','.join(sorted(ops))}" for (d, v), ops in sorted(used.items())]
    return "\n".join(lines) + "\n"
