"""One ONNX graph for a whole bundle: input normalisation, the encoder, the datastore's posterior
and the lambda interpolation, for devices that run ONNX Runtime but not Python (a phone, a
browser, a board with the C API).

    knnper-edge export-onnx BUNDLE --out predictor.onnx [--keys-as-inputs]
    knnper-edge export-onnx BUNDLE --out predictor.ort --format ort   (mobile: ort_format.py)

Graph inputs: "input", raw inputs as the bundle's manifest declares them (uint8 images
[N, H, W, C] or int64 token ids [N, L]). Outputs: "probabilities" [N, C] float32, what
`Runtime.predict_proba` gives, and "key" [N, q] float32, what a device stores for an input once
its label is known (the embedding for flat datastores, the projected embedding W z for ProtoNN);
also the encoder's "embedding" and "logits".

Self-contained by default: keys and labels are initializers. With keys_as_inputs the graph also
takes "keys" [n, q] float32 and "labels" [n] int64 (flat: the stored samples; ProtoNN: its
buffer of samples learned on the device, beside the prototypes baked in), so an app keeps
learning in any language; the bundle's current ones are written beside the graph (raw
little-endian files, see `write_portable`), with the app's contract in <out>.app.json.

The app contract, which makes an app learn as `Runtime.add` does: for each labelled input,
append the graph's "key" output (already in the stored form: an int8 bundle's key is
re-quantised with the datastore's per-dimension scale, an fp16 one rounded to float16) and the
label after the current keys and labels, then drop the oldest (first) rows until at most
"capacity" remain (`Runtime.kept_by_add`: the fifo size or what the budget holds); under the
"fixed" strategy append nothing. A bundle whose base is a linear head that `add` refits on the
stored keys is refused: the graph cannot refit that head, so its appended keys would change
less than `add` does.

The graph comes from `predictor_graph.build_predictor`, the builder of the runtime's own single
session (int8 keys go through onnxruntime's integer kernels, prepacked when baked in). The onnx
package is used here only to check the model before writing it. HNSW has no ONNX form (a graph
walk with data-dependent control flow), so it is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ._io import json_bytes, output_problem, output_target, write_files_atomic
from .bundle import BundleError, encoder_model
from .head_file import refits
from .ort_format import CONFIG_SUFFIX, MODEL_FORMATS, to_ort
from .predictor_graph import build_predictor, graph_backends
from .runtime import Runtime

# beside <out>.onnx with --keys-as-inputs: the keys, the labels, the app's contract
SIDE_FILES = (".keys.f32", ".labels.i64", ".app.json")


def build_portable(runtime: Runtime, *, keys_as_inputs: bool = False) -> bytes:
    """The predictor of a loaded (verified) bundle, as ONNX model bytes."""
    backend = runtime.datastore.backend
    if runtime.datastore.ONNX_FORM is None:
        raise BundleError(
            f"bundle {runtime.path}: a {backend} datastore has no ONNX form; export the client "
            f"with a {' or '.join(graph_backends())} datastore"
        )
    if keys_as_inputs and runtime.manifest.refit_l2 is not None and refits(runtime.datastore):
        raise BundleError(
            f"bundle {runtime.path}: --keys-as-inputs cannot follow `add` here: its base is a "
            "linear head that `add` refits on the stored keys, which the graph cannot refit"
        )
    try:
        return build_predictor(
            runtime.manifest,
            runtime.datastore,
            # read and hashed again (it could have been replaced since the runtime loaded it),
            # with the device's refitted linear head when it has one
            encoder_model(runtime.path, runtime.manifest),
            samples="portable" if keys_as_inputs else "constant",
        )
    except ValueError as exc:
        raise BundleError(f"bundle {runtime.path}: {exc}") from None


def write_portable(
    runtime: Runtime,
    out: str | os.PathLike,
    *,
    keys_as_inputs: bool = False,
    model_format: str = "onnx",
) -> list[Path]:
    """Build a loaded bundle's predictor, check it with onnx's checker and write it to `out`
    atomically.

    Parameters
    ----------
    runtime : a loaded bundle (`Runtime.load`) whose encoder and datastore the predictor holds.
    out : the .onnx (or .ort) file to write; it may not lie inside the bundle. The side files
        beside it may not either, nor be links: all are checked before any is written, and all are
        written or none (`write_files_atomic`).
    keys_as_inputs : the keys and labels become the model's inputs instead of constants, and
        are written beside it: <out>.keys.f32 ([n, q] float32), <out>.labels.i64 ([n] int64)
        and <out>.app.json (`app_contract`), so an app keeps learning in any language.
    model_format : "onnx", or "ort": onnxruntime's ORT format for its mobile and minimal builds
        (`ort_format.to_ort`), with <out>.required_operators.config for a reduced build.

    Returns
    -------
    list of Path : the files written, `out` first.
    """
    import onnx

    if model_format not in MODEL_FORMATS:
        raise ValueError(f"format must be one of {', '.join(MODEL_FORMATS)}, got {model_format}")
    if Path(out).suffix != f".{model_format}":
        raise ValueError(f"--out must end in .{model_format}, got {out}")
    out = output_target(out)  # a regular file or a link to one (written through), or new
    suffixes = (SIDE_FILES if keys_as_inputs else ()) + (
        (CONFIG_SUFFIX,) if model_format == "ort" else ()
    )
    targets = [out, *(Path(f"{out}{suffix}") for suffix in suffixes)]
    _check_targets(targets, runtime.path)
    model = build_portable(runtime, keys_as_inputs=keys_as_inputs)
    onnx.checker.check_model(onnx.load_from_string(model))
    operators = None
    if model_format == "ort":
        model, operators = to_ort(model)
    contents = [model]
    if keys_as_inputs:
        keys, labels = portable_samples(runtime)
        contents += [
            np.ascontiguousarray(keys, dtype="<f4").tobytes(),
            np.ascontiguousarray(labels, dtype="<i8").tobytes(),
            json_bytes(app_contract(runtime)),
        ]
    if operators is not None:
        contents.append(operators.encode())
    write_files_atomic(list(zip(targets, contents, strict=True)))
    return targets


def _check_targets(targets: list[Path], bundle: Path) -> None:
    """Refuse, before anything is written, every target that lies in the bundle (through a link
    too: over its encoder.onnx or datastore.npz a device would lose what it learned) and every
    side file that is a link or not a regular file: the side files' names are derived, not
    chosen, so a link planted there is never written through."""
    inside = bundle.resolve()
    for path in targets:
        if path is not targets[0]:
            if os.path.islink(path):
                raise ValueError(
                    f"{path} is a link; export-onnx writes its side files only as new or "
                    "regular files (remove the link or choose another --out)"
                )
            problem = output_problem(path)
            if problem:
                raise ValueError(problem)
        if path.resolve().is_relative_to(inside):
            raise ValueError(f"--out {path} is inside the bundle {bundle}; write it elsewhere")


def portable_samples(runtime: Runtime) -> tuple[np.ndarray, np.ndarray]:
    """(keys [n, q] float32, labels [n] int64): what a keys-as-inputs graph takes for this
    bundle now (flat: every stored sample, as the search sees it; ProtoNN: its buffer)."""
    return runtime.datastore.graph_samples()


def app_contract(runtime: Runtime) -> dict:
    """How an app keeps learning as `Runtime.add` does (see the module docstring): the update
    strategy, the most keys kept after an update, the key width, the rule in words, and the
    raw input the graph takes (the manifest's input spec) with the number of classes."""
    strategy = runtime.manifest.update_strategy
    keys, _ = portable_samples(runtime)
    rule = (
        "append nothing: 'fixed' keeps the stored keys"
        if strategy == "fixed"
        else 'append each labelled input\'s "key" output and its label after the current keys '
        "and labels, then drop the oldest (first) rows until at most `capacity` remain"
    )
    return {
        "update_strategy": strategy,
        "capacity": runtime.kept_by_add(),
        "key_dim": int(keys.shape[1]),
        "rule": rule,
        "input": runtime.input_spec.to_json(),
        "num_classes": runtime.num_classes,
    }
