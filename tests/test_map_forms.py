"""The key map's forms: each form's fit and apply on hand-checkable data, the cross-validation
choosing the form that is right, the map file's form on disk (round trip, old files, hostile
files) and a per-class map carried through `upgrade`."""

from __future__ import annotations

import numpy as np
import pytest

from edge_runtime.keymap import KeyMap, apply_map, load_key_map
from edge_runtime.versions import ModelVersion
from export import map_forms as mf
from export.upgrade_map import fit_key_map
from tests.helpers.bundles import NUM_CLASSES
from tests.test_upgrade import _bundle, _encoders, _fit_map

IDS = (ModelVersion("ab" * 32), ModelVersion("cd" * 32))
EVIDENCE = {"mapped": 0.9, "stale": 0.5, "re-embedded": 0.95, "global": 0.6}


def _linear_data(n=300, p=8, q=6, seed=0, rank=None):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, p)).astype(np.float32) * rng.uniform(0.1, 5, p).astype(np.float32)
    w = rng.normal(size=(p, q))
    if rank is not None:
        w = rng.normal(size=(p, rank)) @ rng.normal(size=(rank, q))
    b = rng.normal(size=q)
    return x, (x @ w + b).astype(np.float32), w, b


def _per_class_data(n=600, p=6, classes=3, seed=0):
    """Overlapping classes, each with its own affine map: one linear map cannot fit them."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    x = (rng.normal(size=(n, p)) + 0.5 * rng.normal(size=(classes, p))[labels]).astype(np.float32)
    ws, bs = rng.normal(size=(classes, p, p)), 2 * rng.normal(size=(classes, p))
    y = np.einsum("np,npq->nq", x, ws[labels]) + bs[labels]
    return x, y.astype(np.float32), labels, ws, bs


@pytest.mark.parametrize("form", ["ridge", "ridge standardised"])
def test_ridge_forms_recover_an_exact_linear_relation(form):
    x, y, w, b = _linear_data()
    fitted = mf.fit_candidate(mf.Candidate(form, 1e-9), x, y, np.zeros(len(x), int), 1)
    assert fitted.form == "linear" and not fitted.extra
    np.testing.assert_allclose(fitted.weight, w, atol=1e-3)
    np.testing.assert_allclose(fitted.bias, b, atol=1e-3)


def test_low_rank_recovers_a_low_rank_relation_and_cuts_a_full_one():
    x, y, w, b = _linear_data(q=8, rank=4)
    fitted = mf.fit_candidate(mf.Candidate("low-rank", 1e-9, 0.5), x, y, np.zeros(len(x)), 1)
    np.testing.assert_allclose(fitted.weight, w, atol=1e-3)
    np.testing.assert_allclose(fitted.bias, b, atol=1e-3)
    x, y, _, _ = _linear_data(q=8)
    cut = mf.fit_candidate(mf.Candidate("low-rank", 1e-9, 0.25), x, y, np.zeros(len(x)), 1)
    assert np.linalg.matrix_rank(cut.weight, tol=1e-4) == 2


def test_per_class_recovers_each_class_map():
    x, y, labels, ws, bs = _per_class_data()
    fitted = mf.fit_candidate(mf.Candidate("per-class", 1e-10, 1.0), x, y, labels, 3)
    assert fitted.form == "per-class"
    for c in range(3):
        np.testing.assert_allclose(
            fitted.weight + fitted.extra["class_weight"][c], ws[c], atol=1e-3
        )
        np.testing.assert_allclose(fitted.bias + fitted.extra["class_bias"][c], bs[c], atol=1e-2)
    np.testing.assert_allclose(fitted.apply(x, labels), y, atol=1e-2)


def test_a_per_class_map_by_hand():
    weight, bias = np.eye(2, dtype=np.float32), np.array([1, 0], np.float32)
    extra = {
        "class_weight": np.array([np.zeros((2, 2)), [[1, 0], [0, -2]]], np.float32),
        "class_bias": np.array([[0, 0], [0, 5]], np.float32),
    }
    z = np.array([[1, 2], [1, 2]], np.float32)
    out = apply_map("per-class", weight, bias, extra, z, np.array([0, 1]))
    np.testing.assert_array_equal(out, [[2, 2], [3, 3]])
    with pytest.raises(ValueError, match="label of every key"):
        apply_map("per-class", weight, bias, extra, z)


def test_cross_validation_picks_the_form_that_is_right():
    x, y, labels, _, _ = _per_class_data()
    cands = mf.candidates(1e-4, ("ridge standardised", "low-rank", "per-class"))
    scores = mf.cross_validate(cands, x, y, labels, 3, k=5, sigma=1.0)
    assert set(scores) == set(cands)
    assert mf.choose(scores).form == "per-class"
    # a linear relation whose classes the new space separates but the old one does not:
    # ridge keeps the separation, the rank cut and strong ridges lose it
    x, y, _, _ = _linear_data(n=400, q=8)
    labels = (y[:, 0] > np.median(y[:, 0])).astype(int)
    scores = mf.cross_validate(mf.candidates(1e-4, ("low-rank",)), x, y, labels, 2, k=5, sigma=1)
    chosen = mf.choose(scores)
    assert chosen.form == "ridge" and chosen.alpha <= 1e-2
    assert scores[chosen]["knn_accuracy"] > scores[mf.Candidate("ridge", 100.0)]["knn_accuracy"]


def test_choose_breaks_ties_by_squared_error_then_order():
    a, b, c = mf.Candidate("ridge", 1.0), mf.Candidate("ridge", 0.1), mf.Candidate("ridge", 10.0)
    scores = {
        a: {"knn_accuracy": 0.8, "mse": 0.2},
        b: {"knn_accuracy": 0.8, "mse": 0.1},
        c: {"knn_accuracy": 0.7, "mse": 0.0},
    }
    assert mf.choose(scores) == b
    scores[a]["mse"] = 0.1
    assert mf.choose(scores) == a


def test_fit_key_map_reports_every_candidate_and_ships_the_chosen_form():
    x, y, labels, _, _ = _per_class_data(n=500)
    logits = np.eye(3, dtype=np.float32)[labels]
    fit = fit_key_map(x, y, logits, labels, *IDS, num_classes=3, k=5, sigma=1.0)
    report = fit.to_dict()
    assert report["form"] == fit.chosen.name() and fit.chosen.form == "per-class"
    assert report["device_form"] == "per-class" == fit.key_map.form
    assert len(report["cv"]) == len(mf.RIDGE_ALPHAS) * 2 + 2 + 3
    best = max(s["knn_accuracy"] for s in report["cv"].values())
    assert report["cv"][report["form"]]["knn_accuracy"] == best
    assert fit.key_map.evidence["mapped"] >= fit.key_map.evidence["stale"]


def test_a_map_between_encoders_of_different_widths_is_fitted_and_judged():
    """A new architecture (another embedding width): old keys cannot be searched by the new
    queries, so staying is judged by the old encoder's own queries (it raised before)."""
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 3, 300)
    z_old = (np.eye(3)[labels] @ rng.normal(size=(3, 6)) + 0.1 * rng.normal(size=(300, 6))).astype(
        np.float32
    )
    z_new = (z_old @ rng.normal(size=(6, 4))).astype(np.float32)
    logits = np.eye(3, dtype=np.float32)[labels]
    fit = fit_key_map(z_old, z_new, logits, labels, *IDS, num_classes=3, k=5, sigma=1.0)
    assert fit.key_map.weight.shape == (6, 4) and fit.key_map.reverse_weight.shape == (4, 6)
    assert 0.0 <= fit.key_map.evidence["stale"] <= 1.0


