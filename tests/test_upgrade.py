"""Model versions on the device: keys of one encoder are never searched with another's, and
`upgrade` carries a bundle's samples to a new encoder (mapped, or re-embedded exactly)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from edge_runtime.bundle import BundleError, read_bundle, write_bundle
from edge_runtime.datastores import make_datastore
from edge_runtime.keymap import KeyMap, load_key_map
from edge_runtime.knn_provenance import KNNProvenance
from edge_runtime.manifest import Manifest
from edge_runtime.runtime import Runtime
from edge_runtime.upgrade import UPGRADES_DIR, map_file_name
from edge_runtime.versions import ModelVersion
from tests.helpers.bundles import (
    FIELDS,
    NUM_CLASSES,
    make_image_encoder,
    make_images,
    raw_outputs,
    snapshot,
)


def _encoders(tmp_path: Path) -> tuple[Path, Path]:
    old = make_image_encoder(tmp_path / "old.onnx", seed=0)
    new = make_image_encoder(tmp_path / "new.onnx", seed=1)
    return old, new


def _bundle(
    tmp_path: Path,
    encoder: Path,
    name: str,
    recipe: str = "flat:fp32",
    n: int = 60,
    seed: int = 0,
    strategy: str = "fifo",
) -> Path:
    x, y = make_images(n, seed)
    z, _ = raw_outputs(encoder, x)
    ds = make_datastore(recipe, NUM_CLASSES, k=5, sigma=1.0).fit(z, y)
    write_bundle(
        tmp_path / name, dataclasses.replace(FIELDS, update_strategy=strategy), encoder, ds
    )
    return tmp_path / name


def _fit_map(old: Path, new: Path, out: Path, advice: str = "map the keys") -> Path:
    x, _ = make_images(400, seed=7)
    z_old, _ = raw_outputs(old, x)
    z_new, _ = raw_outputs(new, x)
    a = np.hstack([z_old, np.ones((len(z_old), 1), np.float32)])
    coef = np.linalg.lstsq(a, z_new, rcond=None)[0].astype(np.float32)
    ids = [ModelVersion.of_encoder(p.read_bytes()) for p in (old, new)]
    KeyMap(
        coef[:-1],
        coef[-1],
        ids[0],
        ids[1],
        advice,
        {"mapped": 0.9, "stale": 0.5, "re-embedded": 0.95, "global": 0.6},
    ).save(out)
    return out


def _move_datastore(source: Path, target: Path) -> None:
    """Copy source's datastore.npz into target and fix target's manifest to list it, as a
    careless migration would."""
    shutil.copyfile(source / "datastore.npz", target / "datastore.npz")
    manifest = json.loads((target / "manifest.json").read_text())
    data = (target / "datastore.npz").read_bytes()
    manifest["files"]["datastore.npz"] = hashlib.sha256(data).hexdigest()
    total_ds = len(data)
    manifest["footprint"]["datastore"] = total_ds
    manifest["footprint"]["total"] = manifest["footprint"]["encoder"] + total_ds
    (target / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("huge", ["weight", "bias"])
def test_a_finite_map_that_overflows_the_keys_names_the_bundle_and_the_map(tmp_path, capsys, huge):
    """Keys mapped to inf were refused as 'z must hold finite numbers'; keys whose squared norm
    overflows, by a line naming the upgrade's temporary folder."""
    from edge_runtime.cli import main

    old, new = _encoders(tmp_path)
    a = _bundle(tmp_path, old, "a")
    before = {p.name: p.read_bytes() for p in a.iterdir()}
    release = _bundle(tmp_path, new, "release")
    good = load_key_map(_fit_map(old, new, tmp_path / "good.npz"))
    arrays = {"weight": good.weight, "bias": good.bias}
    arrays[huge] = np.full_like(arrays[huge], 3e38)
    KeyMap(
        arrays["weight"],
        arrays["bias"],
        good.from_version,
        good.to_version,
        good.advice,
        good.evidence,
    ).save(tmp_path / "bad.npz")
    argv = ["upgrade", str(a), "--to", str(release), "--map", str(tmp_path / "bad.npz")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"bundle {a}: the key map {tmp_path / 'bad.npz'}" in err
    assert {p.name: p.read_bytes() for p in a.iterdir()} == before
    assert not list(tmp_path.glob(".a.tmp-*"))


def test_datastore_of_another_encoder_is_refused_by_load(tmp_path):
    old, new = _encoders(tmp_path)
    a, b = _bundle(tmp_path, old, "a"), _bundle(tmp_path, new, "b")
    _move_datastore(a, b)
    with pytest.raises(BundleError, match="embedded by encoder .* upgrade") as err:
        Runtime.load(b)
    assert "\n" not in str(err.value)


def test_write_bundle_refuses_keys_of_another_encoder(tmp_path):
    old, new = _encoders(tmp_path)
    a = _bundle(tmp_path, old, "a")
    ds = read_bundle(a).datastore
    with pytest.raises(BundleError, match="embedded by encoder"):
        write_bundle(tmp_path / "mixed", FIELDS, new, ds)
    assert not (tmp_path / "mixed").exists()


def test_datastore_records_its_encoder(tmp_path):
    old, _ = _encoders(tmp_path)
    a = _bundle(tmp_path, old, "a")
    with np.load(a / "datastore.npz") as f:
        assert bytes(f["embedding_id"]).hex() == hashlib.sha256(old.read_bytes()).hexdigest()


def test_bundle_without_a_recorded_encoder_loads_as_before(tmp_path):
    """Bundles written before versioning carry no embedding_id: they still load."""
    old, _ = _encoders(tmp_path)
    a = _bundle(tmp_path, old, "a")
    with np.load(a / "datastore.npz") as f:
        arrays = {k: f[k] for k in f.files if k != "embedding_id"}
    np.savez(a / "datastore.npz", **arrays)
    manifest = json.loads((a / "manifest.json").read_text())
    data = (a / "datastore.npz").read_bytes()
    manifest["files"]["datastore.npz"] = hashlib.sha256(data).hexdigest()
    manifest["footprint"]["datastore"] = len(data)
    manifest["footprint"]["total"] = manifest["footprint"]["encoder"] + len(data)
    (a / "manifest.json").write_text(json.dumps(manifest))
    assert Runtime.load(a).predict(make_images(3)[0]).shape == (3,)


@pytest.mark.parametrize("recipe", ["flat:fp32", "flat:int8", "hnsw:M8"])
def test_upgrade_maps_keys_and_keeps_every_sample(tmp_path, recipe):
    old, new = _encoders(tmp_path)
    a = _bundle(tmp_path, old, "a", recipe, strategy="concatenate")
    release = _bundle(tmp_path, new, "release", recipe, seed=5)
    (tmp_path / UPGRADES_DIR).mkdir()
    _fit_map(
        old, new, tmp_path / UPGRADES_DIR / map_file_name(ModelVersion.of_encoder(old.read_bytes()))
    )
    rt = Runtime.load(a)
    x_add, y_add = make_images(7, seed=9)
    rt.add(x_add, y_add)
    labels_before = rt.datastore.labels_.copy()
    report = rt.upgrade(release)
    assert report.how == "mapped" and report.carried == 67 and report.evicted == 0
    np.testing.assert_array_equal(rt.datastore.labels_, labels_before)
    assert rt.manifest.update_strategy == "concatenate"
    assert rt.manifest.recipe.split(":")[:2] == recipe.split(":")[:2]
    assert rt.manifest.files["encoder.onnx"] == hashlib.sha256(new.read_bytes()).hexdigest()
    # the device's additions, embedded by the new encoder, are found as their own neighbours
    z_new, _ = raw_outputs(new, x_add)
    assert (rt.datastore.predict_proba(z_new).argmax(1) == y_add).mean() >= 5 / 7
    fresh = Runtime.load(a)
    np.testing.assert_allclose(fresh.predict_proba(x_add), rt.predict_proba(x_add))
    assert rt.upgrade(release).how == "nothing to do"


def test_upgrade_refuses_a_map_of_other_versions(tmp_path):
    old, new = _encoders(tmp_path)
    other = make_image_encoder(tmp_path / "other.onnx", seed=2)
    a = _bundle(tmp_path, old, "a")
    release = _bundle(tmp_path, new, "release")
    wrong = _fit_map(other, new, tmp_path / "wrong.npz")
    before = sorted(p.name for p in a.iterdir())
    with pytest.raises(BundleError, match="maps encoder .* this upgrade needs"):
        Runtime.load(a).upgrade(release, key_map=wrong)
    rt = Runtime.load(a)
    with pytest.raises(BundleError, match="ships no map"):
        rt.upgrade(release)
    assert rt.predict(make_images(3)[0]).shape == (3,)  # still the old version, usable
    assert sorted(p.name for p in a.iterdir()) == before
    assert (
        Runtime.load(a).manifest.files["encoder.onnx"]
        == hashlib.sha256(old.read_bytes()).hexdigest()
    )


def test_upgrade_follows_the_release_advice(tmp_path):
    old, new = _encoders(tmp_path)
    a = _bundle(tmp_path, old, "a")
    release = _bundle(tmp_path, new, "release")
    keep = _fit_map(old, new, tmp_path / "keep.npz", advice="keep the old keys")
    with pytest.raises(BundleError, match="advises to keep the old keys"):
        Runtime.load(a).upgrade(release, key_map=keep)
    assert Runtime.load(a).upgrade(release, key_map=keep, force=True).how == "mapped"


@pytest.mark.parametrize("damage", ["not a zip", "pickle", "shape", "nan", "extra"])
def test_bad_map_files_are_refused_with_one_line(tmp_path, damage):
    old, new = _encoders(tmp_path)
    good = load_key_map(_fit_map(old, new, tmp_path / "good.npz"))
    bad = tmp_path / "bad.npz"
    arrays = {
        "weight": good.weight,
        "bias": good.bias,
        "from_embedding": good.from_version.as_array(),
        "to_embedding": good.to_version.as_array(),
        "advice": np.int8(0),
        "evidence": np.array([0.9, 0.5, 0.95, 0.6]),
    }
    if damage == "not a zip":
        bad.write_bytes(b"PK\x03\x04 nonsense")
    elif damage == "pickle":
        np.savez(bad, **{**arrays, "weight": np.array([object()], dtype=object)})
    elif damage == "shape":
        np.savez(bad, **{**arrays, "bias": np.zeros(3, np.float32)})
    elif damage == "nan":
        np.savez(bad, **{**arrays, "weight": np.full_like(good.weight, np.nan)})
    else:
        np.savez(bad, **arrays, more=np.zeros(2))
    with pytest.raises(ValueError) as err:
        load_key_map(bad)
    assert "\n" not in str(err.value) and "bad.npz" in str(err.value)


def test_every_command_refuses_a_datastore_of_another_encoder(tmp_path, capsys):
    from edge_runtime.cli import main

    old, new = _encoders(tmp_path)
    a, b = _bundle(tmp_path, old, "a"), _bundle(tmp_path, new, "b")
    _move_datastore(a, b)
    x, y = make_images(4, seed=3)
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "xy.npz", x=x, y=y)
    for argv in (
        ["predict", str(b), "--input", str(tmp_path / "x.npy")],
        ["evaluate", str(b), "--data", str(tmp_path / "xy.npz")],
        ["add", str(b), "--data", str(tmp_path / "xy.npz")],
        ["info", str(b)],
        ["export-onnx", str(b), "--out", str(tmp_path / "p.onnx")],
        ["upgrade", str(b), "--to", str(a)],
    ):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "embedded by encoder" in err and "upgrade" in err, argv


