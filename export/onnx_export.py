"""Convert a trained embed/head model to ONNX with the two outputs a device bundle needs,
"embedding" and "logits", and check the file against torch before anyone ships it."""

from __future__ import annotations

import copy
import io
import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from edge_runtime._io import write_bytes_atomic
from edge_runtime.knn import NORMALIZATIONS, normalize_embeddings
from export.errors import ExportError

log = logging.getLogger(__name__)

INPUT_NAME = "input"
OUTPUT_NAMES = ("embedding", "logits")
DEFAULT_OPSET = 17
# fp32 ONNX against fp32 torch: kernels differ only in summation order.
FP32_TOLERANCE = 1e-4


def on_cpu(model: nn.Module) -> nn.Module:
    """`model`, or a CPU copy of it when it sits on an accelerator: tracing, onnxruntime and
    numpy all read host memory, and the caller's model stays where it trains."""
    if all(t.device.type == "cpu" for t in model.state_dict().values()):
        return model
    return copy.deepcopy(model).cpu()


def encoder_nbytes_floor(model: nn.Module, quantize: str) -> int:
    """The fewest bytes the model's encoder file can take, known before it is exported: every
    weight matrix and kernel (a parameter of two or more dimensions) is stored in it, at one
    byte per element at least in int8 and four in float32. A budget below this cannot hold the
    encoder whatever the export does, so it is refused before that work (the exact size is
    checked once the encoder is written)."""
    per_element = 1 if quantize == "int8" else 4
    return per_element * sum(p.numel() for p in model.parameters() if p.dim() >= 2)


class EmbedLogits(nn.Module):
    """(embed(x), head(embed(x))) as one graph, so the device gets both from a single run. With
    `normalize="l2"` the "embedding" output is L2-normalised in the graph (the logits still come
    from the raw embedding): kNN-Per's chosen normalisation then needs nothing from the runtime,
    the datastore's keys and the portable predictor included."""

    def __init__(self, model: nn.Module, normalize: str = "none") -> None:
        super().__init__()
        if normalize not in NORMALIZATIONS:
            raise ExportError(
                f"unknown embedding normalisation {normalize!r}; known: {', '.join(NORMALIZATIONS)}"
            )
        self.model = model
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.model.embed(x)
        out = nn.functional.normalize(z, dim=1, eps=1e-12) if self.normalize == "l2" else z
        return out, self.model.head(z)


def export_onnx(
    model: nn.Module,
    example: np.ndarray | torch.Tensor,
    path: str | Path,
    *,
    opset: int = DEFAULT_OPSET,
    atol: float = FP32_TOLERANCE,
    normalize: str = "none",
) -> float:
    """Write `model` as ONNX to `path` (one self-contained file, dynamic batch axis), validate it
    with onnx.checker and compare it with torch on `example` (a batch of prepared inputs);
    returns the largest absolute difference found.

    Uses torch's TorchScript exporter (`dynamo=False`): on these models it takes well under a
    second and writes a single file, where the dynamo exporter took seconds and split the
    weights into an external-data file by default. Raises ExportError when the exported graph
    disagrees with torch by more than `atol`.
    """
    path = Path(path)
    model = on_cpu(model)
    example_t = torch.as_tensor(np.asarray(example))
    if example_t.ndim < 1 or example_t.shape[0] == 0:
        raise ExportError("export needs a non-empty example batch to trace the model")
    wrapper = EmbedLogits(model, normalize).eval()
    buffer = io.BytesIO()
    dynamic = {name: {0: "batch"} for name in (INPUT_NAME, *OUTPUT_NAMES)}
    try:
        with warnings.catch_warnings():
            # The TorchScript exporter is deprecated in favour of dynamo, which we do not need.
            warnings.simplefilter("ignore")
            with torch.no_grad():
                torch.onnx.export(
                    wrapper,
                    (example_t,),
                    buffer,
                    input_names=[INPUT_NAME],
                    output_names=list(OUTPUT_NAMES),
                    dynamic_axes=dynamic,
                    opset_version=opset,
                    dynamo=False,
                )
    except Exception as err:  # the exporter raises many types for unsupported models
        raise ExportError(f"torch could not export the model to ONNX: {err}") from err
    proto = onnx.load_from_string(buffer.getvalue())
    try:
        onnx.checker.check_model(proto, full_check=True)
    except onnx.checker.ValidationError as err:
        raise ExportError(f"the exported ONNX model is invalid: {err}") from err
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, buffer.getvalue())
    diff = compare_with_torch(model, path, example, normalize)
    if not diff <= atol:
        raise ExportError(
            f"the ONNX model differs from torch by {diff:.3g} (> {atol:g}) on the "
            "example batch; the exporter mistranslated an operator"
        )
    # by name: the file may be in a temporary folder that is gone by the time anyone reads this
    log.info(
        "exported %s (%d bytes, max |onnx - torch| = %.2g)", path.name, path.stat().st_size, diff
    )
    return diff


def run_onnx(
    path: str | Path | bytes, x: np.ndarray, batch_size: int = 512
) -> tuple[np.ndarray, np.ndarray]:
    """(embedding, logits) of an ONNX encoder on prepared inputs, in batches, one CPU thread
    per op (the machines this runs on are shared; devices are single-core anyway)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    source = path if isinstance(path, bytes) else str(path)
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    zs, ls = [], []
    for start in range(0, len(x), batch_size):
        z, logits = session.run(
            list(OUTPUT_NAMES), {INPUT_NAME: np.ascontiguousarray(x[start : start + batch_size])}
        )
        zs.append(z)
        ls.append(logits)
    if not zs:
        out = session.get_outputs()
        return (
            np.zeros((0, out[0].shape[1]), np.float32),
            np.zeros((0, out[1].shape[1]), np.float32),
        )
    return np.concatenate(zs), np.concatenate(ls)


def compare_with_torch(
    model: nn.Module, path: str | Path, x: np.ndarray | torch.Tensor, normalize: str = "none"
) -> float:
    """Largest absolute difference between the ONNX file's outputs and torch's, both outputs."""
    x_np = np.asarray(x)
    z, logits = run_onnx(path, x_np)
    with torch.no_grad():
        model.eval()
        zt = model.embed(torch.as_tensor(x_np))
        lt = model.head(zt)
    expected = normalize_embeddings(zt.numpy(), normalize)
    return float(max(np.abs(z - expected).max(), np.abs(logits - lt.numpy()).max()))