def _per_class_map(classes=NUM_CLASSES, p_old=4, p_new=3) -> KeyMap:
    rng = np.random.default_rng(0)
    return KeyMap(
        rng.normal(size=(p_old, p_new)).astype(np.float32),
        rng.normal(size=p_new).astype(np.float32),
        *IDS,
        "map the keys",
        EVIDENCE,
        form="per-class",
        extra={
            "class_weight": rng.normal(size=(classes, p_old, p_new)).astype(np.float32),
            "class_bias": rng.normal(size=(classes, p_new)).astype(np.float32),
        },
    )


def test_a_per_class_map_round_trips_and_maps_in_chunks(tmp_path, monkeypatch):
    import edge_runtime.keymap as keymap

    saved = _per_class_map()
    saved.save(tmp_path / "m.npz")
    loaded = load_key_map(tmp_path / "m.npz")
    assert loaded.form == "per-class" and set(loaded.extra) == {"class_weight", "class_bias"}
    for name, array in saved.extra.items():  # class_weight read from the file class by class
        np.testing.assert_array_equal(np.stack(list(loaded.extra[name])), array)
    rng = np.random.default_rng(1)
    z, labels = rng.normal(size=(50, 4)).astype(np.float32), rng.integers(0, NUM_CLASSES, 50)
    monkeypatch.setattr(keymap, "MAP_CHUNK_ROWS", 7)
    chunked = np.concatenate(list(loaded.chunks(lambda a, b: z[a:b], len(z), labels)))
    np.testing.assert_allclose(chunked, loaded.apply(z, labels), rtol=1e-5, atol=1e-6)
    by_row = [loaded.apply(z[i : i + 1], labels[i : i + 1]) for i in range(len(z))]
    np.testing.assert_allclose(chunked, np.concatenate(by_row), rtol=1e-5, atol=1e-5)