def test_upgrade_command_prints_what_it_did(tmp_path, capsys):
    from edge_runtime.cli import main

    old, new = _encoders(tmp_path)
    a = _bundle(tmp_path, old, "a")
    release = _bundle(tmp_path, new, "release")
    key_map = _fit_map(old, new, tmp_path / "map.npz")
    assert main(["upgrade", str(a), "--to", str(release), "--map", str(key_map)]) == 0
    out = capsys.readouterr().out
    assert "60 carried (mapped)" in out and "->" in out and "evidence" in out
    assert main(["info", str(a)]) == 0
    assert ModelVersion.of_encoder(new.read_bytes()).short in capsys.readouterr().out


def test_an_upgrade_with_another_clients_bundle_is_refused_in_one_line(tmp_path, capsys):
    """`upgrade` took the release's lambda, chosen on another client's data, onto a device of
    another client without comparing their ids."""
    from edge_runtime.cli import main

    old, new = _encoders(tmp_path)
    device = _bundle(tmp_path, old, "device")  # client 3's
    x, y = make_images(60, seed=5)
    ds = make_datastore("flat:fp32", NUM_CLASSES, k=5, sigma=1.0).fit(raw_outputs(new, x)[0], y)
    release = tmp_path / "v2" / "client_0004"
    release.parent.mkdir()
    write_bundle(release, dataclasses.replace(FIELDS, client_id=4), new, ds)
    key_map = _fit_map(old, new, tmp_path / "map.npz")
    before, beside = snapshot(device), sorted(tmp_path.iterdir())
    beside.append(tmp_path / ".device.lock")  # the bundle's turnstile, its lock's file
    capsys.readouterr()
    assert main(["upgrade", str(device), "--to", str(release), "--map", str(key_map)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"bundle {device} is client 3's and the release bundle {release} is client 4's" in err
    assert str(tmp_path / "v2" / "client_0003") in err
    assert snapshot(device) == before and sorted(tmp_path.iterdir()) == sorted(beside)


@pytest.mark.parametrize("atomic", [True, False])
def test_an_upgrade_through_a_linked_bundle_path_keeps_the_link(
    tmp_path, capsys, monkeypatch, atomic
):
    """The exchange swapped the link itself (the path became a directory) and left the link
    behind as .link.tmp-*; the two renames (where the kernel has no exchange) alike: the
    directory the link names is the one replaced, and nothing is left beside either."""
    from edge_runtime import _io
    from edge_runtime.cli import main

    if not atomic:
        monkeypatch.setattr(_io, "exchange_directories", lambda a, b: False)
    old, new = _encoders(tmp_path)
    (tmp_path / "store").mkdir()
    target = _bundle(tmp_path / "store", old, "a")
    link = tmp_path / "device"
    link.symlink_to(target)
    release = _bundle(tmp_path, new, "release")
    key_map = _fit_map(old, new, tmp_path / "map.npz")
    assert main(["upgrade", str(link), "--to", str(release), "--map", str(key_map)]) == 0
    assert "60 carried (mapped)" in capsys.readouterr().out
    assert link.is_symlink() and link.resolve() == target
    encoder = read_bundle(target).manifest.files["encoder.onnx"]
    assert encoder == hashlib.sha256(new.read_bytes()).hexdigest()
    left = sorted(p.name for d in (tmp_path, tmp_path / "store") for p in d.iterdir())
    assert not [name for name in left if ".tmp-" in name or ".old-" in name], left


def test_upgrading_a_bundle_to_itself_is_one_line_not_a_wait_on_its_own_lock(tmp_path, capsys):
    from edge_runtime.cli import main

    old, _ = _encoders(tmp_path)
    a = _bundle(tmp_path, old, "a")
    (tmp_path / "link").symlink_to(a)
    assert main(["upgrade", str(a), "--to", str(tmp_path / "link")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is this bundle itself" in err


def test_a_read_only_bundle_is_refused_in_one_line_and_nothing_is_left_beside_it(tmp_path):
    """The swapped-out old bundle kept its read-only mode, so `.a.tmp-*` could not be removed.
    Root ignores modes: the command runs without the capabilities that let it."""
    import os
    import subprocess
    import sys

    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv (util-linux) to drop the permission overrides")
    old, new = _encoders(tmp_path)
    a = _bundle(tmp_path, old, "a")
    release = _bundle(tmp_path, new, "release")
    key_map = _fit_map(old, new, tmp_path / "map.npz")
    before = {p.name: p.read_bytes() for p in a.iterdir()}
    a.chmod(0o555)
    try:
        done = subprocess.run(
            [setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]
            + [sys.executable, "-m", "edge_runtime.cli", "upgrade", str(a), "--to", str(release)]
            + ["--map", str(key_map)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        )
    finally:
        a.chmod(0o755)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "is read-only" in done.stderr
    assert not list(tmp_path.glob(".a.tmp-*"))
    assert {p.name: p.read_bytes() for p in a.iterdir()} == before


_UPGRADER = """
import sys
from edge_runtime.runtime import Runtime
Runtime.load(sys.argv[1]).upgrade(sys.argv[2], key_map=sys.argv[3])
print("done", flush=True)
"""


def test_sigkill_during_upgrade_leaves_the_old_bundle_or_the_new(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers.bundles import REPO

    old, new = _encoders(tmp_path)
    pristine = _bundle(tmp_path, old, "pristine", "flat:int8", n=3000)
    release = _bundle(tmp_path, new, "release", "flat:int8")
    key_map = _fit_map(old, new, tmp_path / "map.npz")
    labels = Runtime.load(pristine).datastore.labels_.copy()
    shas = {
        hashlib.sha256(p.read_bytes()).hexdigest(): name for name, p in (("old", old), ("new", new))
    }
    bundle, seen = tmp_path / "device", set()
    for delay in (0.05, 0.12, 0.18, 0.24, 0.3, 0.4, 0.6):  # the process starts, then upgrades
        if not bundle.exists() or seen and "new" in seen:
            shutil.rmtree(bundle, ignore_errors=True)
            shutil.copytree(pristine, bundle)
        proc = subprocess.Popen(
            [sys.executable, "-c", _UPGRADER, str(bundle), str(release), str(key_map)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        rt = Runtime.load(bundle)
        version = shas[rt.manifest.files["encoder.onnx"]]
        seen.add(version)
        np.testing.assert_array_equal(rt.datastore.labels_, labels)
        assert rt.predict(make_images(2)[0]).shape == (2,)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    write_bundle(
        tmp_path / "later",
        FIELDS,
        old,  # the next write beside them cleans up
        make_datastore("flat:fp32", NUM_CLASSES).fit(*_embedded(old)),
    )
    # the bundle's turnstile (edge_runtime.locking) stays; temporaries and theirs go
    assert not [
        p.name
        for p in tmp_path.iterdir()
        if p.name.startswith((".device", "..device")) and p.name != ".device.lock"
    ], leftovers


def _embedded(encoder: Path) -> tuple[np.ndarray, np.ndarray]:
    x, y = make_images(20)
    return raw_outputs(encoder, x)[0], y


@pytest.mark.parametrize("recipe", ["flat:int8", "hnsw:M8"])
def test_upgrade_with_kept_inputs_predicts_exactly_what_a_fresh_init_does(tmp_path, recipe):
    from edge_runtime.device_choice import InitSettings
    from edge_runtime.device_init import init_bundle

    old, new = _encoders(tmp_path)
    x, y = make_images(80, seed=1)
    init_bundle(
        old,
        x,
        y,
        10**6,
        tmp_path / "device",
        input_spec=FIELDS.input,
        settings=InitSettings(k=5, recipes=[recipe], keep_inputs=True),
    )
    release = _bundle(tmp_path, new, "release", seed=5)
    rt = Runtime.load(tmp_path / "device")
    assert rt.manifest.recipe.endswith(f":x{8 * 8}")
    x_add, y_add = make_images(9, seed=2)
    rt.add(x_add, y_add, strategy="concatenate")
    report = rt.upgrade(release)  # no map: the kept inputs are re-embedded
    assert report.how == "re-embedded" and report.carried == 89
    all_x, all_y = np.concatenate([x, x_add]), np.concatenate([y, y_add])
    fresh = init_bundle(
        new,
        all_x,
        all_y,
        10**6,
        tmp_path / "fresh",
        input_spec=FIELDS.input,
        settings=InitSettings(k=5, recipes=[rt.manifest.recipe], keep_inputs=True),
    )
    assert fresh.lam == rt.lam
    probe, _ = make_images(50, seed=3)
    np.testing.assert_array_equal(
        Runtime.load(tmp_path / "fresh").predict_proba(probe), rt.predict_proba(probe)
    )
    np.testing.assert_array_equal(rt.datastore.inputs_, all_x)


def test_kept_inputs_of_the_right_bytes_in_another_shape_are_refused_at_load(tmp_path, capsys):
    """[n, 64] for 8x8x1 images has the bytes the recipe counts: it failed only when re-embedded
    or added to, naming neither the bundle nor the array."""
    from edge_runtime.cli import main
    from edge_runtime.device_choice import InitSettings
    from edge_runtime.device_init import init_bundle

    old, _ = _encoders(tmp_path)
    x, y = make_images(30, seed=1)
    device = tmp_path / "device"
    init_bundle(
        old,
        x,
        y,
        10**6,
        device,
        input_spec=FIELDS.input,
        settings=InitSettings(k=5, keep_inputs=True),
    )
    with np.load(device / "datastore.npz", allow_pickle=False) as f:
        arrays = dict(f)
    arrays["inputs"] = arrays["inputs"].reshape(len(arrays["inputs"]), -1)
    np.savez(tmp_path / "datastore.npz", **arrays)
    _move_datastore(tmp_path, device)
    assert main(["info", str(device)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"bundle {device}: datastore: its kept inputs" in err


def test_kept_inputs_count_in_the_budget(tmp_path):
    from edge_runtime.device_choice import InitSettings
    from edge_runtime.device_init import init_bundle

    old, _ = _encoders(tmp_path)
    x, y = make_images(200, seed=1)
    budget = old.stat().st_size + 6000
    plain = init_bundle(
        old,
        x,
        y,
        budget,
        tmp_path / "plain",
        input_spec=FIELDS.input,
        settings=InitSettings(recipes=["flat:int8"]),
    )
    kept = init_bundle(
        old,
        x,
        y,
        budget,
        tmp_path / "kept",
        input_spec=FIELDS.input,
        settings=InitSettings(recipes=["flat:int8"], keep_inputs=True),
    )
    n_plain = len(Runtime.load(tmp_path / "plain").datastore)
    n_kept = len(Runtime.load(tmp_path / "kept").datastore)
    assert n_kept < n_plain
    assert kept.manifest.footprint.total <= budget >= plain.manifest.footprint.total


@pytest.mark.parametrize("recipe", ["flat:fp32", "flat:fp16", "flat:int8", "hnsw:M8"])
def test_fitting_from_chunks_stores_what_fit_stores(recipe):
    z = np.random.default_rng(0).normal(size=(2500, 6)).astype(np.float32)
    y = np.arange(2500) % NUM_CLASSES
    whole = make_datastore(recipe, NUM_CLASSES, k=5).fit(z, y)
    chunked = make_datastore(recipe, NUM_CLASSES, k=5).fit_chunks(
        lambda: (z[i : i + 1024] for i in range(0, 2500, 1024)), 2500, y
    )
    np.testing.assert_array_equal(chunked.keys(), whole.keys())
    np.testing.assert_array_equal(chunked.labels_, whole.labels_)
    np.testing.assert_array_equal(chunked.predict_proba(z[:50]), whole.predict_proba(z[:50]))


def test_mapping_10000_int8_keys_holds_little_beside_the_two_datastores():
    """The upgrade's memory bound is the old keys, the new ones and a chunk of scratch: with
    1,024-row chunks, each widened, divided, rounded and clipped into a copy of its own, the
    scratch alone was 2 MiB, which put a 10,000-key int8 bundle with an int8 CNN encoder (a
    smaller budget than an MLP's) past budget + 2 MiB (benchmarks/upgrade_device.py)."""
    import tracemalloc

    rng = np.random.default_rng(0)
    z, y = rng.normal(size=(10_000, 128)).astype(np.float32), np.arange(10_000) % NUM_CLASSES
    old = make_datastore("flat:int8", NUM_CLASSES, k=5).fit(z, y)
    weight = (np.eye(128) + rng.normal(0, 0.05, (128, 128))).astype(np.float32)
    mapping = KeyMap(weight, np.zeros(128, np.float32), "a" * 64, "b" * 64, "map the keys", {})
    del z
    tracemalloc.start()
    try:
        new = make_datastore("flat:int8", NUM_CLASSES, k=5).fit_chunks(
            lambda: mapping.chunks(old.key_rows, len(old)), len(old), old.labels_
        )
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert new.keys_t_.nbytes == 128 * 10_000 <= held
    assert peak - held < 0.75 * 2**20, f"{(peak - held) / 2**20:.2f} MiB of scratch"


def _signing_keys(tmp_path: Path) -> tuple:
    """A fresh Ed25519 pair: the private key and the trusted list holding its public half."""
    pytest.importorskip("cryptography")
    from edge_runtime.signing import generate_key_pair, load_private_key, load_public_key

    generate_key_pair(tmp_path / "key.pem", tmp_path / "key.pub")
    return load_private_key(tmp_path / "key.pem"), [load_public_key(tmp_path / "key.pub")]


def test_signed_bundle_stays_verifiable_across_an_upgrade(tmp_path):
    key, trusted = _signing_keys(tmp_path)
    from edge_runtime.signing import SignatureError, sign_file

    old, new = _encoders(tmp_path)
    bundles = {}
    for name, encoder, seed in (("device", old, 0), ("release", new, 5)):
        x, y = make_images(60, seed)
        ds = make_datastore("flat:int8", NUM_CLASSES, k=5).fit(raw_outputs(encoder, x)[0], y)
        write_bundle(tmp_path / name, FIELDS, encoder, ds, signing_key=key)
        bundles[name] = tmp_path / name
    key_map = _fit_map(old, new, tmp_path / "map.npz")
    rt = Runtime.load(bundles["device"], trusted_keys=trusted)
    rt.add(*make_images(4, seed=8))
    labels = rt.datastore.labels_.copy()
    with pytest.raises(SignatureError, match="unsigned"):  # a trusted release signs its map
        rt.upgrade(bundles["release"], key_map=key_map, trusted_keys=trusted)
    sign_file(key_map, key)
    report = rt.upgrade(bundles["release"], key_map=key_map, trusted_keys=trusted)
    assert report.signed and report.carried == len(labels)
    after = Runtime.load(bundles["device"], trusted_keys=trusted)  # verifies
    np.testing.assert_array_equal(after.datastore.labels_, labels)


def test_a_bundle_the_device_built_upgrades_to_a_signed_release_unsigned(tmp_path):
    """A device's own bundle (unsigned) upgraded with trusted keys: the release and its map are
    verified, a refusal says what was refused (not that the device's bundle is unsigned), and
    the upgraded bundle stays the device's own, unsigned."""
    key, trusted = _signing_keys(tmp_path)
    from edge_runtime.signing import SignatureError, sign_file

    old, new = _encoders(tmp_path)
    device = _bundle(tmp_path, old, "device")
    x, y = make_images(60, 5)
    ds = make_datastore("flat:int8", NUM_CLASSES, k=5).fit(raw_outputs(new, x)[0], y)
    write_bundle(tmp_path / "release", FIELDS, new, ds, signing_key=key)
    key_map = _fit_map(old, new, tmp_path / "map.npz")
    rt = Runtime.load(device)
    labels = rt.datastore.labels_.copy()
    with pytest.raises(SignatureError, match=r"map\.npz: unsigned"):
        rt.upgrade(tmp_path / "release", key_map=key_map, trusted_keys=trusted)
    sign_file(key_map, key)
    report = rt.upgrade(tmp_path / "release", key_map=key_map, trusted_keys=trusted)
    assert not report.signed and not (device / "signature.json").exists()
    np.testing.assert_array_equal(Runtime.load(device).datastore.labels_, labels)


def test_the_cli_verifies_a_signed_release_for_a_bundle_the_device_built(tmp_path, capsys):
    """--trusted-key K refuses the device's own (unsigned) bundle, as it refuses any unsigned
    bundle; --release-key K verifies the release and its map alone."""
    from edge_runtime.cli import main
    from edge_runtime.signing import sign_file

    key, _ = _signing_keys(tmp_path)
    old, new = _encoders(tmp_path)
    device = _bundle(tmp_path, old, "device")
    x, y = make_images(60, 5)
    ds = make_datastore("flat:int8", NUM_CLASSES, k=5).fit(raw_outputs(new, x)[0], y)
    write_bundle(tmp_path / "release", FIELDS, new, ds, signing_key=key)
    key_map = _fit_map(old, new, tmp_path / "map.npz")
    upgrade = ["upgrade", str(device), "--to", str(tmp_path / "release"), "--map", str(key_map)]
    pub = str(tmp_path / "key.pub")
    for argv, refusal in (
        (["--trusted-key", pub, *upgrade], f"{device}: unsigned"),
        ([*upgrade, "--release-key", pub], "map.npz: unsigned"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and refusal in err, err
    sign_file(key_map, key)
    assert main([*upgrade, "--release-key", pub]) == 0
    assert "60 carried (mapped)" in capsys.readouterr().out
    assert not (device / "signature.json").exists()


def test_a_signed_bundle_is_refused_an_unsigned_release(tmp_path, capsys):
    """Upgraded without a key, a signed bundle took an unsigned release and lost its signature
    silently, and could not take the signed release of that version back."""
    from edge_runtime.cli import main

    key, trusted = _signing_keys(tmp_path)
    old, new = _encoders(tmp_path)
    x, y = make_images(60, 0)
    ds = make_datastore("flat:fp32", NUM_CLASSES, k=5).fit(raw_outputs(old, x)[0], y)
    write_bundle(tmp_path / "device", FIELDS, old, ds, signing_key=key)
    before = {p.name: p.read_bytes() for p in (tmp_path / "device").iterdir()}
    release = _bundle(tmp_path, new, "release")
    key_map = _fit_map(old, new, tmp_path / "map.npz")
    upgrade = ["upgrade", str(tmp_path / "device"), "--to", str(release), "--map", str(key_map)]
    assert main(upgrade) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the upgrade would drop its signature" in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "device").iterdir()} == before
    Runtime.load(tmp_path / "device", trusted_keys=trusted)  # still verifies


_READER = """
import sys, time
import numpy as np
from edge_runtime.runtime import Runtime
bundle, seconds = sys.argv[1], float(sys.argv[2])
x = np.random.default_rng(0).integers(0, 256, (4, 8, 8, 1), dtype=np.uint8)
deadline, seen = time.monotonic() + seconds, set()
while time.monotonic() < deadline:
    rt = Runtime.load(bundle, intra_op_threads=1)
    assert rt.predict_proba(x).shape == (4, 4)
    seen.add(rt.manifest.files["encoder.onnx"][:12])
print(" ".join(sorted(seen)), flush=True)
"""


def test_concurrent_predictions_see_one_version_or_the_other(tmp_path):
    import subprocess
    import sys
    import time

    from tests.helpers.bundles import REPO

    old, new = _encoders(tmp_path)
    device = _bundle(tmp_path, old, "device", "flat:int8", n=3000)
    release = _bundle(tmp_path, new, "release", "flat:int8")
    key_map = _fit_map(old, new, tmp_path / "map.npz")
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", _READER, str(device), "4"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    time.sleep(1.5)
    Runtime.load(device).upgrade(release, key_map=key_map)
    seen = set()
    for proc in readers:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.strip().splitlines()[-1:]
        seen.update(out.split())
    versions = {hashlib.sha256(p.read_bytes()).hexdigest()[:12] for p in (old, new)}
    assert seen <= versions and hashlib.sha256(new.read_bytes()).hexdigest()[:12] in seen


def test_upgrade_refits_the_linear_head_where_the_release_does(tmp_path):
    from edge_runtime.linear_head import LinearHead
    from export.personal_encoder import with_linear_head

    old, new = _encoders(tmp_path)
    device = _bundle(tmp_path, old, "device")
    x, y = make_images(40, seed=5)
    z, _ = raw_outputs(new, x)
    personal = with_linear_head(new, LinearHead(NUM_CLASSES, l2=1e-2).fit(z, y))
    choice = {
        "k": {"value": 5, "source": "flag"},
        "sigma": {"value": 1.0, "source": "flag"},
        "normalize": {"value": "none", "source": "flag"},
        "lambda_estimator": {"value": "val", "source": "flag"},
        "base": {"value": "linear", "source": "validation"},
        "l2": {"value": 1e-2, "source": "validation"},
    }
    write_bundle(
        tmp_path / "release",
        dataclasses.replace(FIELDS, knn_choice=KNNProvenance(choice)),
        personal,
        make_datastore("flat:fp32", NUM_CLASSES, k=5, sigma=1.0).fit(z, y),
    )
    (tmp_path / "personal.onnx").write_bytes(personal)  # its embeddings are new's
    key_map = _fit_map(old, tmp_path / "personal.onnx", tmp_path / "map.npz")
    rt = Runtime.load(device)
    rt.upgrade(tmp_path / "release", key_map=key_map)
    head = [name for name in rt.manifest.files if name.startswith("linear_head")]
    assert head and rt.manifest.knn_choice.base.value == "linear"
    refit = LinearHead(NUM_CLASSES, l2=1e-2).fit(rt.datastore.keys(), rt.datastore.labels_)
    probe, _ = make_images(5, seed=6)
    z_probe, logits = rt.embed(probe)
    np.testing.assert_allclose(logits, z_probe @ refit.coef_ + refit.intercept_, atol=1e-4)


def _release(tmp_path: Path, encoder: Path, name: str, run: str, round_: int, seed: int) -> Path:
    """A bundle of an exported release: it records its model version, as the exporter does."""
    x, y = make_images(60, seed)
    z, _ = raw_outputs(encoder, x)
    ds = make_datastore("flat:fp32", NUM_CLASSES, k=5, sigma=1.0).fit(z, y)
    model = {
        "run": run,
        "round": round_,
        "weights_sha256": hashlib.sha256(run.encode()).hexdigest(),
        "embedding": ModelVersion.of_encoder(encoder.read_bytes()).embedding,
    }
    replaces = {**model, "run": "runs/v0", "round": 1}
    write_bundle(
        tmp_path / name,
        dataclasses.replace(FIELDS, model=ModelVersion.from_record(model, replaces)),
        encoder,
        ds,
    )
    return tmp_path / name


def test_a_downgrade_is_refused_in_one_line_unless_forced(tmp_path, capsys):
    """`upgrade` from v2 to v1 was accepted without a word."""
    from edge_runtime.cli import main

    old, new = _encoders(tmp_path)
    device = _release(tmp_path, new, "device", "runs/v", 5, seed=0)
    v1 = _release(tmp_path, old, "v1", "runs/v", 3, seed=1)  # the same run, an earlier round
    key_map = _fit_map(new, old, tmp_path / "map.npz")
    argv = ["upgrade", str(device), "--to", str(v1), "--map", str(key_map)]
    before, beside = snapshot(device), sorted(tmp_path.iterdir())
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"bundle {device} is run runs/v round 5 (encoder {_short(new)}) and the release " in err
    assert f"is the older run runs/v round 3 (encoder {_short(old)}): a downgrade; --force" in err
    assert snapshot(device) == before
    assert sorted(tmp_path.iterdir()) == sorted([*beside, tmp_path / ".device.lock"])
    assert main([*argv, "--force"]) == 0
    assert ModelVersion.of(Runtime.load(device).manifest).round == 3


def _short(encoder: Path) -> str:
    return ModelVersion.of_encoder(encoder.read_bytes()).short


def _init_like(like: Path, encoder: Path, data: Path, out: Path) -> int:
    from edge_runtime.cli import main

    return main(
        ["init", "--like", str(like), "--encoder", str(encoder), "--data", str(data)]
        + ["--budget", "1MB", "--out", str(out)]
    )


def test_init_like_records_the_release_version_that_info_and_upgrade_report(tmp_path, capsys):
    from edge_runtime.cli import main

    old, new = _encoders(tmp_path)
    v1 = _release(tmp_path, old, "v1", "runs/v1", 3, seed=0)
    x, y = make_images(40, seed=4)
    np.savez(tmp_path / "mine.npz", x=x, y=y)
    assert _init_like(v1, old, tmp_path / "mine.npz", tmp_path / "device") == 0
    released = json.loads((v1 / "manifest.json").read_text())
    written = Runtime.load(tmp_path / "device").manifest
    assert {key: written.json[key] for key in Manifest.RECORDS} == {
        "model": released["model"],
        "replaces": released["replaces"],
    }
    capsys.readouterr()
    assert main(["info", str(tmp_path / "device")]) == 0
    old_version = ModelVersion.of_encoder(old.read_bytes()).short
    assert f"version       run runs/v1 round 3 (encoder {old_version})" in capsys.readouterr().out
    v2 = _release(tmp_path, new, "v2", "runs/v2", 5, seed=1)
    key_map = _fit_map(old, new, tmp_path / "map.npz")
    assert main(["upgrade", str(tmp_path / "device"), "--to", str(v2), "--map", str(key_map)]) == 0
    out = capsys.readouterr().out
    new_version = ModelVersion.of_encoder(new.read_bytes()).short
    assert (
        f"version       run runs/v1 round 3 (encoder {old_version}) "
        f"-> run runs/v2 round 5 (encoder {new_version})"
    ) in out


def test_init_like_a_release_of_another_encoder_is_refused(tmp_path, capsys):
    old, new = _encoders(tmp_path)
    v1 = _release(tmp_path, old, "v1", "runs/v1", 3, seed=0)
    x, y = make_images(40, seed=4)
    np.savez(tmp_path / "mine.npz", x=x, y=y)
    capsys.readouterr()
    assert _init_like(v1, new, tmp_path / "mine.npz", tmp_path / "device") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{new} is encoder {ModelVersion.of_encoder(new.read_bytes()).short}" in err
    assert "not the release's run runs/v1 round 3 (encoder" in err
    assert not (tmp_path / "device").exists()
    # a bundle from before versions records none: the new bundle records none either
    unversioned = _bundle(tmp_path, new, "unversioned")
    assert _init_like(unversioned, new, tmp_path / "mine.npz", tmp_path / "device") == 0
    assert Runtime.load(tmp_path / "device").manifest.model is None
