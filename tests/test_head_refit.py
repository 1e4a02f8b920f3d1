"""A device refits its linear head after `add`: on the samples its datastore then stores, in the
encoder's Gemm, committed with the datastore (its own file, counted in the budget, outside the
signature), and loaded back as it was committed. Hostile head files are refused at load."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from edge_runtime.bundle import BundleError, write_bundle
from edge_runtime.datastores import make_datastore
from edge_runtime.head_file import head_nbytes, head_tensors
from edge_runtime.knn import interpolate
from edge_runtime.knn_provenance import KNNProvenance
from edge_runtime.linear_head import LinearHead
from edge_runtime.onnx_proto import replace_initializers
from edge_runtime.runtime import Runtime
from edge_runtime.signing import generate_key_pair, load_private_key, load_public_key
from export.personal_encoder import with_linear_head
from tests.helpers.bundles import (
    FIELDS,
    NUM_CLASSES,
    P,
    make_image_encoder,
    make_images,
    raw_outputs,
    snapshot,
)

L2 = 1e-2


def _choice(l2: float | None = L2) -> dict:
    choice = {
        "k": {"value": 5, "source": "flag"},
        "sigma": {"value": 1.0, "source": "flag"},
        "normalize": {"value": "none", "source": "flag"},
        "lambda_estimator": {"value": "val", "source": "flag"},
        "base": {"value": "linear", "source": "validation"},
    }
    if l2 is not None:
        choice["l2"] = {"value": l2, "source": "validation"}
    return choice


def linear_bundle(
    tmp_path: Path,
    recipe: str = "flat:fp32",
    *,
    n: int = 40,
    personal: bool = True,
    signing_key=None,
    budget: int = 10**6,
) -> Path:
    """A bundle as the exporter writes one with the linear base: its encoder's logits are the
    client's linear head, fitted on the samples it stores."""
    shared = make_image_encoder(tmp_path / "shared.onnx")
    x, y = make_images(n, seed=0, signal=60)
    z, _ = raw_outputs(shared, x)
    head = LinearHead(NUM_CLASSES, l2=L2).fit(z, y)
    encoder = with_linear_head(shared, head) if personal else shared.read_bytes()
    ds = make_datastore(recipe, NUM_CLASSES, k=5, sigma=1.0).fit(z, y)
    out = tmp_path / "bundle"
    fields = dataclasses.replace(FIELDS, budget_bytes=budget, knn_choice=KNNProvenance(_choice()))
    write_bundle(out, fields, encoder, ds, signing_key=signing_key)
    return out


@pytest.mark.parametrize("recipe", ["flat:fp32", "flat:int8", "hnsw:M8"])
def test_add_refits_the_head_on_the_stored_samples(tmp_path, recipe):
    bundle = linear_bundle(tmp_path, recipe)
    rt = Runtime.load(bundle)
    x_new, y_new = make_images(12, seed=5, signal=60)
    x_probe, _ = make_images(7, seed=9, signal=60)
    before = rt.embed(x_probe)[1]
    rt.add(x_new, y_new)

    assert "linear_head.1.npz" in rt.manifest.files
    keys, labels = rt.datastore.keys(), rt.datastore.labels_
    expected = LinearHead(NUM_CLASSES, l2=L2).fit(keys, labels)
    z, logits = rt.embed(x_probe)
    np.testing.assert_allclose(logits, z @ expected.coef_ + expected.intercept_, atol=1e-4)
    assert not np.allclose(logits, before, atol=1e-4)  # the head did change
    p_knn, p_base = rt.components(x_probe)
    np.testing.assert_allclose(p_base, expected.predict_proba(z), atol=1e-5)
    np.testing.assert_allclose(rt.posterior(z, logits), interpolate(p_knn, p_base, rt.lam))
    # what was committed is what a fresh load runs
    np.testing.assert_allclose(
        Runtime.load(bundle).predict_proba(x_probe), rt.predict_proba(x_probe), atol=1e-6
    )