def test_a_linear_map_file_has_no_form_and_old_files_load_as_linear(tmp_path):
    old = _per_class_map()
    linear = KeyMap(old.weight, old.bias, *IDS, "map the keys", EVIDENCE)
    linear.save(tmp_path / "l.npz")
    with np.load(tmp_path / "l.npz") as f:
        assert "form" not in f.files  # what a release before forms wrote
    loaded = load_key_map(tmp_path / "l.npz")
    assert loaded.form == "linear" and loaded.extra == {}
    np.testing.assert_allclose(
        loaded.apply(np.ones((2, 4), np.float32)),
        np.ones((2, 4)) @ old.weight + old.bias,
        rtol=1e-6,
    )


@pytest.mark.parametrize(
    "damage",
    [
        "unknown form",
        "float form",
        "missing class_bias",
        "class shape",
        "nan",
        "float64",
        "mlp arrays",
    ],
)
def test_bad_form_arrays_are_refused_with_one_line(tmp_path, damage):
    good = _per_class_map()
    good.save(tmp_path / "good.npz")
    with np.load(tmp_path / "good.npz") as f:
        arrays = {name: f[name] for name in f.files}
    if damage == "unknown form":
        arrays["form"] = np.int8(7)
    elif damage == "float form":
        arrays["form"] = np.float32(1)
    elif damage == "missing class_bias":
        del arrays["class_bias"]
    elif damage == "class shape":
        arrays["class_weight"] = arrays["class_weight"][:, :, :2].copy()
    elif damage == "nan":
        arrays["class_bias"] = np.full_like(arrays["class_bias"], np.nan)
    elif damage == "float64":
        arrays["class_weight"] = arrays["class_weight"].astype(np.float64)
    else:
        arrays["hidden_weight"] = np.zeros((4, 2), np.float32)
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError) as err:
        load_key_map(tmp_path / "bad.npz")
    assert "\n" not in str(err.value) and "bad.npz" in str(err.value)


def _real_per_class_map(old, new, out, classes=NUM_CLASSES):
    linear = load_key_map(_fit_map(old, new, out))
    rng = np.random.default_rng(0)
    p_old, p_new = linear.weight.shape
    KeyMap(
        linear.weight,
        linear.bias,
        linear.from_version,
        linear.to_version,
        "map the keys",
        EVIDENCE,
        form="per-class",
        extra={
            "class_weight": 1e-3 * rng.normal(size=(classes, p_old, p_new)).astype(np.float32),
            "class_bias": 1e-3 * rng.normal(size=(classes, p_new)).astype(np.float32),
        },
    ).save(out)
    return out


def test_upgrade_maps_each_key_by_its_stored_label(tmp_path):
    from edge_runtime.runtime import Runtime

    old, new = _encoders(tmp_path)
    device, release = _bundle(tmp_path, old, "a"), _bundle(tmp_path, new, "release")
    before = Runtime.load(device).datastore
    z_old, labels = before.key_rows(0, len(before)), before.labels_.copy()
    mapping = load_key_map(_real_per_class_map(old, new, tmp_path / "map.npz"))
    report = Runtime.load(device).upgrade(release, key_map=tmp_path / "map.npz")
    assert report.how == "mapped" and report.carried == len(labels)
    after = Runtime.load(device).datastore
    np.testing.assert_array_equal(after.labels_, labels)
    np.testing.assert_allclose(
        after.key_rows(0, len(after)), mapping.apply(z_old, labels), rtol=1e-5, atol=1e-5
    )


def test_upgrade_refuses_a_per_class_map_of_another_class_count(tmp_path, capsys):
    from edge_runtime.cli import main

    old, new = _encoders(tmp_path)
    device, release = _bundle(tmp_path, old, "a"), _bundle(tmp_path, new, "release")
    bad = _real_per_class_map(old, new, tmp_path / "map.npz", classes=NUM_CLASSES + 1)
    assert main(["upgrade", str(device), "--to", str(release), "--map", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "per-class" in err and "Traceback" not in err


def test_a_per_class_map_changed_after_its_check_is_refused(tmp_path):
    _per_class_map().save(tmp_path / "m.npz")
    loaded = load_key_map(tmp_path / "m.npz")
    (tmp_path / "m.npz").unlink()
    _per_class_map(classes=NUM_CLASSES + 1).save(tmp_path / "m.npz")  # another in its place
    with pytest.raises(ValueError, match="changed while it was in use"):
        loaded.apply(np.ones((2, 4), np.float32), np.array([0, 1]))


def test_no_per_class_map_a_device_would_refuse_for_its_size(monkeypatch):
    import export.upgrade_map as upgrade_map

    x, y, labels, _, _ = _per_class_data(n=300)
    monkeypatch.setattr(upgrade_map, "MAX_FORM_BYTES", 4 * 3 * 7 * 6 - 1)
    fit = fit_key_map(x, y, np.eye(3)[labels], labels, *IDS, num_classes=3, k=5, sigma=1.0)
    assert fit.key_map.form == "linear"
    assert not any(name.startswith("per-class") for name in fit.to_dict()["cv"])
