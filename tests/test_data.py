"""Tests for fed_train.data: every loader, its validation, and the real data sets when present."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from fed_train.data import (
    DATASETS,
    LEAF_CHARS,
    SEQ_LEN,
    UNK_ID,
    VOCAB_SIZE,
    decode_text,
    download_cifar,
    encode_text,
    load_dataset,
    read_idx,
)
from fed_train.errors import DataError, KnnperError

SHARED_DATA = Path(
    os.environ.get("KNNPER_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")
)
FASHION = Path("/usr/share/datasets/fashion-mnist")


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is not on this machine")
    return path


# --------------------------------------------------------------------------- registry, errors


def test_registry_has_every_contract_name():
    expected = {"digits", "fashion-mnist", "mnist", "npz", "cifar10", "cifar100", "femnist"}
    assert expected | {"shakespeare"} == set(DATASETS)


def test_errors_are_knnper_and_value_errors():
    err = DataError("x")
    assert isinstance(err, KnnperError) and isinstance(err, ValueError)


def test_unknown_dataset_lists_known_names():
    with pytest.raises(
        DataError, match=r"unknown dataset 'imagenet'; known: digits, .*shakespeare"
    ):
        load_dataset("imagenet")


def test_missing_path_names_path_and_how_to_get_it(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match=r"nowhere does not exist; pass a directory with cifar"):
        load_dataset("cifar10", missing)


def test_dataset_without_default_needs_a_path():
    with pytest.raises(DataError, match=r"dataset 'mnist' needs a path: .*IDX"):
        load_dataset("mnist")


def test_unknown_loader_option_is_refused():
    with pytest.raises(DataError, match=r"takes no option\(s\) stride"):
        load_dataset("digits", stride=3)


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "10"])
def test_bad_max_train_is_refused(bad):
    with pytest.raises(DataError, match="max_train must be a positive integer"):
        load_dataset("digits", max_train=bad)


# --------------------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_digits_is_uint8_nhwc_with_stratified_split(digits):
    assert digits.x_train.shape[1:] == (8, 8, 1) and digits.x_train.dtype == np.uint8
    assert digits.y_train.dtype == np.int64 and digits.num_classes == 10
    assert len(digits.y_train) + len(digits.y_test) == 1797
    assert len(digits.y_test) == pytest.approx(0.25 * 1797, abs=1)
    assert digits.x_train.max() == 255
    train_share = np.bincount(digits.y_train) / len(digits.y_train)
    test_share = np.bincount(digits.y_test) / len(digits.y_test)
    assert np.abs(train_share - test_share).max() < 0.01


def test_image_spec_holds_training_mean_and_std_on_unit_scale(digits):
    spec = digits.input_spec
    assert spec["kind"] == "image" and spec["shape"] == [8, 8, 1] and spec["dtype"] == "uint8"
    pixels = digits.x_train.astype(np.float64) / 255.0
    assert spec["mean"] == pytest.approx([pixels.mean()], abs=1e-9)
    assert spec["std"] == pytest.approx([pixels.std()], abs=1e-9)
    json.dumps(spec)  # plain Python numbers: it goes into config.json and manifests


def test_digits_split_depends_on_seed_only(digits):
    again = load_dataset("digits", seed=0)
    other = load_dataset("digits", seed=1)
    np.testing.assert_array_equal(digits.x_train, again.x_train)
    assert not np.array_equal(digits.y_train, other.y_train)


def test_max_train_keeps_label_shares_and_is_seeded(digits):
    small = load_dataset("digits", max_train=200, seed=3)
    assert len(small.y_train) == 200 and len(small.y_test) == len(digits.y_test)
    full_share = np.bincount(digits.y_train, minlength=10) * 200 / len(digits.y_train)
    assert np.abs(np.bincount(small.y_train, minlength=10) - full_share).max() < 1
    again = load_dataset("digits", max_train=200, seed=3)
    np.testing.assert_array_equal(small.x_train, again.x_train)


# --------------------------------------------------------------------------- IDX


def _idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write_idx_dir(directory: Path, n_train=6, n_test=4, gz=False) -> None:
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 5, 4), dtype=np.uint8)
        labels = np.arange(n, dtype=np.uint8) % 10
        for kind, array, rank in (("images", images, 3), ("labels", labels, 1)):
            name = f"{split}-{kind}-idx{rank}-ubyte"
            data = _idx_bytes(array)
            if gz:
                (directory / (name + ".gz")).write_bytes(gzip.compress(data))
            else:
                (directory / name).write_bytes(data)


def test_read_idx_parses_a_hand_written_file(tmp_path):
    raw = bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 3]) + bytes(range(12))
    (tmp_path / "tiny").write_bytes(raw)
    (tmp_path / "tiny.gz").write_bytes(gzip.compress(raw))
    expected = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    np.testing.assert_array_equal(read_idx(tmp_path / "tiny"), expected)
    np.testing.assert_array_equal(read_idx(tmp_path / "tiny.gz"), expected)


def test_read_idx_big_endian_ints(tmp_path):
    raw = bytes([0, 0, 0x0C, 1, 0, 0, 0, 2]) + struct.pack(">2i", 258, -1)
    (tmp_path / "ints").write_bytes(raw)
    assert read_idx(tmp_path / "ints").tolist() == [258, -1]


def test_truncated_idx_names_the_file(tmp_path):
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(_idx_bytes(np.zeros((3, 4, 4), np.uint8))[:-5])
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte: truncated IDX file"):
        read_idx(path)
    path.write_bytes(bytes([0, 0, 8, 3, 0, 0]))
    with pytest.raises(DataError, match="truncated IDX file"):
        read_idx(path)


def test_wrong_magic_is_refused(tmp_path):
    path = tmp_path / "bad"
    path.write_bytes(b"\x1f\x8b\x08\x00" + bytes(20))
    with pytest.raises(DataError, match=r"bad: not an IDX file \(magic number 0x1f8b0800\)"):
        read_idx(path)


def test_trailing_bytes_are_refused(tmp_path):
    path = tmp_path / "long"
    path.write_bytes(_idx_bytes(np.zeros(3, np.uint8)) + b"xx")
    with pytest.raises(DataError, match="unexpected bytes after the IDX data"):
        read_idx(path)


def test_corrupt_gzip_is_a_data_error(tmp_path):
    path = tmp_path / "x.gz"
    path.write_bytes(gzip.compress(_idx_bytes(np.zeros(30, np.uint8)))[:-12])
    with pytest.raises(DataError, match=r"x.gz cannot be inflated"):
        read_idx(path)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_directory_loads_as_nhwc(tmp_path, gz):
    _write_idx_dir(tmp_path, gz=gz)
    ds = load_dataset("mnist", tmp_path)
    assert ds.x_train.shape == (6, 5, 4, 1) and ds.x_test.shape == (4, 5, 4, 1)
    assert ds.y_train.tolist() == [0, 1, 2, 3, 4, 5] and ds.num_classes == 10
    assert ds.name == "mnist" and ds.input_spec["shape"] == [5, 4, 1]


def test_idx_count_mismatch_names_the_label_file(tmp_path):
    _write_idx_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx_bytes(np.zeros(3, np.uint8)))
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte: 3 labels but .* holds 4 images"):
        load_dataset("fashion-mnist", tmp_path)


def test_idx_missing_file_is_named(tmp_path):
    _write_idx_dir(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match=r"missing train-labels-idx1-ubyte \(or .*\.gz\)"):
        load_dataset("mnist", tmp_path)


# --------------------------------------------------------------------------- npz


def _npz(path: Path, **overrides) -> Path:
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, size=(12, 6, 6), dtype=np.uint8),
        "y_train": np.arange(12) % 3,
        "x_test": rng.integers(0, 256, size=(5, 6, 6), dtype=np.uint8),
        "y_test": np.arange(5) % 3,
    }
    arrays.update(overrides)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


def test_npz_nhw_gets_a_channel_axis(tmp_path):
    ds = load_dataset("npz", _npz(tmp_path / "d.npz"))
    assert ds.x_train.shape == (12, 6, 6, 1) and ds.num_classes == 3
    assert ds.y_train.dtype == np.int64 and ds.groups_train is None


def test_npz_missing_keys_are_listed(tmp_path):
    path = _npz(tmp_path / "d.npz", y_test=None, x_test=None)
    with pytest.raises(DataError, match=r"d.npz: missing key\(s\) x_test, y_test"):
        load_dataset("npz", path)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"x_train": np.zeros((12, 6, 6), np.float32)}, "x_train: images must be uint8"),
        ({"x_train": np.zeros((12, 36), np.uint8)}, r"x_train: images must be NHW or NHWC"),
        ({"x_test": np.zeros((5, 7, 7), np.uint8)}, r"x_train images \(6, 6, 1\) != x_test"),
        ({"y_train": np.arange(11)}, "x_train has 12 images but y_train 11 labels"),
        ({"y_train": np.full(12, -1)}, "y_train: labels must be >= 0"),
        ({"y_train": np.zeros(12, np.float32)}, "y_train: labels must be integers"),
        ({"y_test": np.zeros((5, 2), np.int64)}, "y_test: labels must be 1-D"),
    ],
)
def test_npz_bad_contents_are_refused(tmp_path, overrides, message):
    with pytest.raises(DataError, match=message):
        load_dataset("npz", _npz(tmp_path / "d.npz", **overrides))


def test_npz_with_pickled_objects_is_refused(tmp_path):
    path = _npz(tmp_path / "d.npz", y_train=np.array([object()] * 12, dtype=object))
    with pytest.raises(DataError, match="not a readable .npz file"):
        load_dataset("npz", path)


def test_npz_that_is_not_a_zip_is_refused(tmp_path):
    path = tmp_path / "d.npz"
    path.write_bytes(b"definitely not a zip file")
    with pytest.raises(DataError, match="d.npz: not a readable .npz file"):
        load_dataset("npz", path)


def test_npz_groups_travel_with_max_train(tmp_path):
    path = _npz(tmp_path / "d.npz", groups_train=np.arange(12) // 4, groups_test=np.zeros(5, int))
    ds = load_dataset("npz", path, max_train=6)
    assert len(ds.groups_train) == 6 and len(ds.groups_test) == 5


# --------------------------------------------------------------------------- CIFAR


def _pickle_numpy1_style(obj: object) -> bytes:
    """A pickle naming numpy.core.multiarray, as the official (numpy 1.x) batches do."""
    raw = pickle.dumps(obj, protocol=3)
    return raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")


def _py2_str(value: bytes) -> bytes:
    return b"T" + struct.pack("<I", len(value)) + value  # BINSTRING: a Python 2 str


def _python2_batch(data: np.ndarray, labels: list[int]) -> bytes:
    """Byte for byte the layout of the official batches (Python 2, numpy 1.x, protocol 2)."""
    rows, cols = data.shape
    array = (
        b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85"
        + _py2_str(b"b")
        + b"\x87R(K\x01"
        + struct.pack("<BiBi", ord("J"), rows, ord("J"), cols)
        + b"\x86cnumpy\ndtype\n"
        + _py2_str(b"u1")
        + b"K\x00K\x01\x87R(K\x03"
        + _py2_str(b"|")
        + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89"
        + _py2_str(data.astype(np.uint8).tobytes())
        + b"tb"
    )
    label_list = b"](" + b"".join(b"K" + bytes([y]) for y in labels) + b"e"
    return b"\x80\x02}(" + _py2_str(b"data") + array + _py2_str(b"labels") + label_list + b"u."


def _cifar_images(n: int, offset: int) -> np.ndarray:
    """Rows of 3072 bytes: red plane offset, green offset+1, blue offset+2."""
    planes = [np.full((n, 1024), offset + c, np.uint8) for c in range(3)]
    return np.concatenate(planes, axis=1)


def _write_cifar10(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(1, 6):
        batch = {
            b"batch_label": b"training batch",
            b"labels": [i % 10, (i + 1) % 10],
            b"data": _cifar_images(2, 10 * i),
            b"filenames": [b"a.png", b"b.png"],
        }
        (directory / f"data_batch_{i}").write_bytes(_pickle_numpy1_style(batch))
    (directory / "test_batch").write_bytes(_python2_batch(_cifar_images(3, 100), [9, 8, 7]))


def test_cifar10_official_batches_load_as_nhwc(tmp_path):
    _write_cifar10(tmp_path / "cifar-10-batches-py")
    ds = load_dataset("cifar10", tmp_path)
    assert ds.x_train.shape == (10, 32, 32, 3) and ds.x_test.shape == (3, 32, 32, 3)
    assert ds.x_train[0, 5, 7].tolist() == [10, 11, 12]  # planes became channels
    assert ds.y_train[:2].tolist() == [1, 2] and ds.y_test.tolist() == [9, 8, 7]
    assert ds.x_test[2, 31, 31].tolist() == [100, 101, 102]  # the Python 2 style batch
    assert ds.num_classes == 10 and ds.coarse_train is None
    # the batches folder itself works too
    assert len(load_dataset("cifar10", tmp_path / "cifar-10-batches-py").y_train) == 10


def test_cifar100_official_batches_carry_coarse_labels(tmp_path):
    directory = tmp_path / "cifar-100-python"
    directory.mkdir()
    for split, n in (("train", 4), ("test", 2)):
        batch = {
            b"data": _cifar_images(n, 0),
            b"fine_labels": list(range(50, 50 + n)),
            b"coarse_labels": [10] * n,
        }
        (directory / split).write_bytes(pickle.dumps(batch, protocol=4))
    ds = load_dataset("cifar100", tmp_path)
    assert ds.num_classes == 100 and ds.y_train.tolist() == [50, 51, 52, 53]
    assert ds.coarse_train.tolist() == [10] * 4 and ds.coarse_test.tolist() == [10, 10]


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_cifar_batch_with_foreign_globals_is_refused(tmp_path):
    _write_cifar10(tmp_path)
    (tmp_path / "data_batch_3").write_bytes(pickle.dumps({b"data": _Exploit()}, protocol=2))
    with pytest.raises(DataError, match=r"data_batch_3: not a valid CIFAR batch .*not allowed"):
        load_dataset("cifar10", tmp_path)


def test_cifar_batch_missing_labels_is_refused(tmp_path):
    _write_cifar10(tmp_path)
    (tmp_path / "test_batch").write_bytes(pickle.dumps({b"data": _cifar_images(1, 0)}))
    with pytest.raises(DataError, match="test_batch: CIFAR batch lacks labels"):
        load_dataset("cifar10", tmp_path)


def test_cifar_from_npz_in_a_directory(tmp_path):
    x = np.zeros((4, 32, 32, 3), np.uint8)
    y = np.array([0, 1, 2, 3], np.uint8)
    np.savez(tmp_path / "cifar10.npz", x_train=x, y_train=y, x_test=x[:2], y_test=y[:2])
    ds = load_dataset("cifar10", tmp_path)
    assert ds.num_classes == 10 and ds.y_train.dtype == np.int64


def test_cifar_directory_without_data_says_what_it_wants(tmp_path):
    with pytest.raises(DataError, match="holds neither cifar-100-python/ nor cifar100.npz"):
        load_dataset("cifar100", tmp_path)


def test_download_cifar_refuses_unknown_names(tmp_path):
    with pytest.raises(DataError, match="unknown CIFAR data set 'cifar1000'"):
        download_cifar("cifar1000", tmp_path)


# --------------------------------------------------------------------------- LEAF JSON


def _write_leaf(directory: Path, split: str, user_data: dict) -> None:
    (directory / split).mkdir(parents=True, exist_ok=True)
    obj = {
        "users": list(user_data),
        "num_samples": [len(d["y"]) for d in user_data.values()],
        "user_data": user_data,
    }
    (directory / split / f"all_data_{split}.json").write_text(json.dumps(obj))


def _femnist_user(n: int, value: float, label: int) -> dict:
    return {"x": [[value] * 784 for _ in range(n)], "y": [label] * n}


def test_femnist_leaf_json_becomes_uint8_images_with_writer_groups(tmp_path):
    _write_leaf(
        tmp_path, "train", {"f_b": _femnist_user(3, 1.0, 61), "f_a": _femnist_user(2, 0.5, 4)}
    )
    _write_leaf(
        tmp_path, "test", {"f_a": _femnist_user(1, 0.0, 4), "f_b": _femnist_user(1, 1.0, 0)}
    )
    ds = load_dataset("femnist", tmp_path)
    assert ds.x_train.shape == (5, 28, 28, 1) and ds.x_train.dtype == np.uint8
    assert ds.num_classes == 62
    by_label = {int(y): int(x.max()) for x, y in zip(ds.x_train, ds.y_train, strict=True)}
    assert by_label == {61: 255, 4: 128}  # 1.0 (LEAF's white background) stays white
    # writers are indexed in sorted order, the same in train and test
    assert ds.groups_train[ds.y_train == 4].tolist() == [0, 0]
    assert ds.groups_train[ds.y_train == 61].tolist() == [1, 1, 1]
    assert sorted(ds.groups_test.tolist()) == [0, 1]


def test_femnist_bad_pixels_are_refused(tmp_path):
    _write_leaf(tmp_path, "train", {"u": {"x": [[0.5] * 783], "y": [1]}})
    _write_leaf(tmp_path, "test", {"u": _femnist_user(1, 0.0, 1)})
    with pytest.raises(DataError, match="x must be lists of 784 numbers"):
        load_dataset("femnist", tmp_path)


def test_femnist_label_out_of_range_is_refused(tmp_path):
    _write_leaf(tmp_path, "train", {"u": _femnist_user(1, 0.0, 62)})
    _write_leaf(tmp_path, "test", {"u": _femnist_user(1, 0.0, 1)})
    with pytest.raises(DataError, match="label 62 is out of range for 62 classes"):
        load_dataset("femnist", tmp_path)


def test_leaf_broken_json_names_the_file(tmp_path):
    _write_leaf(tmp_path / "data", "train", {"u": _femnist_user(1, 0.0, 1)})
    _write_leaf(tmp_path / "data", "test", {"u": _femnist_user(1, 0.0, 1)})
    (tmp_path / "data" / "test" / "broken.json").write_text("{not json")
    with pytest.raises(DataError, match=r"broken.json is not valid JSON .*; restore the LEAF file"):
        load_dataset("femnist", tmp_path)


def test_text_encoding_uses_leaf_vocabulary():
    assert len(LEAF_CHARS) == 80 and VOCAB_SIZE == 81
    ids = encode_text("Hi\n~é")
    assert ids.dtype == np.int64
    assert ids[:3].tolist() == [LEAF_CHARS.index(c) for c in "Hi\n"]
    assert ids[3:].tolist() == [UNK_ID, UNK_ID]
    assert decode_text(ids) == "Hi\n??"


def test_shakespeare_leaf_json(tmp_path):
    line = "To be, or not to be: that is the question. " * 2
    x = [line[i : i + SEQ_LEN] for i in range(3)]
    y = [line[i + SEQ_LEN] for i in range(3)]
    _write_leaf(tmp_path, "train", {"HAMLET": {"x": x[:2], "y": y[:2]}})
    _write_leaf(tmp_path, "test", {"HAMLET": {"x": x[2:], "y": y[2:]}})
    ds = load_dataset("shakespeare", tmp_path)
    assert ds.x_train.shape == (2, SEQ_LEN) and ds.x_train.dtype == np.int64
    assert decode_text(ds.x_test[0]) == x[2] and decode_text(ds.y_test) == y[2]
    assert ds.num_classes == VOCAB_SIZE
    assert ds.input_spec == {"kind": "tokens", "shape": [80], "dtype": "int64", "vocab_size": 81}


def test_shakespeare_leaf_json_wrong_window_length(tmp_path):
    _write_leaf(tmp_path, "train", {"A": {"x": ["short"], "y": ["t"]}})
    _write_leaf(tmp_path, "test", {"A": {"x": ["short"], "y": ["t"]}})
    with pytest.raises(DataError, match="x must be strings of 80 characters"):
        load_dataset("shakespeare", tmp_path)


def _by_role_file(path: Path) -> str:
    text = " ".join(f"w{i}" for i in range(200))[:500]  # no 80-character window repeats
    users = {
        "PLAY_LONG": [text[:250], text[250:]],
        "PLAY_SHORT": ["Too short."],
        "PLAY_MID": ["x" * 70],
    }
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump({"users": users, "user_play": dict.fromkeys(users, "play")}, f)
    return text[:250] + " " + text[250:]


def test_shakespeare_by_role_windows_split_in_time(tmp_path):
    path = tmp_path / "shakespeare_gutenberg_by_role.json.gz"
    joined = _by_role_file(path)
    ds = load_dataset("shakespeare", path, max_windows_per_role=50)
    # roles sorted: PLAY_LONG -> 0, PLAY_MID -> 1; PLAY_SHORT (< 64 characters) dropped
    assert set(ds.groups_train.tolist()) == {0, 1} == set(ds.groups_test.tolist())
    long_train = ds.x_train[ds.groups_train == 0]
    long_test = ds.x_test[ds.groups_test == 0]
    n = len(long_train) + len(long_test)
    assert n <= 50 and len(long_test) == round(0.2 * n)
    first = decode_text(long_train[0])
    assert first == joined[:SEQ_LEN] and decode_text(ds.y_train[:1]) == joined[SEQ_LEN]
    start_of_test = joined.index(decode_text(long_test[0]))
    assert start_of_test > joined.index(decode_text(long_train[-1]))  # test comes later
    # the 70-character role is left-padded so it still gives a handful of windows
    assert (ds.groups_train == 1).sum() >= 4 and (ds.groups_test == 1).sum() >= 1
    # a directory holding the file works as well
    assert len(load_dataset("shakespeare", tmp_path, max_windows_per_role=50).y_train) == len(
        ds.y_train
    )


def test_shakespeare_by_role_malformed(tmp_path):
    path = tmp_path / "roles.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"users": {"A": "not a list"}}).encode()))
    with pytest.raises(DataError, match="role 'A' must map to a list of strings"):
        load_dataset("shakespeare", path)


# --------------------------------------------------------------------------- real data


def test_real_fashion_mnist():
    _require(FASHION)
    ds = load_dataset("fashion-mnist")
    assert ds.x_train.shape == (60000, 28, 28, 1) and ds.x_test.shape == (10000, 28, 28, 1)
    assert np.bincount(ds.y_train).tolist() == [6000] * 10
    assert ds.input_spec["mean"] == pytest.approx([0.2860], abs=1e-3)
    assert ds.input_spec["std"] == pytest.approx([0.3530], abs=1e-3)


def test_real_cifar10_npz():
    path = _require(SHARED_DATA / "cifar10")
    ds = load_dataset("cifar10", path, max_train=2000)
    assert ds.x_test.shape == (10000, 32, 32, 3) and ds.x_train.shape == (2000, 32, 32, 3)
    assert np.bincount(ds.y_train).tolist() == [200] * 10
    assert ds.input_spec["mean"] == pytest.approx([0.491, 0.482, 0.447], abs=0.01)


def test_real_shakespeare_by_role():
    path = _require(SHARED_DATA / "shakespeare" / "shakespeare_gutenberg_by_role.json.gz")
    ds = load_dataset("shakespeare", path)
    assert len(np.unique(ds.groups_train)) == 1199  # roles with at least 64 characters
    assert ds.x_train.shape[1] == SEQ_LEN and ds.x_train.max() < VOCAB_SIZE
    assert (ds.x_train == UNK_ID).mean() < 0.01
    assert len(ds.y_test) == pytest.approx(0.2 * (len(ds.y_train) + len(ds.y_test)), rel=0.05)


# ----------------------------------------------------------------------- hostile data files


def _peak_bytes(load) -> int:
    """The most memory Python allocated while `load` ran (it must raise DataError)."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(DataError) as info:
            load()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("plant", ["fifo", "dev-zero"])
