"""Tiny device bundles for the edge-runtime tests: 8x8 grey images, ONNX encoders built with
onnx.helper, datastores fitted on their embeddings. Small enough that a test builds its own."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edge_runtime.bundle import write_bundle
from edge_runtime.datastores import make_datastore
from edge_runtime.manifest import BundleFields
from edge_runtime.preprocess import InputSpec, prepare_input

REPO = Path(__file__).resolve().parents[2]
H, W, C_IN, P, NUM_CLASSES = 8, 8, 1, 6, 4
IMAGE_SPEC = {
    "kind": "image",
    "shape": [H, W, C_IN],
    "dtype": "uint8",
    "mean": [0.5],
    "std": [0.25],
}
TOKEN_SPEC = {"kind": "tokens", "shape": [5], "dtype": "int64", "vocab_size": 11}


def make_image_encoder(
    path: Path,
    *,
    p: int = P,
    classes: int = NUM_CLASSES,
    seed: int = 0,
    output_names: tuple[str, str] = ("embedding", "logits"),
) -> Path:
    """A tiny MLP as ONNX: flatten -> linear -> tanh = embedding; linear = logits."""
    rng = np.random.default_rng(seed)
    d = H * W * C_IN
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (d, p)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.1, (p,)).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.normal(0, 1.0, (p, classes)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.zeros(classes, np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("Flatten", ["input"], ["flat"], axis=1),
        helper.make_node("MatMul", ["flat", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Tanh", ["hb"], [output_names[0]]),
        helper.make_node("MatMul", [output_names[0], "w2"], ["l"]),
        helper.make_node("Add", ["l", "b2"], [output_names[1]]),
    ]
    graph = helper.make_graph(
        nodes,
        "enc",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", C_IN, H, W])],
        [
            helper.make_tensor_value_info(output_names[0], TensorProto.FLOAT, ["N", p]),
            helper.make_tensor_value_info(output_names[1], TensorProto.FLOAT, ["N", classes]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def make_token_encoder(path: Path, *, p: int = P, classes: int = NUM_CLASSES) -> Path:
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(rng.normal(size=(11, p)).astype(np.float32), "emb"),
        numpy_helper.from_array(rng.normal(size=(p, classes)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Gather", ["emb", "input"], ["g"]),
        helper.make_node("ReduceMean", ["g"], ["embedding"], axes=[1], keepdims=0),
        helper.make_node("MatMul", ["embedding", "w2"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tok",
        [helper.make_tensor_value_info("input", TensorProto.INT64, ["N", 5])],
        [
            helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", p]),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def make_images(n: int, seed: int = 0, signal: int = 180) -> tuple[np.ndarray, np.ndarray]:
    """Class-dependent bright quadrant plus noise: easy enough for a kNN on random features
    (a weak `signal` makes it hard)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, NUM_CLASSES, n)
    x = rng.integers(0, 60, (n, H, W, C_IN))
    for i, label in enumerate(y):
        r, c = divmod(int(label), 2)
        x[i, r * 4 : r * 4 + 4, c * 4 : c * 4 + 4] += signal
    return x.astype(np.uint8), y.astype(np.int64)


def raw_outputs(encoder_path: Path, x: np.ndarray, spec: dict = IMAGE_SPEC):
    """Encoder outputs straight from onnxruntime, for hand computations."""
    sess = ort.InferenceSession(str(encoder_path), providers=["CPUExecutionProvider"])
    return sess.run(["embedding", "logits"], {"input": prepare_input(x, spec)})


FIELDS = BundleFields(3, InputSpec(IMAGE_SPEC), 0.5, 10**6)


def build_bundle(
    tmp_path: Path,
    recipe: str = "flat:fp32",
    *,
    n: int = 60,
    name: str = "bundle",
    strategy: str = "fifo",
    budget: int = 10**6,
    seed: int = 0,
) -> Path:
    enc = tmp_path / "encoder.onnx"
    if not enc.exists():
        make_image_encoder(enc)
    x, y = make_images(n, seed)
    z, _ = raw_outputs(enc, x)
    ds = make_datastore(recipe, NUM_CLASSES, k=5, sigma=1.0).fit(z, y)
    out = tmp_path / name
    fields = dataclasses.replace(FIELDS, budget_bytes=budget, update_strategy=strategy)
    write_bundle(out, fields, enc, ds)
    return out


def snapshot(directory: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def rewrite_manifest(bundle: Path, **changes) -> None:
    """Edit a bundle's manifest.json in place, behind the runtime's back."""
    m = json.loads((bundle / "manifest.json").read_text())
    m.update(changes)
    (bundle / "manifest.json").write_text(json.dumps(m, indent=2))
