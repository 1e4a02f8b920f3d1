"""Tests for fed_train.partition: every scheme, the per-client splits, validation, save/load."""

from __future__ import annotations

import numpy as np
import pytest

from fed_train.data import Dataset
from fed_train.errors import KnnperError, PartitionError
from fed_train.partition import SCHEMES, ClientSplit, Partition, _dirichlet_split, make_partition


def _dataset(
    per_label: int = 60, num_classes: int = 10, test_per_label: int = 20, groups: int = 0
) -> Dataset:
    """Tiny synthetic image data; x is irrelevant to partitioning, only labels matter."""
    y_train = np.repeat(np.arange(num_classes), per_label)
    y_test = np.repeat(np.arange(num_classes), test_per_label)
    ds = Dataset(
        "toy",
        np.zeros((len(y_train), 2, 2, 1), np.uint8),
        y_train,
        np.zeros((len(y_test), 2, 2, 1), np.uint8),
        y_test,
        num_classes,
        {},
    )
    if groups:
        rng = np.random.default_rng(1)
        ds.groups_train = rng.integers(0, groups, len(y_train))
        ds.groups_test = rng.integers(0, groups, len(y_test))
    return ds


def _cifar100_like() -> Dataset:
    y_train = np.repeat(np.arange(100), 30)
    y_test = np.repeat(np.arange(100), 5)
    ds = _dataset()
    ds.y_train, ds.y_test, ds.num_classes = y_train, y_test, 100
    ds.x_train = np.zeros((len(y_train), 1, 1, 1), np.uint8)
    ds.x_test = np.zeros((len(y_test), 1, 1, 1), np.uint8)
    ds.coarse_train, ds.coarse_test = y_train // 5, y_test // 5
    return ds


def _labels_of(ds: Dataset, client: ClientSplit) -> set[int]:
    return set(ds.y_train[np.concatenate([client.train, client.val])].tolist())


def _assert_disjoint(ds: Dataset, part: Partition, *, covers_train: bool) -> None:
    train = np.concatenate([np.concatenate([c.train, c.val]) for c in part.clients])
    test = np.concatenate([c.test for c in part.clients])
    assert len(np.unique(train)) == len(train), "a training sample is in two places"
    assert len(np.unique(test)) == len(test), "a test sample is in two clients"
    assert train.max() < len(ds.y_train) and test.max() < len(ds.y_test)
    if covers_train:
        assert len(train) == len(ds.y_train)
    part.check(ds)


# --------------------------------------------------------------------------- every scheme


@pytest.mark.parametrize(
    ("scheme", "ds_factory", "covers_train"),
    [
        ("dirichlet", _dataset, True),
        ("pathological", _dataset, True),
        ("natural", lambda: _dataset(groups=12), True),
        ("pachinko", _cifar100_like, True),
    ],
)
def test_partition_sizes_add_up_and_clients_are_disjoint(scheme, ds_factory, covers_train):
    ds = ds_factory()
    part = make_partition(ds, scheme, 12, seed=5)
    assert part.num_clients == 12
    _assert_disjoint(ds, part, covers_train=covers_train)
    for client in part.clients:
        assert len(client.val) >= 1 and len(client.train) >= 1
        assert client.train.dtype == np.int64 and client.test.dtype == np.int64


@pytest.mark.parametrize("scheme", ["dirichlet", "pathological", "pachinko"])
def test_same_seed_same_partition_other_seed_other_partition(scheme):
    ds = _cifar100_like()
    a = make_partition(ds, scheme, 10, seed=3)
    b = make_partition(ds, scheme, 10, seed=3)
    c = make_partition(ds, scheme, 10, seed=4)
    for x, y in zip(a.clients, b.clients, strict=True):
        for part in ("train", "val", "test"):
            np.testing.assert_array_equal(getattr(x, part), getattr(y, part))
    np.testing.assert_array_equal(a.unseen, b.unseen)
    pairs = zip(a.clients, c.clients, strict=True)
    assert any(not np.array_equal(x.train, y.train) for x, y in pairs)


# --------------------------------------------------------------------------- dirichlet


def test_dirichlet_label_counts_follow_the_draw():
    labels = np.repeat(np.arange(4), 10_000)
    shares, q = _dirichlet_split(labels, 7, 0.5, 2, np.random.default_rng(0))
    assert q.shape == (4, 7)
    counts = np.stack([np.bincount(labels[s], minlength=4) for s in shares], axis=1)
    assert np.abs(counts - q * 10_000).max() <= 1.0


def test_dirichlet_alpha_controls_heterogeneity():
    ds = _dataset(per_label=300)

    def top_label_share(alpha: float) -> float:
        part = make_partition(ds, "dirichlet", 10, alpha=alpha, seed=0)
        shares = []
        for c in part.clients:
            counts = np.bincount(ds.y_train[np.concatenate([c.train, c.val])], minlength=10)
            shares.append(counts.max() / counts.sum())
        return float(np.mean(shares))

    assert top_label_share(0.05) > 0.6
    assert top_label_share(1000.0) < 0.2