def test_the_head_file_is_counted_in_the_footprint_and_replaced_by_the_next_update(tmp_path):
    bundle = linear_bundle(tmp_path)
    rt = Runtime.load(bundle)
    for seed in (5, 6):
        rt.add(*make_images(4, seed=seed, signal=60))
    names = sorted(p.name for p in bundle.iterdir() if p.name.startswith("linear_head"))
    assert names == ["linear_head.2.npz"]
    size = (bundle / "linear_head.2.npz").stat().st_size
    assert size == head_nbytes(P, NUM_CLASSES)
    stored = sum((bundle / n).stat().st_size for n in rt.manifest.files if n != "encoder.onnx")
    assert rt.manifest.footprint.datastore == stored


def test_the_head_takes_its_room_from_the_datastore(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fp = json.loads((linear_bundle(tmp_path / "a") / "manifest.json").read_text())["footprint"]
    # one byte short of the encoder, the first datastore and the head file: the update evicts
    tight = fp["encoder"] + fp["datastore"] + head_nbytes(P, NUM_CLASSES) - 1
    bundle = linear_bundle(tmp_path / "b", budget=tight)
    rt = Runtime.load(bundle)
    report = rt.add(*make_images(3, seed=5, signal=60), strategy="concatenate")
    assert report.evicted >= 1
    assert rt.manifest.footprint.total <= tight


def test_a_refitted_signed_bundle_still_verifies(tmp_path):
    private, public = tmp_path / "key.pem", tmp_path / "key.pub"
    generate_key_pair(private, public)
    bundle = linear_bundle(tmp_path, signing_key=load_private_key(private))
    trusted = [load_public_key(public)]
    rt = Runtime.load(bundle, trusted_keys=trusted)
    rt.add(*make_images(5, seed=5, signal=60))
    again = Runtime.load(bundle, trusted_keys=trusted)
    assert again.manifest.files["encoder.onnx"] == rt.manifest.files["encoder.onnx"]


def test_a_bundle_that_records_no_l2_keeps_the_exported_head(tmp_path):
    bundle = linear_bundle(tmp_path)
    m = json.loads((bundle / "manifest.json").read_text())
    m["knn_choice"] = _choice(l2=None)
    (bundle / "manifest.json").write_text(json.dumps(m))
    rt = Runtime.load(bundle)
    rt.add(*make_images(5, seed=5, signal=60))
    assert not any(n.startswith("linear_head") for n in rt.manifest.files)


def test_an_encoder_without_a_head_is_refused_before_anything_is_written(tmp_path):
    bundle = linear_bundle(tmp_path, personal=False)
    rt = Runtime.load(bundle)
    before = snapshot(bundle)
    with pytest.raises(BundleError, match="no linear head"):
        rt.add(*make_images(5, seed=5, signal=60))
    assert snapshot(bundle) == before


def _with_head_file(bundle: Path, arrays: dict, name: str = "linear_head.1.npz") -> None:
    np.savez(bundle / name, **arrays)
    m = json.loads((bundle / "manifest.json").read_text())
    data = (bundle / name).read_bytes()
    m["files"][name] = hashlib.sha256(data).hexdigest()
    m["footprint"]["datastore"] += len(data)
    m["footprint"]["total"] += len(data)
    (bundle / "manifest.json").write_text(json.dumps(m))


GOOD = {
    "coef": np.zeros((P, NUM_CLASSES), np.float32),
    "intercept": np.zeros(NUM_CLASSES, np.float32),
}


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({**GOOD, "coef": np.zeros((P + 1, NUM_CLASSES), np.float32)}, "not float32"),
        ({**GOOD, "intercept": np.zeros(NUM_CLASSES, np.float64)}, "not float32"),
        ({**GOOD, "coef": np.full((P, NUM_CLASSES), np.nan, np.float32)}, "NaN"),
        ({"coef": GOOD["coef"]}, "holds"),
        ({**GOOD, "extra": np.zeros(1)}, "holds"),
        ({**GOOD, "coef": np.array([object()], dtype=object)}, "linear_head.1.npz"),
        # finite but huge: every prediction was NaN
        ({**GOOD, "coef": np.full((P, NUM_CLASSES), 3e38, np.float32)}, "past float32's range"),
        ({**GOOD, "intercept": np.full(NUM_CLASSES, 3e38, np.float32)}, "past float32's range"),
    ],
)
def test_hostile_head_files_are_refused_at_load(tmp_path, arrays, message):
    bundle = linear_bundle(tmp_path)
    _with_head_file(bundle, arrays)
    with pytest.raises(BundleError, match=message):
        Runtime.load(bundle)


