"""Edge runtime: bundle verification, personalized prediction, on-device updates, crash safety,
device init and the knnper-edge CLI. Everything is tiny (8x8 grey images, ONNX encoders built
with onnx.helper) so the whole file runs in seconds."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from edge_runtime.bundle import (
    BundleError,
    read_manifest,
    write_bundle,
)
from edge_runtime.cli import main
from edge_runtime.datastores import (
    FlatDatastore,
    HNSWDatastore,
    ProtoNNDatastore,
    format_recipe,
    make_datastore,
    parse_recipe,
    recipe_without,
)
from edge_runtime.device_choice import InitSettings
from edge_runtime.device_init import init_bundle
from edge_runtime.encoder import Encoder
from edge_runtime.knn import KNNHead, exact_search, interpolate, softmax
from edge_runtime.preprocess import InputSpec
from edge_runtime.runtime import Runtime
from tests.helpers.bundles import (
    C_IN,
    FIELDS,
    IMAGE_SPEC,
    NUM_CLASSES,
    REPO,
    TOKEN_SPEC,
    H,
    P,
    W,
    build_bundle,
    make_image_encoder,
    make_images,
    make_token_encoder,
    raw_outputs,
    snapshot,
)

# hnsw datastores need the `hnsw` extra; the device tests also run on a runtime-only install
# (.ci/device_pythons), where these skip with this reason
needs_hnswlib = pytest.mark.skipif(
    importlib.util.find_spec("hnswlib") is None, reason="hnswlib (the hnsw extra) is not installed"
)


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return build_bundle(tmp_path)


# ----------------------------------------------------------------------------- no torch on device


def test_loading_and_predicting_never_imports_torch_sklearn_or_edgeml(bundle, tmp_path):
    x, _ = make_images(5, 1)
    np.save(tmp_path / "x.npy", x)
    code = textwrap.dedent(f"""
        import sys
        from edge_runtime.runtime import Runtime
        from edge_runtime.cli import main
        import numpy as np
        rt = Runtime.load({str(bundle)!r})
        rt.predict(np.load({str(tmp_path / "x.npy")!r}))
        assert main(["predict", {str(bundle)!r}, "--input", {str(tmp_path / "x.npy")!r}]) == 0
        bad = sorted(m for m in sys.modules if m.split(".")[0] in
                     ("torch", "sklearn", "edgeml", "scipy", "onnx", "hnswlib",
                      "fed_train", "export", "protonn"))
        print("FORBIDDEN", bad)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "FORBIDDEN []" in out.stdout


# ----------------------------------------------------------------------------- prediction


def test_predictions_equal_encoder_plus_knn_head_plus_interpolation(bundle, tmp_path):
    rt = Runtime.load(bundle)
    x_store, y_store = make_images(60, 0)
    z_store, _ = raw_outputs(tmp_path / "encoder.onnx", x_store)
    x, _ = make_images(25, 7)
    z, logits = raw_outputs(tmp_path / "encoder.onnx", x)
    head = KNNHead(NUM_CLASSES, k=5, sigma=1.0).fit(z_store, y_store)
    expected = interpolate(head.predict_proba(z), softmax(logits), 0.5)
    np.testing.assert_allclose(rt.predict_proba(x), expected, atol=1e-6)
    np.testing.assert_array_equal(rt.predict(x), expected.argmax(1))


def test_single_sample_is_a_batch_of_one(bundle):
    rt = Runtime.load(bundle)
    x, _ = make_images(3, 2)
    single = rt.predict_proba(x[1])
    assert single.shape == (1, NUM_CLASSES)
    np.testing.assert_allclose(single[0], rt.predict_proba(x)[1], atol=1e-6)
    np.testing.assert_allclose(rt.predict_proba(x[1, :, :, 0]), single, atol=1e-6)  # grey HW


def test_lambda_zero_is_global_model(tmp_path):
    out = build_bundle(tmp_path)
    m = read_manifest(out).to_json()
    m["lambda"] = 0.0
    (out / "manifest.json").write_text(json.dumps(m))
    x, _ = make_images(10, 3)
    _, logits = raw_outputs(tmp_path / "encoder.onnx", x)
    np.testing.assert_allclose(Runtime.load(out).predict_proba(x), softmax(logits), atol=1e-6)


def test_token_inputs(tmp_path):
    enc = make_token_encoder(tmp_path / "tok.onnx")
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 11, (30, 5)), rng.integers(0, NUM_CLASSES, 30)
    z, _ = raw_outputs(enc, x, TOKEN_SPEC)
    ds = FlatDatastore(NUM_CLASSES, k=3).fit(z, y)
    write_bundle(tmp_path / "b", dataclasses.replace(FIELDS, input=InputSpec(TOKEN_SPEC)), enc, ds)
    rt = Runtime.load(tmp_path / "b")
    assert rt.predict(x[:4]).shape == (4,)
    assert rt.predict_proba(x[0]).shape == (1, NUM_CLASSES)
    with pytest.raises(ValueError, match="token ids must be in"):
        rt.predict(np.full((2, 5), 11))


def test_exact_search_blockwise_matches_full_partition():
    rng = np.random.default_rng(0)
    for n in (7, 640, 5000, 20_011):
        keys = rng.normal(size=(n, 16)).astype(np.float32)
        q = rng.normal(size=(9, 16)).astype(np.float32)
        sq, idx = exact_search(q, keys, 10)
        full = ((q[:, None, :] - keys[None]) ** 2).sum(-1)
        ref = np.argsort(full, axis=1, kind="stable")[:, : min(10, n)]
        np.testing.assert_array_equal(idx, ref)
        np.testing.assert_allclose(sq, np.take_along_axis(full, ref, 1), rtol=1e-4, atol=1e-4)
        norms = np.einsum("ij,ij->i", keys, keys)
        sq2, idx2 = exact_search(q, keys, 10, key_norms=norms)
        np.testing.assert_array_equal(idx2, idx)
        np.testing.assert_array_equal(sq2, sq)
    # many equal distances: the same distances as a full sort, ties listed in index order
    keys = np.repeat(rng.normal(size=(50, 4)).astype(np.float32), 100, axis=0)
    q = keys[[0, 2500]] + 0.01
    sq, idx = exact_search(q, keys, 10)
    full = ((q[:, None, :] - keys[None]) ** 2).sum(-1)
    np.testing.assert_allclose(sq, np.sort(full, axis=1)[:, :10], rtol=1e-4, atol=1e-5)
    assert np.all(np.diff(idx, axis=1) > 0)


