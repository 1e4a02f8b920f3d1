"""Upgrading a ProtoNN bundle: the release's reverse map (new space -> old) folded into the
projection, the prototypes and the buffer of added samples carried; refused with one line
where the release ships no reverse map or a hostile one."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import pytest

from edge_runtime.bundle import write_bundle
from edge_runtime.datastores import ProtoNNDatastore
from edge_runtime.keymap import KeyMap, load_key_map
from edge_runtime.runtime import Runtime
from edge_runtime.upgrade import UPGRADES_DIR, map_file_name
from edge_runtime.versions import ModelVersion
from export.upgrade_map import fit_key_map, ridge
from tests.helpers.bundles import (
    FIELDS,
    NUM_CLASSES,
    P,
    make_image_encoder,
    make_images,
    raw_outputs,
)


def test_fold_scores_new_embeddings_as_the_old_ones_exactly():
    """Small integers throughout: every product and distance is exact in float32, so the folded
    scores of z_new equal the original scores of z_old = z_new C + c bit for bit."""
    rng = np.random.default_rng(0)
    p_old, p_new, d, m = 4, 3, 2, 5
    W = rng.integers(-2, 3, (d, p_old)).astype(np.float64)
    B = rng.integers(-4, 5, (d, m)).astype(np.float64)
    Z = np.eye(NUM_CLASSES)[:, rng.integers(0, NUM_CLASSES, m)] * 2.0
    C = rng.integers(-1, 2, (p_new, p_old)).astype(np.float32)
    c = rng.integers(-2, 3, p_old).astype(np.float32)
    ds = ProtoNNDatastore.from_matrices(W, B, Z, 0.25, buffer=4)
    z_new = rng.integers(-3, 4, (30, p_new)).astype(np.float32)
    ds.add(z_new[:3] @ C + c, np.array([0, 1, 2]))  # buffered in the old space
    folded = ds.fold_input_map(C, c, k=7)
    assert folded.W_.shape == (d, p_new) and folded.embedding_dim_ == p_new and folded.k == 7
    np.testing.assert_array_equal(folded.predict_proba(z_new), ds.predict_proba(z_new @ C + c))
    np.testing.assert_array_equal(folded.buffer_labels_, ds.buffer_labels_)
    np.testing.assert_array_equal(folded.buffer_order_, ds.buffer_order_)
    np.testing.assert_array_equal(folded.Z_, ds.Z_)
    assert folded.buffer == 4 and folded.gamma_ == ds.gamma_


def test_fold_of_real_valued_matrices_agrees_to_float32_rounding():
    rng = np.random.default_rng(1)
    ds = ProtoNNDatastore.from_matrices(
        rng.normal(size=(6, 8)), rng.normal(size=(6, 9)), rng.random((NUM_CLASSES, 9)), 0.6
    )
    C, c = rng.normal(size=(5, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32)
    z_new = rng.normal(size=(40, 5)).astype(np.float32)
    np.testing.assert_allclose(
        ds.fold_input_map(C, c).predict_proba(z_new),
        ds.predict_proba(z_new @ C + c),
        atol=1e-5,
    )


def test_fold_refuses_a_map_of_another_shape():
    ds = ProtoNNDatastore.from_matrices(np.ones((2, 3)), np.ones((2, 2)), np.eye(2), 0.5)
    with pytest.raises(ValueError, match="dimension 3"):
        ds.fold_input_map(np.ones((4, 2), np.float32), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="dimension 3"):
        ds.fold_input_map(np.ones((4, 3), np.float32), np.zeros(2, np.float32))


def _protonn(encoder: Path, seed: int, buffer: int = 6) -> ProtoNNDatastore:
    """A hand-made ProtoNN of the encoder's embeddings: a random projection, the class means
    as prototypes (one-label scores), the median-heuristic width x4 (protonn.training's)."""
    from protonn.training import median_heuristic_gamma

    x, y = make_images(120, seed)
    z, _ = raw_outputs(encoder, x)
    W = np.random.default_rng(seed).normal(size=(4, z.shape[1]))
    B = np.stack([(z[y == c] @ W.T).mean(0) for c in range(NUM_CLASSES)], axis=1)
    gamma = 4 * median_heuristic_gamma(z @ W.T, B.T)
    return ProtoNNDatastore.from_matrices(W, B, np.eye(NUM_CLASSES), gamma, k=5, buffer=buffer)


@pytest.fixture
def release(tmp_path):
    return _release(tmp_path)


def _release(tmp_path: Path, p_new: int = P):
    """An old encoder's ProtoNN device bundle that learned 4 samples, the new release's own
    ProtoNN bundle (its encoder's embeddings of dimension p_new), and the release's map file
    (fitted by the server's code, with its reverse) where upgrade looks for it."""
    old = make_image_encoder(tmp_path / "old.onnx", seed=0)
    new = make_image_encoder(tmp_path / "new.onnx", seed=1, p=p_new)
    fields = dataclasses.replace(FIELDS, update_strategy="fifo")
    write_bundle(tmp_path / "device", fields, old, _protonn(old, 0))
    (tmp_path / "v2").mkdir()
    write_bundle(tmp_path / "v2" / "client", fields, new, _protonn(new, 5))
    x, y = make_images(400, seed=7)
    (z_old, _), (z_new, logits) = raw_outputs(old, x), raw_outputs(new, x)
    ids = [ModelVersion.of_encoder(p.read_bytes()) for p in (old, new)]
    if p_new == P:  # the server's own fit (its evidence scores old keys with new queries)
        mapping = fit_key_map(z_old, z_new, logits, y, *ids, num_classes=NUM_CLASSES, k=5).key_map
    else:
        evidence = {"mapped": 0.9, "stale": 0.5, "re-embedded": 0.95, "global": 0.6}
        mapping = KeyMap(
            *ridge(z_old, z_new, 1e-3), *ids, "map the keys", evidence, *ridge(z_new, z_old, 1e-3)
        )
    key_map = tmp_path / "v2" / UPGRADES_DIR / map_file_name(ids[0])
    key_map.parent.mkdir()
    mapping.save(key_map)
    x_add, y_add = make_images(4, seed=9)
    Runtime.load(tmp_path / "device").add(x_add, y_add)
    return tmp_path / "device", tmp_path / "v2" / "client", key_map, old, new


def test_cli_upgrades_a_protonn_bundle_by_folding_the_reverse_map(release, capsys):
    from edge_runtime.cli import main

    device, client, key_map, old, new = release
    before = Runtime.load(device).datastore
    mapping = load_key_map(key_map)
    assert mapping.reverse_weight.shape == mapping.weight.shape[::-1]
    capsys.readouterr()
    assert main(["upgrade", str(device), "--to", str(client)]) == 0
    out = capsys.readouterr().out
    assert "4 carried (buffered; the release's reverse map folded" in out and "->" in out
    assert main(["info", str(device)]) == 0
    assert ModelVersion.of_encoder(new.read_bytes()).short in capsys.readouterr().out
    rt = Runtime.load(device)
    assert rt.manifest.files["encoder.onnx"] == hashlib.sha256(new.read_bytes()).hexdigest()
    assert rt.manifest.recipe == before.recipe
    np.testing.assert_array_equal(rt.datastore.buffer_labels_, before.buffer_labels_)
    probe, truth = make_images(40, seed=3)
    z_new, _ = raw_outputs(new, probe)
    # the upgraded datastore scores the new embeddings as the old one scores them mapped back
    np.testing.assert_allclose(
        rt.datastore.predict_proba(z_new),
        before.predict_proba(z_new @ mapping.reverse_weight + mapping.reverse_bias),
        atol=1e-5,
    )
    assert rt.predict(probe).shape == (40,)
    onnx_file = device.parent / "predictor.onnx"  # the one-file predictor of the folded matrices
    assert main(["export-onnx", str(device), "--out", str(onnx_file)]) == 0
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(
        session.run(None, {"input": probe})[0], rt.predict_proba(probe), atol=1e-5
    )
    np.savez(device.parent / "test.npz", x=probe, y=truth)
    assert main(["evaluate", str(device), "--data", str(device.parent / "test.npz")]) == 0
    x_more, y_more = make_images(3, seed=11)
    rt.add(x_more, y_more)  # it learns on in the new version
    assert len(Runtime.load(device).datastore.buffer_labels_) == 6  # fifo, capacity 6


def _damaged_map(key_map: Path, damage: str) -> None:
    with np.load(key_map) as f:
        arrays = {k: f[k] for k in f.files}
    reverse = arrays["reverse_weight"]
    if damage == "no reverse":
        del arrays["reverse_weight"], arrays["reverse_bias"]
    elif damage == "half a reverse":
        del arrays["reverse_bias"]
    elif damage == "wrong shape":
        arrays["reverse_weight"] = np.ascontiguousarray(reverse[:, :-1])
    elif damage == "bias shape":
        arrays["reverse_bias"] = np.zeros(3, np.float32)
    elif damage == "nan":
        arrays["reverse_weight"] = np.full_like(reverse, np.nan)
    elif damage == "float64":
        arrays["reverse_weight"] = reverse.astype(np.float64)
    np.savez(key_map, **arrays)


@pytest.mark.parametrize(
    "damage", ["no reverse", "half a reverse", "wrong shape", "bias shape", "nan", "float64"]
)
def test_a_map_without_a_good_reverse_is_refused_with_one_line(release, capsys, damage):
    from edge_runtime.cli import main

    device, client, key_map, old, _ = release
    files = {p.name: p.read_bytes() for p in device.iterdir()}
    _damaged_map(key_map, damage)
    capsys.readouterr()
    assert main(["upgrade", str(device), "--to", str(client), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    if damage == "no reverse":
        assert "lacks the reverse map" in err and str(client) in err
    else:
        assert key_map.name in err and "reverse" in err
    assert {p.name: p.read_bytes() for p in device.iterdir()} == files  # untouched
    rt = Runtime.load(device)
    assert rt.manifest.files["encoder.onnx"] == hashlib.sha256(old.read_bytes()).hexdigest()


def test_a_map_without_its_reverse_still_loads(tmp_path):
    ids = [ModelVersion(hashlib.sha256(bytes([i])).hexdigest()) for i in range(2)]
    evidence = {"mapped": 0.9, "stale": 0.5, "re-embedded": 0.95, "global": 0.6}
    KeyMap(
        np.eye(3, dtype=np.float32), np.zeros(3, np.float32), *ids, "map the keys", evidence
    ).save(tmp_path / "m.npz")
    assert load_key_map(tmp_path / "m.npz").reverse_weight is None


@pytest.mark.parametrize("room", [2, 0])
def test_the_buffer_s_oldest_go_when_the_new_encoder_leaves_less_room(release, capsys, room):
    """A budget with room for only `room` of the 4 buffered samples beside the new encoder: the
    oldest are evicted (all of them if need be: the prototypes stay) and the report says so."""
    from edge_runtime.cli import main
    from tests.helpers.bundles import rewrite_manifest

    device, client, key_map, old, new = release
    rt = Runtime.load(device)
    store, dim = rt.datastore.sample_store(), rt.manifest.embedding_dim
    labels = rt.datastore.buffer_labels_.copy()
    rewrite_manifest(device, budget_bytes=new.stat().st_size + store.estimate_nbytes(room, dim))
    capsys.readouterr()
    assert main(["upgrade", str(device), "--to", str(client)]) == 0
    out = capsys.readouterr().out
    assert f"{room} carried (buffered" in out and f"{4 - room} oldest evicted" in out
    after = Runtime.load(device).datastore
    np.testing.assert_array_equal(after.buffer_labels_, labels[4 - room :])
    assert len(after) == len(rt.datastore)  # every prototype kept


def test_prototypes_that_no_longer_fit_are_refused_with_one_line(tmp_path, capsys):
    """A much wider new encoder: its file and the folded projection take more than the budget
    leaves, even with no buffered sample; the bundle stays the old version."""
    from edge_runtime.cli import main
    from tests.helpers.bundles import rewrite_manifest

    device, client, key_map, old, new = _release(tmp_path, p_new=64)
    rt = Runtime.load(device)
    store, dim = rt.datastore.sample_store(), rt.manifest.embedding_dim
    rewrite_manifest(device, budget_bytes=old.stat().st_size + store.estimate_nbytes(4, dim))
    assert new.stat().st_size > old.stat().st_size + store.estimate_nbytes(4, dim)
    files = {p.name: p.read_bytes() for p in device.iterdir()}
    capsys.readouterr()
    assert main(["upgrade", str(device), "--to", str(client)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no room for its folded prototypes" in err, err
    assert {p.name: p.read_bytes() for p in device.iterdir()} == files
    assert Runtime.load(device).predict(make_images(2)[0]).shape == (2,)


@pytest.mark.parametrize("same_recipe", [True, False])
def test_signed_protonn_bundle_stays_verifiable_across_an_upgrade(tmp_path, same_recipe):
    """Signed: the upgraded bundle carries the release's signature, which covers the recipe
    but its counts, so a release whose ProtoNN has another projection is refused (one line)."""
    pytest.importorskip("cryptography")
    from edge_runtime.errors import SignatureError
    from edge_runtime.signing import generate_key_pair, load_private_key, load_public_key, sign_file

    generate_key_pair(tmp_path / "key.pem", tmp_path / "key.pub")
    key, trusted = load_private_key(tmp_path / "key.pem"), [load_public_key(tmp_path / "key.pub")]
    device, client, key_map, old, new = _release(tmp_path)
    release_ds = _protonn(new, 5)
    if not same_recipe:
        release_ds = ProtoNNDatastore.from_matrices(
            np.vstack([release_ds.W_, release_ds.W_[:1]]),
            np.vstack([release_ds.B_, release_ds.B_[:1]]),
            release_ds.Z_,
            release_ds.gamma_,
            k=5,
            buffer=6,
        )
    fields = dataclasses.replace(FIELDS, update_strategy="fifo")
    write_bundle(device, fields, old, _protonn(old, 0), signing_key=key)
    write_bundle(client, fields, new, release_ds, signing_key=key)
    sign_file(key_map, key)
    rt = Runtime.load(device, trusted_keys=trusted)
    rt.add(*make_images(3, seed=8))
    labels = rt.datastore.buffer_labels_.copy()
    if same_recipe:
        report = rt.upgrade(client, trusted_keys=trusted)
        assert report.signed and report.how == "folded" and report.carried == 3
        after = Runtime.load(device, trusted_keys=trusted)  # verifies
        np.testing.assert_array_equal(after.datastore.buffer_labels_, labels)
    else:
        with pytest.raises(SignatureError, match="datastore backend") as err:
            rt.upgrade(client, trusted_keys=trusted)
        assert "\n" not in str(err.value)
        assert Runtime.load(device, trusted_keys=trusted).manifest.files["encoder.onnx"] == (
            hashlib.sha256(old.read_bytes()).hexdigest()
        )
