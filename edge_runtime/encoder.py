"""The global model on the device: an onnxruntime session giving (embedding, logits) per input."""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort

from .errors import one_line
from .versions import stamp

_ORT_TYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64}
# Metadata key the exporter sets on an encoder it saved already optimized by onnxruntime (the
# portable levels: fusions, no CPU-specific layout, so one file serves every CPU).
OPTIMIZED_KEY = "knnper.ort_optimized"
_SAVED_LEVEL = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
# The level every session of the runtime opens at, an encoder saved optimized too: the layout
# level onnxruntime adds on the device's CPU (NHWC integer convolutions) halved the small CNN's
# batch-1 time against loading the saved encoder as it is, for about 1.4 ms more at load, with
# the same int8 outputs bit for bit (benchmarks/results/runtime/load_level/).
RUNTIME_LEVEL = ort.GraphOptimizationLevel.ORT_ENABLE_ALL


class Encoder:
    """Wraps `onnxruntime.InferenceSession` for a model with one input and the two outputs the
    bundle format requires, "embedding" [N, p] and "logits" [N, C].

    `model` is a path or the model's bytes (the bundle reader passes the bytes it hashed, so what
    was verified is what runs). Large inputs are run in batches of `batch_size` to bound memory.
    Every encoder is optimized by onnxruntime as it loads (RUNTIME_LEVEL), one saved by
    `optimize_encoder` too: its saved fusions leave the CPU's own layout to the device.
    """

    def __init__(
        self,
        model: str | os.PathLike | bytes,
        *,
        intra_op_threads: int | None = None,
        batch_size: int = 256,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.intra_op_threads = intra_op_threads
        source = model if isinstance(model, bytes) else os.fspath(model)
        name = "the encoder" if isinstance(model, bytes) else f"encoder {os.fspath(model)}"
        self.session = open_session(source, session_options(intra_op_threads, RUNTIME_LEVEL), name)
        inputs = self.session.get_inputs()
        if len(inputs) != 1:
            raise ValueError(f"{name} must have exactly one input, it has {len(inputs)}")
        self.input_name = inputs[0].name
        self.input_dtype = _ORT_TYPES.get(inputs[0].type)
        if self.input_dtype is None:
            raise ValueError(
                f"{name} input has type {inputs[0].type}; expected tensor(float) or tensor(int64)"
            )
        outputs = {o.name: o for o in self.session.get_outputs()}
        missing = [n for n in ("embedding", "logits") if n not in outputs]
        if missing:
            raise ValueError(
                f"{name} lacks output(s) {missing}; it has {sorted(outputs)} "
                "(export with output names ['embedding', 'logits'])"
            )

    def run(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x: the output of `prepare_input` -> (embedding float32 [N,p], logits float32 [N,C])."""
        x = np.asarray(x)
        if x.dtype != self.input_dtype:
            raise ValueError(
                f"encoder input must be {np.dtype(self.input_dtype)}, got {x.dtype} "
                "(pass the output of prepare_input)"
            )
        if x.shape[0] == 0:
            raise ValueError("encoder input is an empty batch")
        zs, ls = [], []
        for start in range(0, x.shape[0], self.batch_size):
            chunk = np.ascontiguousarray(x[start : start + self.batch_size])
            try:
                z, logits = self.session.run(["embedding", "logits"], {self.input_name: chunk})
            except Exception as exc:
                raise ValueError(
                    f"encoder failed on input of shape {list(chunk.shape)}: "
                    f"{one_line(exc, first_line=True)}"
                ) from None
            z, logits = np.asarray(z), np.asarray(logits)
            n = chunk.shape[0]
            if z.ndim != 2 or logits.ndim != 2 or z.shape[0] != n or logits.shape[0] != n:
                raise ValueError(
                    f"encoder outputs must be embedding [N, p] and logits [N, C] with N={n}, got "
                    f"{list(z.shape)} and {list(logits.shape)}"
                )
            zs.append(z.astype(np.float32, copy=False))
            ls.append(logits.astype(np.float32, copy=False))
        if len(zs) == 1:
            return zs[0], ls[0]
        return np.concatenate(zs), np.concatenate(ls)


def session_options(
    intra_op_threads: int | None, level: ort.GraphOptimizationLevel
) -> ort.SessionOptions:
    """The options every session of the runtime opens with (one inter-op thread, quiet)."""
    options = ort.SessionOptions()
    if intra_op_threads is not None:
        options.intra_op_num_threads = int(intra_op_threads)
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.graph_optimization_level = level
    return options


def open_session(source: str | bytes, options: ort.SessionOptions, name: str):
    """An onnxruntime session on the CPU; ValueError, one line naming `name`, where the model
    does not load."""
    try:
        return ort.InferenceSession(
            source, sess_options=options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ValueError(
            f"cannot load {name} as an ONNX model: {one_line(exc, first_line=True)}"
        ) from None


def optimize_encoder(model: bytes) -> bytes:
    """The encoder as onnxruntime optimizes it (ORT_ENABLE_EXTENDED: constant folding and
    operator fusions, which may use onnxruntime's com.microsoft operators; not the
    hardware-specific layout level, which the device adds as it loads it), marked OPTIMIZED_KEY.

    Export-time only: it needs the onnx package, which the device path never imports.
    """
    import tempfile

    import onnx

    with tempfile.TemporaryDirectory(prefix="knnper-optimize-") as tmp:
        options = session_options(1, _SAVED_LEVEL)
        options.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        open_session(model, options, "the encoder")
        proto = onnx.load(options.optimized_model_filepath)
    del proto.metadata_props[:]
    for key, value in {OPTIMIZED_KEY: "extended", "onnxruntime": ort.__version__}.items():
        proto.metadata_props.add(key=key, value=value)
    stamp(proto)
    return proto.SerializeToString()