# ----------------------------------------------------------------------------- datastores


def _embeddings(n: int = 400, dim: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(NUM_CLASSES, dim)) * 2
    y = rng.integers(0, NUM_CLASSES, n)
    return (centers[y] + rng.normal(size=(n, dim))).astype(np.float32), y


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_flat_compressed_keys_are_close_to_fp32(dtype, tmp_path):
    z, y = _embeddings()
    q, _ = _embeddings(100, seed=1)
    ref = FlatDatastore(NUM_CLASSES, k=10).fit(z, y).predict_proba(q)
    ds = FlatDatastore(NUM_CLASSES, k=10, dtype=dtype).fit(z, y)
    got = ds.predict_proba(q)
    # a neighbour at the k-th rank may change; on average the posterior barely moves
    assert np.abs(got - ref).mean() < (2e-3 if dtype == "fp16" else 0.02)
    assert np.mean(got.argmax(1) == ref.argmax(1)) >= 0.97
    # What a device loads back is exactly what the exporter validated.
    names = ds.save(tmp_path)
    arrays = np.load(tmp_path / names[0])
    assert arrays["keys"].dtype == {"fp16": np.float16, "int8": np.int8}[dtype]
    back = FlatDatastore.load(tmp_path, {"num_classes": NUM_CLASSES, "k": 10, "dtype": dtype})
    np.testing.assert_array_equal(back.predict_proba(q), got)


def test_int8_values_beyond_the_fitted_scale_are_clipped():
    z, y = _embeddings(50)
    ds = FlatDatastore(NUM_CLASSES, dtype="int8").fit(z, y)
    ds.add(z[:1] * 100, y[:1])
    assert np.all(np.abs(ds.keys()[-1]) <= ds.scale_ * 127 + 1e-6)


@needs_hnswlib
def test_hnsw_recall_against_exact_and_squared_distances(tmp_path):
    z, y = _embeddings(2000, 16)
    q, _ = _embeddings(200, 16, seed=3)
    ds = HNSWDatastore(NUM_CLASSES, k=10, M=16, ef=64).fit(z, y)
    sq, found = ds.kneighbors(q)  # ids are insertion stamps = row numbers after fit
    _, exact_idx = exact_search(q, z, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found, exact_idx, strict=True)])
    assert recall >= 0.9
    direct = ((q[:, None, :] - z[found]) ** 2).sum(-1)
    np.testing.assert_allclose(sq, direct, rtol=1e-4, atol=1e-4)  # "l2" is squared
    exact_p = FlatDatastore(NUM_CLASSES, k=10).fit(z, y).predict_proba(q)
    assert np.mean(ds.predict_proba(q).argmax(1) == exact_p.argmax(1)) >= 0.95
    names = ds.save(tmp_path)
    back = HNSWDatastore.load(
        tmp_path, {"num_classes": NUM_CLASSES, "k": 10}, files=names, embedding_dim=16
    )
    np.testing.assert_allclose(back.predict_proba(q), ds.predict_proba(q))


@needs_hnswlib
def test_hnsw_distances_do_not_depend_on_hnswlibs_own_sums(monkeypatch):
    """hnswlib sums a distance in its build's SIMD order (other on ARM than on x86): the
    neighbours it finds are measured again in a fixed order, so a CPU whose hnswlib rounds
    otherwise gives the same squared distances, bit for bit, and the same probabilities."""
    z, y = _embeddings(300, 24)
    q, _ = _embeddings(40, 24, seed=5)
    ds = HNSWDatastore(NUM_CLASSES, k=7).fit(z, y)
    sq, found = ds.kneighbors(q)
    p = ds.predict_proba(q)
    query = ds.index_.knn_query

    def rounded_otherwise(x, k, num_threads):  # another CPU's last bits
        labels, distances = query(x, k=k, num_threads=num_threads)
        return labels, np.nextafter(distances, np.float32(np.inf))

    monkeypatch.setattr(ds, "index_", _Wrapped(ds.index_, knn_query=rounded_otherwise))
    sq2, found2 = ds.kneighbors(q)
    np.testing.assert_array_equal(found2, found)
    np.testing.assert_array_equal(sq2, sq)
    np.testing.assert_array_equal(ds.predict_proba(q), p)
    want = ((q[:, None, :].astype(np.float64) - z[found].astype(np.float64)) ** 2).sum(-1)
    np.testing.assert_allclose(sq, want, rtol=1e-6)