def test_two_head_files_are_refused(tmp_path):
    bundle = linear_bundle(tmp_path)
    _with_head_file(bundle, GOOD)
    _with_head_file(bundle, GOOD, "linear_head.2.npz")
    with pytest.raises(BundleError, match="more than one linear head"):
        Runtime.load(bundle)


def test_a_head_file_left_by_a_crash_is_removed_at_load(tmp_path):
    bundle = linear_bundle(tmp_path)
    np.savez(bundle / "linear_head.7.npz", **GOOD)
    Runtime.load(bundle)
    assert not (bundle / "linear_head.7.npz").exists()


def test_replace_initializers_keeps_everything_else(tmp_path):
    shared = make_image_encoder(tmp_path / "shared.onnx")
    head = LinearHead(NUM_CLASSES, l2=L2).fit(*_blobs())
    model = with_linear_head(shared, head)
    other = LinearHead(NUM_CLASSES, l2=1.0).fit(*_blobs(seed=1))
    replaced = replace_initializers(model, head_tensors(other.coef_, other.intercept_))
    assert len(replaced) == len(model)
    (tmp_path / "m.onnx").write_bytes(replaced)
    x, _ = make_images(5, seed=3)
    z, logits = raw_outputs(tmp_path / "m.onnx", x)
    np.testing.assert_allclose(logits, z @ other.coef_ + other.intercept_, atol=1e-5)
    with pytest.raises(ValueError, match="not"):
        replace_initializers(model, head_tensors(other.coef_[:, :2], other.intercept_))
    with pytest.raises(ValueError, match="no initializer"):
        replace_initializers(model, {"missing": other.intercept_})


def _blobs(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.arange(40) % NUM_CLASSES
    return rng.normal(size=(40, P)) + y[:, None], y


def test_a_failure_opening_the_refitted_session_commits_nothing(tmp_path, monkeypatch):
    """`add` raised after its samples were committed (opening the new session failed), so a
    retry added them twice."""
    import edge_runtime.runtime as runtime_module

    bundle = linear_bundle(tmp_path)
    before = json.loads((bundle / "manifest.json").read_text())
    rt = Runtime.load(bundle)
    x_new, y_new = make_images(12, seed=5, signal=60)

    def broken(*args, **kwargs):
        raise RuntimeError("no session today")

    monkeypatch.setattr(runtime_module, "open_sessions", broken)
    with pytest.raises(RuntimeError, match="no session today"):
        rt.add(x_new, y_new)
    assert json.loads((bundle / "manifest.json").read_text()) == before  # nothing committed
    monkeypatch.undo()
    Runtime.load(bundle).add(x_new, y_new)  # the retry commits the samples, once
    assert "datastore.1.npz" in json.loads((bundle / "manifest.json").read_text())["files"]


def test_a_manifest_listing_the_next_head_file_keeps_it_through_a_failed_commit(
    tmp_path, monkeypatch
):
    """A crafted manifest listing linear_head.<next generation>.npz had that file overwritten
    by the next update's head, and a failed commit left the bundle unloadable."""
    from edge_runtime.manifest import Manifest

    bundle = linear_bundle(tmp_path)
    _with_head_file(bundle, GOOD, name="linear_head.1.npz")  # datastore.npz: generation 0
    kept = (bundle / "linear_head.1.npz").read_bytes()
    x_new, y_new = make_images(12, seed=5, signal=60)

    def refuse(manifest, *args):
        raise BundleError("the updated manifest: refused for the test")

    monkeypatch.setattr(Manifest, "with_datastore", refuse)
    with pytest.raises(BundleError, match="refused for the test"):
        Runtime.load(bundle).add(x_new, y_new)
    monkeypatch.undo()
    assert (bundle / "linear_head.1.npz").read_bytes() == kept
    Runtime.load(bundle)  # still loads