def test_dirichlet_that_cannot_feed_every_client_says_so():
    ds = _dataset(per_label=2, num_classes=10)
    with pytest.raises(PartitionError, match=r"dirichlet\(alpha=0.001\) .* fewer than 2 .* draws"):
        make_partition(ds, "dirichlet", 10, alpha=0.001)


# --------------------------------------------------------------------------- pathological


@pytest.mark.parametrize(("num_clients", "c"), [(10, 1), (12, 2), (7, 3), (5, 10)])
def test_pathological_gives_exactly_c_classes(num_clients, c):
    ds = _dataset()
    part = make_partition(ds, "pathological", num_clients, classes_per_client=c, seed=2)
    for client in part.clients:
        labels = _labels_of(ds, client)
        assert len(labels) == c
        assert set(ds.y_test[client.test].tolist()) <= labels


def test_pathological_needs_enough_classes():
    with pytest.raises(PartitionError, match="classes_per_client=11 is more than the 10 classes"):
        make_partition(_dataset(), "pathological", 5, classes_per_client=11)


# --------------------------------------------------------------------------- pachinko


def test_pachinko_needs_coarse_labels():
    with pytest.raises(PartitionError, match="pachinko needs coarse labels .* 'toy' has none"):
        make_partition(_dataset(), "pachinko", 5)


def test_pachinko_small_alpha_concentrates_on_few_coarse_labels():
    ds = _cifar100_like()
    part = make_partition(ds, "pachinko", 20, alpha=0.01, beta=10.0, seed=0)
    per_client = len(ds.y_train) // 20
    top = []
    for client in part.clients:
        idx = np.concatenate([client.train, client.val])
        assert len(idx) == per_client
        coarse = np.bincount(ds.coarse_train[idx], minlength=20)
        top.append(np.sort(coarse)[-3:].sum() / len(idx))
    assert np.mean(top) > 0.8  # Dir(0.01) puts nearly all mass on a few coarse labels


def test_pachinko_rejects_fine_labels_under_two_coarse_labels():
    ds = _cifar100_like()
    ds.coarse_train = ds.coarse_train.copy()
    ds.coarse_train[0] = 19
    with pytest.raises(PartitionError, match="fine label 0 appears under several coarse labels"):
        make_partition(ds, "pachinko", 5)


# --------------------------------------------------------------------------- natural


def test_natural_follows_groups_and_their_test_samples():
    ds = _dataset(groups=8)
    part = make_partition(ds, "natural", 8, seed=0)
    for client in part.clients:
        (group,) = set(ds.groups_train[np.concatenate([client.train, client.val])].tolist())
        np.testing.assert_array_equal(client.test, np.flatnonzero(ds.groups_test == group))


def test_natural_with_fewer_clients_keeps_the_largest_groups():
    ds = _dataset(groups=8)
    sizes = np.bincount(ds.groups_train)
    part = make_partition(ds, "natural", 3)
    kept = {int(ds.groups_train[c.train[0]]) for c in part.clients}
    assert kept == set(np.argsort(-sizes, kind="stable")[:3].tolist())


def test_natural_needs_groups():
    with pytest.raises(PartitionError, match="natural partition needs natural groups"):
        make_partition(_dataset(), "natural", 3)


def test_natural_cannot_have_more_clients_than_groups():
    with pytest.raises(PartitionError, match="num_clients=9 but only 8 groups"):
        make_partition(_dataset(groups=8), "natural", 9)


# --------------------------------------------------------------------------- per-client splits


def test_validation_is_the_requested_fraction():
    ds = _dataset()
    part = make_partition(ds, "pathological", 6, classes_per_client=2, val_fraction=0.25)
    for c in part.clients:
        n = len(c.train) + len(c.val)
        assert len(c.val) == int(np.floor(0.25 * n + 0.5))
    no_val = make_partition(ds, "dirichlet", 6, val_fraction=0.0)
    assert all(len(c.val) == 0 for c in no_val.clients)


def test_small_clients_still_get_one_validation_sample():
    ds = _dataset(per_label=2, num_classes=3)  # 6 samples, 3 clients of 2 samples
    part = make_partition(ds, "pathological", 3, classes_per_client=1, val_fraction=0.1)
    assert all((len(c.train), len(c.val)) == (1, 1) for c in part.clients)


def test_test_split_follows_each_clients_label_mix():
    ds = _dataset(per_label=100, test_per_label=50)
    part = make_partition(ds, "dirichlet", 5, alpha=0.5, seed=1)
    total_test = sum(len(c.test) for c in part.clients)
    assert total_test == len(ds.y_test)  # every label is held by someone: all test is dealt
    for label in range(10):
        held = np.array([np.sum(ds.y_train[np.r_[c.train, c.val]] == label) for c in part.clients])
        dealt = np.array([np.sum(ds.y_test[c.test] == label) for c in part.clients])
        assert np.abs(dealt - held * 50 / held.sum()).max() < 1.0