@needs_hnswlib
@pytest.mark.parametrize("k", [1, 7])
def test_hnsw_neighbours_do_not_depend_on_hnswlibs_ranking(monkeypatch, k):
    """A CPU whose hnswlib rounds its sums otherwise ranks candidates at nearly the same
    distance another way round (measured: MobileNet-v2-gn's HNSW bundle on emulated ARM lost
    its 10th neighbour to the 11th, 3e-8 further) and lists tied ones in another order: here
    its distances are moved within float32's rounding of a 24-term sum and its candidates
    ranked by them, over near-twin keys (the nearest two nearly tied) and exact twins; the k
    nearest, their order and the probabilities stay the same, bit for bit."""
    rng = np.random.default_rng(7)
    z, y = _embeddings(300, 24)
    z[150:200] = z[100:150]  # exact twins
    z[200:250] = z[100:150] + rng.choice([-3e-7, 3e-7], size=(50, 24)).astype(np.float32)
    q = np.concatenate([_embeddings(40, 24, seed=5)[0], z[100:120] + 1e-2])
    ds = HNSWDatastore(NUM_CLASSES, k=k).fit(z, y)
    sq, found = ds.kneighbors(q)
    p = ds.predict_proba(q)
    query = ds.index_.knn_query

    def rounded_otherwise(x, k, num_threads):  # the same candidates, another CPU's ranking
        labels, distances = query(x, k=min(k + 4, len(ds)), num_threads=num_threads)
        moved = distances * (1 + 1e-6 * np.cos(labels.astype(np.float64)))
        order = np.lexsort((-labels.astype(np.int64), moved))[:, :k]
        return np.take_along_axis(labels, order, 1), np.take_along_axis(moved, order, 1)

    monkeypatch.setattr(ds, "index_", _Wrapped(ds.index_, knn_query=rounded_otherwise))
    sq2, found2 = ds.kneighbors(q)
    np.testing.assert_array_equal(found2, found)
    np.testing.assert_array_equal(sq2, sq)
    np.testing.assert_array_equal(ds.predict_proba(q), p)


class _Wrapped:
    """An hnswlib index with some of its methods replaced."""

    def __init__(self, index, **methods):
        self._index, self._methods = index, methods

    def __getattr__(self, name):
        return self._methods.get(name) or getattr(self._index, name)


@needs_hnswlib
def test_hnsw_fifo_reuses_slots_and_concatenate_compacts(tmp_path):
    z, y = _embeddings(300, 8)
    ds = HNSWDatastore(NUM_CLASSES, k=5).fit(z[:200], y[:200])
    ds.evict_oldest(50).add(z[200:250], y[200:250])
    assert len(ds) == 200 and ds.index_.element_count == 200
    assert ds.ids_[0] == 50
    ds.evict_oldest(100)
    names = ds.save(tmp_path, generation=2)
    assert names == ["datastore.2.npz", "hnsw.2.bin"]
    back = HNSWDatastore.load(
        tmp_path, {"num_classes": NUM_CLASSES, "k": 5}, files=names, embedding_dim=8
    )
    assert len(back) == 100 and back.index_.element_count == 100
    # the newest 100 samples are the ones kept; each finds itself
    np.testing.assert_array_equal(back.predict_proba(z[150:250]).argmax(1), y[150:250])


def test_protonn_score_matches_hand_computation(tmp_path):
    W = np.array([[1.0, 0.0], [0.0, 2.0]])
    B = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    Z = np.array([[1.0, 0.0, 0.5], [0.0, 1.0, 0.5]])
    gamma = 0.7
    z = np.array([[0.5, 0.5], [1.0, 0.0]], dtype=np.float32)
    expected = []
    for row in z.astype(np.float64):
        wz = W @ row
        s = [
            sum(Z[c, j] * np.exp(-(gamma**2) * np.sum((wz - B[:, j]) ** 2)) for j in range(3))
            for c in range(2)
        ]
        expected.append(np.array(s) / sum(s))
    ds = ProtoNNDatastore.from_matrices(W, B, Z, gamma, m=0.3)
    np.testing.assert_allclose(ds.predict_proba(z), np.array(expected), rtol=1e-6)
    # far queries must not underflow to the uniform answer
    far = np.array([[200.0, 0.0]], dtype=np.float32)  # nearest prototype: B[:, 1] -> class 1
    np.testing.assert_allclose(ds.predict_proba(far), [[0.0, 1.0]], atol=1e-12)
    names = ds.save(tmp_path)
    back = ProtoNNDatastore.load(tmp_path, {"num_classes": 2, "d": 2, "m": 0.3}, files=names)
    np.testing.assert_allclose(back.predict_proba(z), ds.predict_proba(z))
    with pytest.raises(NotImplementedError, match="protonn package"):
        ds.fit(z, np.array([0, 1]))


def test_protonn_buffered_samples_score_as_one_label_prototypes(tmp_path):
    W = np.array([[1.0, 0.0], [0.0, 2.0]])
    B = np.array([[0.0, 1.0], [0.0, 0.0]])
    Z = np.array([[1.0, 0.0], [0.0, 2.0]])
    ds = ProtoNNDatastore.from_matrices(W, B, Z, 0.7, buffer=3)
    assert ds.buffer_weight_ == pytest.approx(1.5)  # mean of each prototype's top score
    ds.add(np.array([[0.0, 1.0], [3.0, 3.0]], np.float32), np.array([1, 0]))
    B_all, Z_all = ds.prototypes()
    plain = ProtoNNDatastore.from_matrices(W, B_all, Z_all, 0.7)
    z = np.array([[0.2, 0.9], [2.5, 2.0], [50.0, 0.0]], np.float32)
    np.testing.assert_allclose(ds.predict_proba(z), plain.predict_proba(z), rtol=1e-6)
    ds.sample_store().evict_oldest(1)
    assert ds.buffer_labels_.tolist() == [0] and ds.buffer_order_.tolist() == [1]
    names = ds.save(tmp_path)
    back = ProtoNNDatastore.load(tmp_path, {"num_classes": 2, "buffer": 3}, files=names)
    np.testing.assert_array_equal(back.buffer_keys_t_, ds.buffer_keys_t_)
    np.testing.assert_allclose(back.predict_proba(z), ds.predict_proba(z))
    assert back.recipe == "protonn:d2:b3"
    # a full buffer costs its bytes in the file and a norm per key beside them in memory
    assert ds.estimate_nbytes(2, 2) - ProtoNNDatastore(2, d=2).estimate_nbytes(2, 2) == (
        ds.buffer_nbytes(3) + 3 * 4
    )