def test_leaf_folder_refuses_a_pipe_or_device_without_reading_it(tmp_path, plant):
    _write_leaf(tmp_path, "train", {"u": _femnist_user(1, 0.0, 1)})
    _write_leaf(tmp_path, "test", {"u": _femnist_user(1, 0.0, 1)})
    planted = tmp_path / "test" / "z.json"
    if plant == "fifo":
        os.mkfifo(planted)  # opening it for reading the usual way would wait forever
    else:
        planted.symlink_to("/dev/zero")  # reading it would never end
    with pytest.raises(DataError, match=r"z.json cannot be read \(not a regular file"):
        load_dataset("femnist", tmp_path)


def test_an_idx_gzip_bomb_inflates_no_further_than_its_header_declares(tmp_path):
    """A 10-image header followed by 200 MB of zeros (a 200 kB file): refused after reading
    the declared size plus one byte, never inflated whole."""
    path = tmp_path / "train-images-idx3-ubyte.gz"
    header = _idx_bytes(np.zeros((10, 28, 28), np.uint8))
    with gzip.open(path, "wb") as f:
        f.write(header)
        for _ in range(200):
            f.write(bytes(1 << 20))
    assert path.stat().st_size < 1 << 20
    assert _peak_bytes(lambda: read_idx(path)) < 16 << 20


