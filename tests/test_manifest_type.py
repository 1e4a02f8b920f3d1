"""A bundle's manifest is a type (edge_runtime.manifest.Manifest): code reads attributes, the field
policy lives on it, and what it writes back is the bytes it read."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from edge_runtime.bundle import read_manifest, write_bundle
from edge_runtime.datastores import FlatDatastore
from edge_runtime.knn_provenance import Chosen, KNNProvenance
from edge_runtime.manifest import BundleFields, Footprint, Manifest, parse_manifest
from edge_runtime.preprocess import InputSpec
from tests.helpers.bundles import IMAGE_SPEC, NUM_CLASSES, P, make_image_encoder

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("edge_runtime", "protonn", "fed_train", "export", "experiments", "knnper_cli")


def manifest_string_reads() -> list[str]:
    """Every `X["key"]` / `X.get("key")` whose receiver X is named like a manifest
    (manifest, rt.manifest, ...) or is a manifest's input spec or kNN choice record
    (`like.input`, `m.knn_choice`), outside edge_runtime/manifest.py."""
    found = []
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    for path in [*paths, *sorted((ROOT / "benchmarks").glob("*.py"))]:
        where = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if where == "edge_runtime/manifest.py" or "manifest" not in text:
            continue
        for node in ast.walk(ast.parse(text, where)):
            if isinstance(node, ast.Subscript):
                receiver, key = node.value, node.slice
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and node.args
            ):
                receiver, key = node.func.value, node.args[0]
            else:
                continue
            name = receiver.attr if isinstance(receiver, ast.Attribute) else ""
            name = receiver.id if isinstance(receiver, ast.Name) else name
            member = isinstance(receiver, ast.Attribute) and name in ("input", "knn_choice")
            if (
                ("manifest" in name.lower() or member)
                and isinstance(key, ast.Constant)
                and isinstance(key.value, str)
            ):
                found.append(f"{where}:{node.lineno}: {name}[{key.value!r}]")
    return found


def test_no_code_reads_a_manifest_by_string_key():
    assert manifest_string_reads() == []
    # and a Manifest cannot be read so: it has attributes, not keys
    assert not hasattr(Manifest, "__getitem__") and not hasattr(Manifest, "get")


def test_the_input_spec_and_the_knn_choice_are_typed_members_written_back_as_read(tmp_path):
    """Both were dicts read by string key (`spec["shape"]`, `knn_choice["base"]["value"]`)."""
    z, y = np.random.default_rng(0).normal(size=(40, P)).astype(np.float32), np.arange(40) % 4
    choice = {
        "k": {"value": 5, "source": "validation"},
        "sigma": {"value": 1.0, "source": "paper default"},
        "normalize": {"value": "none", "source": "flag"},
        "lambda_estimator": {"value": "val", "source": "validation"},
        "base": {"value": "linear", "source": "validation"},
        "l2": {"value": 0.01, "source": "validation"},
    }
    fields = BundleFields(3, InputSpec(IMAGE_SPEC), 0.3, 10**6, knn_choice=KNNProvenance(choice))
    encoder = make_image_encoder(tmp_path / "encoder.onnx")
    write_bundle(tmp_path / "b", fields, encoder, FlatDatastore(NUM_CLASSES, k=5).fit(z, y))
    raw = (tmp_path / "b" / "manifest.json").read_bytes()
    manifest = parse_manifest(raw, "manifest.json")
    assert (manifest.input.kind, manifest.input.shape, manifest.input.dtype) == (
        "image",
        (8, 8, 1),
        "uint8",
    )
    assert manifest.input.mean == (0.5,) and manifest.input.vocab_size is None
    assert manifest.knn_choice.base == Chosen("linear", "validation")
    assert manifest.knn_choice.lambda_rule is None and manifest.refit_l2 == 0.01
    assert manifest.input.to_json() == IMAGE_SPEC and manifest.knn_choice.to_json() == choice
    assert (json.dumps(manifest.to_json(), indent=2) + "\n").encode() == raw
    with pytest.raises(ValueError, match="'vocab_size' must be a positive integer"):
        InputSpec({"kind": "tokens", "shape": [5], "vocab_size": 0})
    with pytest.raises(ValueError, match="'l2' must be a positive number"):
        KNNProvenance({**choice, "base": {"value": "global", "source": "flag"}})


def _bundle(tmp_path: Path) -> Path:
    import numpy as np

    rng = np.random.default_rng(0)
    z, y = rng.normal(size=(40, P)).astype(np.float32), np.arange(40) % NUM_CLASSES
    encoder = make_image_encoder(tmp_path / "encoder.onnx")
    fields = BundleFields(3, InputSpec(IMAGE_SPEC), 0.3, 10**6)
    out = tmp_path / "bundle"
    write_bundle(out, fields, encoder, FlatDatastore(NUM_CLASSES, k=5).fit(z, y))
    return out


def test_a_manifest_is_written_back_in_the_bytes_it_was_read(tmp_path):
    raw = (_bundle(tmp_path) / "manifest.json").read_bytes()
    manifest = parse_manifest(raw, "manifest.json")
    assert (json.dumps(manifest.to_json(), indent=2) + "\n").encode() == raw
    assert manifest.k == 5 and manifest.lam == 0.3 and manifest.client_id == 3
    assert manifest.footprint == Footprint(**json.loads(raw)["footprint"])
    assert manifest.budget.total == 10**6 and manifest.budget.encoder == manifest.footprint.encoder
    assert manifest.model is None and manifest.base == "global" and manifest.refit_l2 is None


def test_an_attribute_read_cannot_change_the_manifest(tmp_path):
    manifest = read_manifest(_bundle(tmp_path))
    manifest.input.to_json()["shape"].append(99)
    manifest.files.clear()
    manifest.params["n"] = 1
    assert manifest == read_manifest(tmp_path / "bundle")
    with pytest.raises(AttributeError):
        manifest.json = {}


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"lambda": 0.9}, "'lambda'"),
        ({"files": {"encoder.onnx": "0" * 64}}, "the encoder's sha256"),
        ({"footprint": {"encoder": 1}}, "the encoder's footprint"),
    ],
)
def test_what_an_update_may_change_of_a_signed_manifest_is_the_type_s(tmp_path, change, what):
    base = read_manifest(_bundle(tmp_path))
    data = base.to_json()
    for key, value in change.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    assert Manifest(data).departure_from(base) == what
    # the datastore's files and its sample count are the device's to change
    data = base.to_json()
    data["files"] = {**data["files"], "datastore.1.npz": "1" * 64}
    data["backend"] = {**data["backend"], "params": {**data["backend"]["params"], "n": 7}}
    assert Manifest(data).departure_from(base) is None