@pytest.mark.parametrize("strategy", ["fifo", "concatenate"])
def test_protonn_bundle_learns_into_its_buffer_within_the_budget(tmp_path, strategy):
    enc = make_image_encoder(tmp_path / "encoder.onnx")
    rng = np.random.default_rng(0)
    ds = ProtoNNDatastore.from_matrices(
        rng.normal(size=(3, P)),
        rng.normal(size=(3, 5)),
        rng.random((NUM_CLASSES, 5)),
        0.5,
        k=5,
        m=0.3,
        buffer=4,
    )
    budget = enc.stat().st_size + ds.estimate_nbytes(5, P) + 3 * ds.buffer_nbytes(1)
    fields = dataclasses.replace(FIELDS, budget_bytes=budget, update_strategy=strategy)
    write_bundle(tmp_path / "b", fields, enc, ds)
    rt = Runtime.load(tmp_path / "b")
    x, y = make_images(12, 1)
    before = rt.predict_proba(x)
    report = rt.add(x[:6], y[:6])
    # fifo keeps its capacity of 4; concatenate grows while the budget has room
    assert report.size == (4 if strategy == "fifo" else len(rt.datastore.buffer_labels_))
    assert report.size >= 4 and rt.manifest.footprint.total <= budget
    assert not np.allclose(rt.predict_proba(x), before)
    again = Runtime.load(tmp_path / "b")
    np.testing.assert_allclose(again.predict_proba(x), rt.predict_proba(x))
    assert len(again.datastore) == 5  # the prototypes stay


def test_protonn_bundle_without_a_buffer_defaults_to_concatenate(tmp_path):
    enc = make_image_encoder(tmp_path / "encoder.onnx")
    rng = np.random.default_rng(0)
    ds = ProtoNNDatastore.from_matrices(
        rng.normal(size=(3, P)), rng.normal(size=(3, 5)), rng.random((NUM_CLASSES, 5)), 0.5
    )
    write_bundle(tmp_path / "b", FIELDS, enc, ds)
    assert read_manifest(tmp_path / "b").update_strategy == "concatenate"
    rt = Runtime.load(tmp_path / "b")
    x, y = make_images(6, 1)
    with pytest.raises(ValueError, match="reserves no room"):
        rt.add(x, y, strategy="fifo")
    assert rt.add(x, y, strategy="fixed").added == 0
    assert rt.add(x, y).added == 6