def test_an_idx_header_declaring_more_than_memory_is_refused_before_reading(tmp_path):
    path = tmp_path / "x.gz"
    path.write_bytes(gzip.compress(b"\0\0\x08\x03" + struct.pack(">III", 2**32 - 1, 2**20, 2**20)))
    with pytest.raises(DataError, match="more than half of this machine's memory"):
        read_idx(path)


def test_a_cifar_pickle_of_shared_lists_is_refused_without_allocating(tmp_path):
    """A few kB of pickle whose memo makes one row stand for millions: numpy would have asked
    for gigabytes converting it."""
    row = [0] * 3072
    shared = [row] * 1000
    _write_cifar10(tmp_path)
    (tmp_path / "data_batch_2").write_bytes(
        pickle.dumps({b"data": [shared] * 1000, b"labels": [1]}, protocol=2)
    )
    assert (tmp_path / "data_batch_2").stat().st_size < 20_000
    assert _peak_bytes(lambda: load_dataset("cifar10", tmp_path)) < 64 << 20
    (tmp_path / "data_batch_2").write_bytes(
        pickle.dumps({b"data": _cifar_images(2, 0), b"labels": [shared] * 1000}, protocol=4)
    )
    with pytest.raises(DataError, match="labels must be a flat list"):
        load_dataset("cifar10", tmp_path)


def test_a_cifar_pickle_of_object_arrays_is_refused(tmp_path):
    _write_cifar10(tmp_path)
    labels = np.array([1, "x"], dtype=object)
    (tmp_path / "data_batch_2").write_bytes(
        pickle.dumps({b"data": _cifar_images(2, 0), b"labels": labels}, protocol=4)
    )
    with pytest.raises(DataError, match="object arrays are not allowed"):
        load_dataset("cifar10", tmp_path)


def test_an_idx_error_names_the_file_once(tmp_path):
    path = tmp_path / "bad.gz"
    path.write_bytes(gzip.compress(b"\x01\x02\x03\x04"))
    with pytest.raises(DataError) as info:
        read_idx(path)
    assert str(info.value).count(str(path)) == 1 and "not an IDX file" in str(info.value)