@pytest.mark.parametrize(("fraction", "expected"), [(0.0, 0), (0.2, 2), (0.25, 2), (0.29, 2)])
def test_unseen_clients_are_a_rounded_down_fraction(fraction, expected):
    part = make_partition(_dataset(), "dirichlet", 10, unseen_fraction=fraction)
    assert part.unseen.dtype == bool and part.unseen.sum() == expected


def test_summary_lists_sizes_per_client():
    part = make_partition(_dataset(), "dirichlet", 4, unseen_fraction=0.5)
    rows = part.summary()
    assert [r["client"] for r in rows] == [0, 1, 2, 3]
    assert sum(r["train"] + r["val"] for r in rows) == 600
    assert sum(r["unseen"] for r in rows) == 2


# --------------------------------------------------------------------------- bad settings


def test_errors_are_knnper_and_value_errors():
    assert issubclass(PartitionError, KnnperError) and issubclass(PartitionError, ValueError)


def test_unknown_scheme_lists_the_schemes():
    assert set(SCHEMES) == {"dirichlet", "pachinko", "pathological", "natural"}
    with pytest.raises(PartitionError, match="unknown partition scheme 'iid'; known: dirichlet, "):
        make_partition(_dataset(), "iid", 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": 0}, "alpha must be a positive number"),
        ({"alpha": -1.0}, "alpha must be a positive number"),
        ({"alpha": float("nan")}, "alpha must be a positive number"),
        ({"beta": 0.0}, "beta must be a positive number"),
        ({"classes_per_client": 0}, "classes_per_client must be a positive integer"),
        ({"classes_per_client": 1.5}, "classes_per_client must be a positive integer"),
        ({"val_fraction": 1.0}, r"val_fraction must be in \[0, 1\)"),
        ({"val_fraction": -0.1}, r"val_fraction must be in \[0, 1\)"),
        ({"unseen_fraction": 1.0}, r"unseen_fraction must be in \[0, 1\)"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(PartitionError, match=message):
        make_partition(_dataset(), "dirichlet", 3, **kwargs)


@pytest.mark.parametrize(
    ("num_clients", "message"),
    [
        (0, "num_clients must be at least 1"),
        (-3, "num_clients must be at least 1"),
        (2.0, "num_clients must be a positive integer"),
        (True, "num_clients must be a positive integer"),
        (601, "num_clients=601 is more than the 600 training samples"),
        (400, "600 training samples cannot give 400 clients 2 samples each"),
    ],
)
def test_bad_client_counts_are_refused(num_clients, message):
    with pytest.raises(PartitionError, match=message):
        make_partition(_dataset(), "dirichlet", num_clients)


# --------------------------------------------------------------------------- save / load


def test_save_load_round_trip(tmp_path):
    ds = _dataset(groups=6)
    part = make_partition(ds, "natural", 6, seed=9)
    path = tmp_path / "partition.npz"
    part.save(path)
    assert path.is_file() and not list(tmp_path.glob("*.part"))
    loaded = Partition.load(path)
    np.testing.assert_array_equal(loaded.unseen, part.unseen)
    for a, b in zip(part.clients, loaded.clients, strict=True):
        for name in ("train", "val", "test"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert loaded.summary() == part.summary()


def test_save_keeps_the_exact_file_name(tmp_path):
    make_partition(_dataset(), "dirichlet", 3).save(tmp_path / "split.bin")
    assert [p.name for p in tmp_path.iterdir()] == ["split.bin"]


def test_load_missing_file(tmp_path):
    with pytest.raises(PartitionError, match=r"partition file .*nope.npz does not exist"):
        Partition.load(tmp_path / "nope.npz")


def test_load_garbage_file(tmp_path):
    path = tmp_path / "p.npz"
    path.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(PartitionError, match="p.npz: not a partition file"):
        Partition.load(path)


def test_load_npz_of_something_else(tmp_path):
    path = tmp_path / "p.npz"
    np.savez(path, x_train=np.zeros(3))
    with pytest.raises(PartitionError, match=r"not a partition file \(missing format, version"):
        Partition.load(path)


def test_load_corrupt_offsets(tmp_path):
    path = tmp_path / "p.npz"
    make_partition(_dataset(), "dirichlet", 3).save(path)
    with np.load(path) as archive:
        arrays = dict(archive)
    arrays["val_offsets"] = arrays["val_offsets"][::-1].copy()
    np.savez(path, **arrays)
    with pytest.raises(PartitionError, match="corrupt val_offsets for 3 clients"):
        Partition.load(path)


def test_check_refuses_a_partition_for_other_data():
    part = make_partition(_dataset(per_label=60), "dirichlet", 3)
    with pytest.raises(PartitionError, match="out of range for dataset 'toy'"):
        part.check(_dataset(per_label=10))