def test_recipes_parse_and_format():
    assert parse_recipe("flat:int8:n500") == ("flat", {"dtype": "int8", "n": 500})
    assert parse_recipe("flat") == ("flat", {"dtype": "fp32"})
    assert parse_recipe("hnsw:M16:ef64:n500") == ("hnsw", {"M": 16, "ef": 64, "n": 500})
    assert parse_recipe("hnsw:M8:efc100") == ("hnsw", {"M": 8, "ef_construction": 100})
    assert parse_recipe("protonn:d32:m0.3") == ("protonn", {"d": 32, "m": 0.3})
    for recipe in ("flat:int8:n500", "hnsw:M16:ef64:efc200:n500", "protonn:d32:m0.3"):
        assert format_recipe(*parse_recipe(recipe)) == recipe
    # what the experiments group chosen recipes by, and the same store without raw inputs
    assert recipe_without("hnsw:M8:ef64:n12:x64", "n") == "hnsw:M8:ef64:x64"
    assert recipe_without("flat:int8:n500:x64", "inputs") == "flat:int8:n500"
    for bad, message in [
        ("faiss:IVF", "unknown datastore backend 'faiss'"),
        ("flat:int4", "flat recipes take fp32|fp16|int8"),
        ("flat:int8:fp16", "sets dtype twice"),
        ("hnsw:M0", "must be positive"),
        ("", "non-empty"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_recipe(bad)
    ds = make_datastore("flat:fp16:n20", NUM_CLASSES, k=3)
    assert isinstance(ds, FlatDatastore) and ds.n == 20 and ds.dtype == "fp16"
    z, y = _embeddings(50)
    assert len(ds.fit(z, y)) == 20


@needs_hnswlib
def test_estimates_bound_the_saved_sizes(tmp_path):
    z, y = _embeddings(300, 12)
    for ds in (FlatDatastore(NUM_CLASSES, dtype=d).fit(z, y) for d in ("fp32", "fp16", "int8")):
        (name,) = ds.save(tmp_path)
        assert (tmp_path / name).stat().st_size <= ds.nbytes
    ds = HNSWDatastore(NUM_CLASSES).fit(z, y)
    size = sum((tmp_path / n).stat().st_size for n in ds.save(tmp_path))
    assert 0.8 * ds.nbytes <= size <= 1.1 * ds.nbytes


# ----------------------------------------------------------------------------- bad bundles


def _edit_manifest(**changes):
    def edit(b: Path) -> None:
        m = json.loads((b / "manifest.json").read_text())
        for key, value in changes.items():
            if value is KeyError:
                del m[key]
            else:
                m[key] = value
        (b / "manifest.json").write_text(json.dumps(m))

    return edit


def _truncate(b: Path) -> None:
    data = (b / "datastore.npz").read_bytes()
    (b / "datastore.npz").write_bytes(data[: len(data) // 2])


def _flip_byte(b: Path) -> None:
    data = bytearray((b / "encoder.onnx").read_bytes())
    data[len(data) // 2] ^= 0x01
    (b / "encoder.onnx").write_bytes(bytes(data))


def _wrong_sha(b: Path) -> None:
    m = json.loads((b / "manifest.json").read_text())
    m["files"]["datastore.npz"] = "ab" * 32
    (b / "manifest.json").write_text(json.dumps(m))


def _over_budget(b: Path) -> None:
    m = json.loads((b / "manifest.json").read_text())
    m["budget_bytes"] = m["footprint"]["total"] - 1
    (b / "manifest.json").write_text(json.dumps(m))


def _traversal(b: Path) -> None:
    m = json.loads((b / "manifest.json").read_text())
    m["files"]["../encoder.onnx"] = m["files"].pop("encoder.onnx")
    (b / "manifest.json").write_text(json.dumps(m))


def _lying_footprint(b: Path) -> None:
    m = json.loads((b / "manifest.json").read_text())
    m["footprint"]["datastore"] -= 100
    m["footprint"]["total"] -= 100
    (b / "manifest.json").write_text(json.dumps(m))


BAD_BUNDLES = {
    "truncated datastore": (_truncate, "datastore.npz does not match its sha256"),
    "edited encoder": (_flip_byte, "encoder.onnx does not match its sha256"),
    "wrong sha256": (_wrong_sha, "datastore.npz does not match its sha256"),
    "missing file": (lambda b: (b / "datastore.npz").unlink(), "datastore.npz is missing"),
    "missing manifest": (lambda b: (b / "manifest.json").unlink(), "manifest.json is missing"),
    "manifest not json": (lambda b: (b / "manifest.json").write_text("{"), "not valid JSON"),
    "missing key lambda": (_edit_manifest(**{"lambda": KeyError}), "missing key 'lambda'"),
    "missing key files": (_edit_manifest(files=KeyError), "missing key 'files'"),
    "wrong type": (_edit_manifest(k="10"), "'k' must be a JSON int"),
    "bool is not int": (_edit_manifest(k=True), "'k' must be a JSON int"),
    "version 2": (_edit_manifest(version=2), "newer format version 2, this runtime reads 1"),
    "wrong format": (_edit_manifest(format="zip"), "'format' must be 'knnper-bundle'"),
    "lambda out of range": (_edit_manifest(**{"lambda": 1.5}), "'lambda' must be in"),
    "embedding dim": (_edit_manifest(embedding_dim=P + 1), "dimension 6, expected 7"),
    "num classes": (_edit_manifest(num_classes=NUM_CLASSES + 1), "encoder gives embedding"),
    "over budget": (_over_budget, "over budget"),
    "lying footprint": (_lying_footprint, "footprint says"),
    "path traversal": (_traversal, "invalid file name '../encoder.onnx'"),
    "bad input spec": (_edit_manifest(input={"kind": "audio"}), "'input': input spec 'kind'"),
    "unknown backend": (
        _edit_manifest(backend={"name": "faiss", "recipe": "faiss", "params": {}}),
        "backend 'name' must be one of",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BUNDLES))
def test_bad_bundle_is_refused_and_nothing_is_written(case, tmp_path):
    b = build_bundle(tmp_path)
    mutate, message = BAD_BUNDLES[case]
    mutate(b)
    before = snapshot(b)
    with pytest.raises(BundleError) as info:
        Runtime.load(b)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert snapshot(b) == before


def test_encoder_and_datastore_dimensions_must_agree(tmp_path):
    enc = make_image_encoder(tmp_path / "encoder.onnx")
    z, y = _embeddings(30, P - 1)
    ds = FlatDatastore(NUM_CLASSES).fit(z, y)
    with pytest.raises(BundleError, match="encoder gives embedding dim 6"):
        write_bundle(tmp_path / "b", FIELDS, enc, ds)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder.onnx"]


def test_encoder_without_named_outputs_is_refused(tmp_path):
    enc = make_image_encoder(tmp_path / "e.onnx", output_names=("feat", "out"))
    with pytest.raises(ValueError, match=r"lacks output\(s\) \['embedding', 'logits'\]"):
        Encoder(enc)


def test_write_bundle_over_budget_writes_nothing(tmp_path):
    enc = make_image_encoder(tmp_path / "encoder.onnx")
    z, y = _embeddings(500, P)
    ds = FlatDatastore(NUM_CLASSES).fit(z, y)
    budget = enc.stat().st_size + 1000
    with pytest.raises(BundleError, match=rf"over the budget of {budget} bytes") as info:
        write_bundle(tmp_path / "b", dataclasses.replace(FIELDS, budget_bytes=budget), enc, ds)
    assert f"encoder {enc.stat().st_size} + datastore" in str(info.value)
    with pytest.raises(BundleError, match="the encoder alone takes"):
        write_bundle(tmp_path / "b", dataclasses.replace(FIELDS, budget_bytes=100), enc, ds)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder.onnx"]


def test_write_bundle_replaces_a_bundle_but_not_other_directories(tmp_path):
    b = build_bundle(tmp_path, "flat:fp32")
    first = read_manifest(b).files["datastore.npz"]
    build_bundle(tmp_path, "flat:int8")
    assert read_manifest(b).recipe == "flat:int8"
    assert read_manifest(b).files["datastore.npz"] != first
    # no temporary is left; the replace locked the bundle, whose turnstile (locking) stays
    assert sorted(p.name for p in tmp_path.iterdir()) == [".bundle.lock", "bundle", "encoder.onnx"]
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(BundleError, match="holds other files, not a bundle; choose another --out"):
        build_bundle(tmp_path, name="photos")
    assert (tmp_path / "photos" / "cat.jpg").read_bytes() == b"meow"


def test_write_bundle_checks_fields(tmp_path):
    """A writer gives only what it decides (k and sigma come from the datastore, a field the
    type lacks cannot be given); what it gives is checked before anything is written."""
    enc = make_image_encoder(tmp_path / "encoder.onnx")
    z, y = _embeddings(30, P)
    ds = FlatDatastore(NUM_CLASSES, k=5).fit(z, y)
    with pytest.raises(TypeError):
        dataclasses.replace(FIELDS, k=7)
    with pytest.raises(BundleError, match=r"'lambda' must be in \[0, 1\]"):
        write_bundle(tmp_path / "b", dataclasses.replace(FIELDS, lam=1.5), enc, ds)
    with pytest.raises(BundleError, match="'update_strategy' must be one of"):
        write_bundle(tmp_path / "b", dataclasses.replace(FIELDS, update_strategy="lifo"), enc, ds)
    assert not (tmp_path / "b").exists()
    assert write_bundle(tmp_path / "b", FIELDS, enc, ds).k == 5


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "x, message",
    [
        (np.zeros((2, 9, 9, 1), np.uint8), r"input shape \[2, 9, 9, 1\] does not match"),
        (np.zeros((2, 8, 8, 3), np.uint8), "expected images"),
        (np.zeros((2, 8, 8, 1), np.float32), "dtype float32 is not supported"),
        (np.full((2, 8, 8, 1), np.nan, np.float32), "NaN"),
        (np.full((2, 8, 8, 1), 300), "pixel values must be in 0..255"),
        (np.array(["a"]), "dtype <U1 is not supported"),
    ],
)
def test_bad_inputs_raise_value_error(bundle, x, message):
    rt = Runtime.load(bundle)
    with pytest.raises(ValueError, match=message):
        rt.predict(x)


def test_integer_pixels_of_other_dtypes_are_accepted(bundle):
    rt = Runtime.load(bundle)
    x, _ = make_images(3)
    np.testing.assert_array_equal(rt.predict(x.astype(np.int64)), rt.predict(x))


@pytest.mark.parametrize(
    "y, message",
    [
        (np.array([0, 1]), "got 2 labels for 3 samples"),
        (np.array([0, 1, 4]), r"labels must be in \[0, 4\)"),
        (np.array([0.0, 1.0, 2.0]), "labels must be integers"),
        (np.array([[0, 1, 2]]), "1-D"),
    ],
)
def test_bad_labels_raise_and_nothing_is_written(bundle, y, message):
    rt = Runtime.load(bundle)
    x, _ = make_images(3)
    before = snapshot(bundle)
    with pytest.raises(ValueError, match=message):
        rt.add(x, y)
    assert snapshot(bundle) == before


# ----------------------------------------------------------------------------- update strategies


def test_fifo_keeps_the_size_and_evicts_the_oldest(bundle):
    rt = Runtime.load(bundle)
    x, y = make_images(10, 9)
    report = rt.add(x, y, strategy="fifo")
    assert (report.added, report.evicted, report.size) == (10, 10, 60)
    reloaded = Runtime.load(bundle).datastore
    np.testing.assert_array_equal(reloaded.order_, np.arange(10, 70))
    np.testing.assert_array_equal(reloaded.labels_[-10:], y)
    assert sorted(p.name for p in bundle.iterdir()) == [
        "datastore.1.npz",
        "encoder.onnx",
        "manifest.json",
    ]


def test_fifo_grows_to_the_recipe_capacity_then_stays(tmp_path):
    b = build_bundle(tmp_path, "flat:fp16:n80", n=60)
    rt = Runtime.load(b)
    assert len(rt.datastore) == 60 and rt.capacity == 80
    x, y = make_images(30, 4)
    assert rt.add(x, y).size == 80
    assert rt.add(x[:5], y[:5]).size == 80
    big_x, big_y = make_images(200, 5)
    report = rt.add(big_x, big_y)
    assert (report.added, report.size) == (80, 80)
    np.testing.assert_array_equal(Runtime.load(b).datastore.labels_, big_y[-80:])


def test_concatenate_grows_until_the_budget_then_evicts_the_oldest(tmp_path, caplog):
    probe = build_bundle(tmp_path, n=60, name="probe")
    m = read_manifest(probe)
    ds = FlatDatastore(NUM_CLASSES)
    budget = m.footprint.encoder + ds.estimate_nbytes(100, P)
    b = build_bundle(tmp_path, n=60, budget=budget, strategy="concatenate")
    rt = Runtime.load(b)
    x, y = make_images(30, 4)
    report = rt.add(x, y)
    assert (report.added, report.evicted, report.size) == (30, 0, 90)
    assert not caplog.records
    with caplog.at_level("WARNING"):
        report = rt.add(*make_images(30, 5))
    assert report.size == 100 and report.evicted == 20
    assert "reached the budget" in caplog.text
    m = read_manifest(b)
    assert m.footprint.total <= m.budget.total
    assert len(Runtime.load(b).datastore) == 100


def test_fixed_changes_nothing(bundle):
    rt = Runtime.load(bundle)
    before = snapshot(bundle)
    report = rt.add(*make_images(10, 9), strategy="fixed")
    assert (report.added, report.evicted, report.size) == (0, 0, 60)
    assert snapshot(bundle) == before
    with pytest.raises(ValueError, match="update strategy must be one of"):
        rt.add(*make_images(2), strategy="lifo")


@needs_hnswlib
@pytest.mark.parametrize("strategy", ["fifo", "concatenate"])
def test_hnsw_bundle_updates_persist(tmp_path, strategy):
    b = build_bundle(tmp_path, "hnsw:M8:ef32", n=60, strategy=strategy)
    rt = Runtime.load(b)
    x, y = make_images(20, 6)
    report = rt.add(x, y)
    assert report.size == (60 if strategy == "fifo" else 80)
    again = Runtime.load(b)
    assert sorted(again.manifest.files) == ["datastore.1.npz", "encoder.onnx", "hnsw.1.bin"]
    np.testing.assert_allclose(again.predict_proba(x), rt.predict_proba(x))


def test_stale_files_of_an_interrupted_update_are_ignored_then_removed(bundle):
    (bundle / "datastore.1.npz.tmp").write_bytes(b"half a file")
    (bundle / "datastore.1.npz").write_bytes(b"unreferenced")
    (bundle / "notes.txt").write_text("mine")
    rt = Runtime.load(bundle)
    rt.add(*make_images(5, 3))
    names = sorted(p.name for p in bundle.iterdir())
    assert names == ["datastore.1.npz", "encoder.onnx", "manifest.json", "notes.txt"]
    Runtime.load(bundle)


def test_failed_commit_keeps_the_last_good_state(bundle, monkeypatch):
    rt = Runtime.load(bundle)
    before = snapshot(bundle)
    import edge_runtime.bundle as bundle_module

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bundle_module, "write_json_atomic", fail)
    with pytest.raises(OSError):
        rt.add(*make_images(5, 3))
    assert snapshot(bundle) == before
    assert len(rt.datastore) == 60
    np.testing.assert_array_equal(rt.datastore.order_, np.arange(60))


# ----------------------------------------------------------------------------- crash safety

_WRITER = textwrap.dedent("""
    import os, sys
    import numpy as np
    from edge_runtime.runtime import Runtime

    bundle, seed, die_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rt = Runtime.load(bundle, intra_op_threads=1)
    calls = [0]

    def dying(fn):
        def wrapped(*args, **kwargs):
            calls[0] += 1
            if calls[0] == die_at:
                os._exit(9)  # like a power cut: no cleanup, no flush
            return fn(*args, **kwargs)
        return wrapped

    if die_at > 0:
        for name in ("replace", "rename", "unlink", "fsync"):
            setattr(os, name, dying(getattr(os, name)))
    rng = np.random.default_rng(seed)
    print("ready", flush=True)
    i = 0
    while True:
        x = rng.integers(0, 256, (40, 8, 8, 1), dtype=np.uint8)
        rt.add(x, rng.integers(0, 4, 40), strategy=("fifo", "concatenate")[i % 2])
        i += 1
        if die_at > 0 and i == 3:
            print("calls", calls[0], flush=True)
            sys.exit(0)
""")


def _writer(bundle: Path, seed: int, die_at: int) -> subprocess.Popen:
    script = bundle.parent / "writer.py"
    script.write_text(_WRITER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(script), str(bundle), str(seed), str(die_at)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _assert_recovers(bundle: Path) -> None:
    rt = Runtime.load(bundle)  # verifies every listed file
    assert len(rt.datastore) >= 1
    rt.add(*make_images(3, 1), strategy="fifo")  # and the next update cleans up
    Runtime.load(bundle)


def test_dying_at_every_step_of_an_update_leaves_a_bundle_that_verifies(tmp_path):
    bundle = build_bundle(tmp_path, n=300, budget=10**7)
    proc = _writer(bundle, 0, 10**9)  # count the steps of three updates
    out, err = proc.communicate(timeout=60)
    steps = int(out.split("calls")[1])
    assert proc.returncode == 0, err
    # Stop at each step of the second update (the first may also clean up leftovers).
    first = steps // 3
    for die_at in range(first + 1, 2 * first + 1):
        proc = _writer(bundle, die_at, die_at)
        proc.communicate(timeout=60)
        assert proc.returncode == 9
        _assert_recovers(bundle)


def test_sigkill_mid_update_leaves_a_bundle_that_verifies(tmp_path):
    bundle = build_bundle(tmp_path, n=2000, budget=10**7)
    rng = np.random.default_rng(0)
    for attempt in range(4):
        proc = _writer(bundle, attempt, 0)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.02, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        _assert_recovers(bundle)


# ----------------------------------------------------------------------------- device init


def test_init_bundle_for_a_new_device_fits_its_budget(tmp_path):
    enc = make_image_encoder(tmp_path / "encoder.onnx")
    x, y = make_images(200, 11, signal=25)
    budget = enc.stat().st_size + FlatDatastore(NUM_CLASSES, dtype="fp16").estimate_nbytes(80, P)
    report = init_bundle(
        enc, x, y, budget, tmp_path / "new", input_spec=IMAGE_SPEC, settings=InitSettings(k=5)
    )
    m = read_manifest(tmp_path / "new")
    assert m.footprint.total <= budget == m.budget.total
    assert m.lam == report.lam and m.recipe == report.recipe
    assert m.client_id == -1 and m.update_strategy == "fifo"
    assert len(report.candidates) == 9  # fp32, fp16, int8 at the most that fit, 1/2 and 1/4
    assert all(c["nbytes"] <= budget - enc.stat().st_size for c in report.candidates)
    assert report.val_accuracy == max(c["val_accuracy"] for c in report.candidates)
    rt = Runtime.load(tmp_path / "new")
    _, params = parse_recipe(report.recipe)
    assert len(rt.datastore) == rt.capacity == params["n"] < 200
    x_test, y_test = make_images(100, 12, signal=25)
    # a weak signal on 6-dim embeddings: well above chance (0.25) is what a device can expect
    # (the int8 candidates' 7-bit queries lose a little here and fp32 with fewer samples wins)
    assert np.mean(rt.predict(x_test) == y_test) >= 0.45


def test_init_bundle_refuses_budgets_that_cannot_work(tmp_path):
    enc = make_image_encoder(tmp_path / "encoder.onnx")
    x, y = make_images(50)
    size = enc.stat().st_size
    with pytest.raises(BundleError, match=f"encoder alone takes {size} bytes"):
        init_bundle(enc, x, y, size - 1, tmp_path / "b", input_spec=IMAGE_SPEC)
    with pytest.raises(BundleError, match="too few for one stored sample; the smallest budget"):
        init_bundle(enc, x, y, size + 100, tmp_path / "b", input_spec=IMAGE_SPEC)
    with pytest.raises(ValueError, match="protonn datastores are trained on the server"):
        init_bundle(
            enc,
            x,
            y,
            10**6,
            tmp_path / "b",
            input_spec=IMAGE_SPEC,
            settings=InitSettings(recipes=["protonn:d8"]),
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder.onnx"]


# ----------------------------------------------------------------------------- CLI


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_line_error(code: int, err: str, fragment: str) -> None:
    assert code == 2
    assert err.startswith("knnper-edge: error: ") and err.count("\n") == 1, err
    assert fragment in err, err


def test_cli_predict_evaluate_info(bundle, tmp_path, capsys):
    x, y = make_images(12, 8)
    np.save(tmp_path / "x.npy", x)
    code, out, _ = _cli(
        capsys,
        "predict",
        bundle,
        "--input",
        tmp_path / "x.npy",
        "--output",
        tmp_path / "p.npy",
        "--labels",
    )
    assert code == 0
    proba = np.load(tmp_path / "p.npy")
    assert proba.shape == (12, NUM_CLASSES)
    assert [int(v) for v in out.split()] == list(proba.argmax(1))
    np.savez(tmp_path / "test.npz", x_test=x, y_test=y)
    code, out, _ = _cli(capsys, "evaluate", bundle, "--data", tmp_path / "test.npz")
    assert code == 0 and out.startswith("accuracy ") and "on 12 samples" in out
    code, out, _ = _cli(capsys, "info", bundle)
    assert code == 0 and "flat:fp32, 60 stored" in out


def test_cli_add_and_init(bundle, tmp_path, capsys):
    x, y = make_images(10, 8)
    np.savez(tmp_path / "new.npz", x=x, y=y)
    code, out, _ = _cli(
        capsys, "add", bundle, "--data", tmp_path / "new.npz", "--strategy", "concatenate"
    )
    assert code == 0 and "datastore holds 70 samples" in out
    code, out, _ = _cli(
        capsys,
        "init",
        "--encoder",
        tmp_path / "encoder.onnx",
        "--data",
        tmp_path / "new.npz",
        "--budget",
        "20KB",
        "--out",
        tmp_path / "dev",
        "--like",
        bundle,
    )
    assert code == 0 and "wrote" in out
    assert read_manifest(tmp_path / "dev").k == 5  # taken from --like
    (tmp_path / "spec.json").write_text(json.dumps(IMAGE_SPEC))
    code, out, _ = _cli(
        capsys,
        "init",
        "--encoder",
        tmp_path / "encoder.onnx",
        "--data",
        tmp_path / "new.npz",
        "--budget",
        "100",
        "--out",
        tmp_path / "dev2",
        "--input-spec",
        tmp_path / "spec.json",
    )
    _assert_one_line_error(code, _, "encoder alone takes")
    assert not (tmp_path / "dev2").exists()


def test_cli_errors_are_one_line_with_exit_code_2(bundle, tmp_path, capsys):
    np.save(tmp_path / "bad_shape.npy", np.zeros((2, 5, 5, 1), np.uint8))
    np.save(tmp_path / "nan.npy", np.full((2, 8, 8, 1), np.nan))
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.savez(tmp_path / "wrong_keys.npz", a=np.zeros(3))
    np.savez(tmp_path / "bad_labels.npz", x=make_images(3)[0], y=np.array([0, 1, 9]))
    cases = [
        (["predict", bundle, "--input", tmp_path / "bad_shape.npy"], "does not match"),
        (["predict", bundle, "--input", tmp_path / "nan.npy"], "NaN"),
        (["predict", bundle, "--input", tmp_path / "objects.npy"], "allow_pickle"),
        (["predict", bundle, "--input", tmp_path / "missing.npy"], "no such file"),
        (["predict", tmp_path / "nowhere", "--input", tmp_path / "nan.npy"], "not a directory"),
        (["evaluate", bundle, "--data", tmp_path / "wrong_keys.npz"], "expected x and y"),
        (["add", bundle, "--data", tmp_path / "bad_labels.npz"], "labels must be in [0, 4)"),
        (["add", bundle, "--data", tmp_path / "x.npz", "--strategy", "lifo"], "invalid choice"),
        (
            ["init", "--encoder", "e.onnx", "--data", "d.npz", "--budget", "1", "--out", "o"],
            "one of the arguments --like --input-spec is required",
        ),
        (
            [
                "init",
                "--encoder",
                tmp_path / "nope.onnx",
                "--data",
                "d.npz",
                "--budget",
                "1",
                "--out",
                tmp_path / "o",
                "--like",
                bundle,
            ],
            "no such file",
        ),
        (["frobnicate"], "invalid choice"),
    ]
    for argv, fragment in cases:
        code, _, err = _cli(capsys, *argv)
        _assert_one_line_error(code, err, fragment)
    _flip_byte(bundle)
    code, _, err = _cli(capsys, "info", bundle)
    _assert_one_line_error(code, err, "encoder.onnx does not match its sha256")


def test_console_script_error_has_no_traceback(bundle, tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((2, 3), np.float32))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge_runtime.cli",
            "predict",
            str(bundle),
            "--input",
            str(tmp_path / "x.npy"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("knnper-edge: error: input dtype float32 is not supported")
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1


def test_a_second_writer_with_a_stale_manifest_is_refused(bundle):
    first, second = Runtime.load(bundle), Runtime.load(bundle)
    first.add(*make_images(5, 1))
    before = snapshot(bundle)
    with pytest.raises(BundleError, match="changed on disk since the bundle was loaded"):
        second.add(*make_images(5, 2))
    assert snapshot(bundle) == before
    Runtime.load(bundle)


def test_write_bundle_accepts_numpy_scalars_in_fields(tmp_path):
    enc = make_image_encoder(tmp_path / "encoder.onnx")
    z, y = _embeddings(30, P)
    spec = {**IMAGE_SPEC, "mean": [np.float32(0.5)], "shape": (H, W, C_IN)}
    fields = dataclasses.replace(
        FIELDS, input=InputSpec(spec), lam=np.float64(0.3), budget_bytes=np.int64(10**6)
    )
    manifest = write_bundle(tmp_path / "b", fields, enc, FlatDatastore(NUM_CLASSES).fit(z, y))
    assert manifest == read_manifest(tmp_path / "b")
    assert manifest.input.to_json()["shape"] == [H, W, C_IN] and manifest.lam == 0.3
