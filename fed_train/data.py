"""Load the data sets kNN-Per trains on (digits, MNIST-likes, CIFAR, FEMNIST, Shakespeare, npz)."""

from __future__ import annotations

import gzip
import hashlib
import inspect
import io
import logging
import math
import pickle
import tarfile
import urllib.error
import urllib.request
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime._io import (
    JSONFileError,
    load_arrays,
    memory_limit,
    open_regular,
    read_exactly,
    read_json,
    read_within,
    write_path_atomic,
)
from edge_runtime.errors import one_line
from edge_runtime.manifest import MAX_WIDTH
from edge_runtime.values import is_integer
from fed_train.errors import DataError

__all__ = [
    "DATASETS",
    "DEFAULT_PATHS",
    "LEAF_CHARS",
    "SEQ_LEN",
    "UNK_ID",
    "VOCAB_SIZE",
    "Dataset",
    "decode_text",
    "download_cifar",
    "encode_text",
    "load_dataset",
    "read_idx",
    "stratified_subsample",
]

log = logging.getLogger(__name__)


@dataclass(repr=False)
class Dataset:
    """A train/test pair in the one layout every model, partitioner and exporter expects.

    Parameters
    ----------
    name : the data set's name (a key of DATASETS).
    x_train, x_test : inputs: images uint8 [N, H, W, C], text int64 [N, 80] character ids.
    y_train, y_test : int64 labels [N].
    num_classes : the number of classes.
    input_spec : how a model's input is prepared (`edge_runtime.preprocess.InputSpec`).
    groups_train, groups_test : each sample's natural client (writer, role), where the data
        set has one; the "natural" partition uses it.
    coarse_train, coarse_test : CIFAR-100's coarse (20) labels; the "pachinko" partition uses
        them.
    """

    name: str
    x_train: np.ndarray  # images: uint8 [N,H,W,C]; text: int64 [N,80] character ids
    y_train: np.ndarray  # int64 [N]
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_spec: dict
    groups_train: np.ndarray | None = None  # natural client (writer, role) per train sample
    groups_test: np.ndarray | None = None
    coarse_train: np.ndarray | None = None  # CIFAR-100 coarse (20) labels
    coarse_test: np.ndarray | None = None

    def __repr__(self) -> str:
        extra = "".join(
            f", {key}" for key in ("groups_train", "coarse_train") if getattr(self, key) is not None
        )
        return (
            f"Dataset({self.name!r}, train={tuple(self.x_train.shape)}, "
            f"test={tuple(self.x_test.shape)}, num_classes={self.num_classes}{extra})"
        )


# --------------------------------------------------------------------------- text vocabulary

# LEAF's 80 Shakespeare characters (leaf/models/utils/language_utils.py); anything else is UNK_ID.
LEAF_CHARS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
UNK_ID = len(LEAF_CHARS)
VOCAB_SIZE = len(LEAF_CHARS) + 1
SEQ_LEN = 80

_CHAR_TABLE = np.full(128, UNK_ID, dtype=np.int64)
_CHAR_TABLE[[ord(ch) for ch in LEAF_CHARS]] = np.arange(len(LEAF_CHARS))


def encode_text(text: str) -> np.ndarray:
    """Character ids (int64) of `text` in the LEAF vocabulary; unknown characters become UNK_ID."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)
    ids = _CHAR_TABLE[np.minimum(points, 127)]
    ids[points > 127] = UNK_ID
    return ids


def decode_text(ids: np.ndarray) -> str:
    """Inverse of encode_text, with '?' standing for the unknown id (for demos and debugging)."""
    chars = LEAF_CHARS + "?"
    return "".join(chars[int(i)] for i in np.asarray(ids).ravel())


# --------------------------------------------------------------------------- shared helpers

# Where a data set lives when no path is given; only system-wide installs belong here.
DEFAULT_PATHS: dict[str, Path] = {"fashion-mnist": Path("/usr/share/datasets/fashion-mnist")}

_HOW_TO_GET = {
    "fashion-mnist": "install Debian's package dataset-fashion-mnist "
    "(apt-get install dataset-fashion-mnist) or pass a directory with the four IDX files",
    "mnist": "pass a directory with the four MNIST IDX files "
    "(train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
    "t10k-labels-idx1-ubyte, optionally .gz)",
    "npz": "pass a .npz file with x_train, y_train, x_test, y_test",
    "cifar10": "pass a directory with cifar-10-batches-py/ or cifar10.npz "
    "(fed_train.data.download_cifar('cifar10', DIR) fetches the official batches)",
    "cifar100": "pass a directory with cifar-100-python/ or cifar100.npz "
    "(fed_train.data.download_cifar('cifar100', DIR) fetches the official batches)",
    "femnist": "pass LEAF's femnist data directory (train/ and test/ JSON files made by "
    "LEAF's preprocess.sh)",
    "shakespeare": "pass LEAF's shakespeare data directory (train/ and test/ JSON files) or "
    "shakespeare_gutenberg_by_role.json.gz",
}


def _require_path(path: Path | None, name: str) -> Path:
    """The data location for `name`: the given path or the default, which must exist."""
    if path is None:
        path = DEFAULT_PATHS.get(name)
        if path is None:
            raise DataError(f"dataset {name!r} needs a path: {_HOW_TO_GET[name]}")
    if not path.exists():
        raise DataError(f"dataset {name!r}: {path} does not exist; {_HOW_TO_GET[name]}")
    return path


def _json_limit() -> int:
    """Most bytes one JSON data file may hold: parsed, its numbers and strings take several
    times their text, so an eighth of the memory one input may take."""
    return memory_limit() // 8


def _as_labels(y: Any, what: str) -> np.ndarray:
    """Labels as int64 [N], refusing floats, other ranks and negative values."""
    y = np.asarray(y)
    if y.ndim != 1:
        raise DataError(f"{what}: labels must be 1-D, got shape {y.shape}")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{what}: labels must be integers, got {y.dtype}")
    y = y.astype(np.int64)
    if y.size and y.min() < 0:
        raise DataError(f"{what}: labels must be >= 0, found {y.min()}")
    return y


def _check_label_range(y: np.ndarray, num_classes: int, what: str) -> None:
    if y.size and y.max() >= num_classes:
        raise DataError(f"{what}: label {y.max()} is out of range for {num_classes} classes")


def _as_images(x: Any, what: str) -> np.ndarray:
    """uint8 images as NHWC, adding the channel axis to NHW."""
    x = np.asarray(x)
    if x.dtype != np.uint8:
        raise DataError(f"{what}: images must be uint8 (0..255), got {x.dtype}")
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4 or not 1 <= x.shape[-1] <= 4:
        raise DataError(f"{what}: images must be NHW or NHWC with 1-4 channels, got {x.shape}")
    return x


# --------------------------------------------------------------------------- digits


def _load_digits(path: Path | None, *, seed: int) -> Dataset:
    """scikit-learn's 8x8 digits, split 75/25 stratified so every run sees the same classes."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if path is not None:
        log.warning("digits ships with scikit-learn; ignoring path %s", path)
    digits = load_digits()
    x = np.rint(digits.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)[..., None]
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, stratify=y, random_state=seed
    )
    return Dataset("digits", x_train, y_train, x_test, y_test, 10, {})


# --------------------------------------------------------------------------- IDX (MNIST-likes)

_IDX_DTYPES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Parse one IDX file (optionally .gz): magic 00 00 <type> <ndim>, big-endian uint32 dims.
    The header is read first and the data after it inflated incrementally with the size the
    header declares as the bound, so memory never exceeds that size (itself bounded by
    memory_limit) however far a crafted .gz would inflate."""
    path = Path(path)
    try:
        with (
            open_regular(path) as raw_file,
            gzip.GzipFile(fileobj=raw_file) if path.suffix == ".gz" else raw_file as f,
        ):
            magic = read_exactly(f, 4, short_ok=True)
            if len(magic) < 4:
                raise DataError(f"{path}: truncated IDX file ({len(magic)} bytes, no header)")
            if magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_DTYPES or magic[3] == 0:
                raise DataError(f"{path}: not an IDX file (magic number 0x{magic.hex()})")
            ndim = magic[3]
            dims_raw = read_exactly(f, 4 * ndim, short_ok=True)
            if len(dims_raw) < 4 * ndim:
                raise DataError(f"{path}: truncated IDX file (header needs {4 + 4 * ndim} bytes)")
            dims = tuple(int(d) for d in np.frombuffer(dims_raw, dtype=">u4"))
            dtype = np.dtype(_IDX_DTYPES[magic[2]])
            size = math.prod(dims) * dtype.itemsize
            if size > memory_limit():
                raise DataError(
                    f"{path}: dims {dims} declare {size} bytes, more than half of "
                    "this machine's memory"
                )
            data = read_exactly(f, size + 1, short_ok=True)
    except DataError:
        raise
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:  # from read_exactly: "cannot be inflated (...)"
        raise DataError(f"{path} {exc}") from None
    if len(data) < size:
        raise DataError(
            f"{path}: truncated IDX file (dims {dims} need {size} bytes of data, "
            f"it holds {len(data)})"
        )
    if len(data) > size:
        raise DataError(f"{path}: unexpected bytes after the IDX data")
    array = np.frombuffer(data, dtype=dtype).reshape(dims)
    return array.astype(dtype.newbyteorder("="))


def _find_idx(directory: Path, stems: tuple[str, ...]) -> Path:
    for stem in stems:
        for suffix in ("", ".gz"):
            candidate = directory / (stem + suffix)
            if candidate.is_file():
                return candidate
    raise DataError(f"{directory}: missing {stems[0]} (or {stems[0]}.gz)")


def _idx_pair(directory: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 [N,H,W,1] and labels int64 [N] of one split, checked against each other."""
    images_file = _find_idx(directory, (f"{split}-images-idx3-ubyte", f"{split}-images.idx3-ubyte"))
    labels_file = _find_idx(directory, (f"{split}-labels-idx1-ubyte", f"{split}-labels.idx1-ubyte"))
    images = read_idx(images_file)
    labels = read_idx(labels_file)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise DataError(
            f"{images_file}: expected uint8 images [N,H,W], got {images.dtype} {images.shape}"
        )
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise DataError(
            f"{labels_file}: expected uint8 labels [N], got {labels.dtype} {labels.shape}"
        )
    if len(images) != len(labels):
        raise DataError(
            f"{labels_file}: {len(labels)} labels but {images_file.name} holds {len(images)} images"
        )
    y = labels.astype(np.int64)
    _check_label_range(y, 10, str(labels_file))
    return images[..., None], y


def _idx_loader(name: str) -> Callable[..., Dataset]:
    def load(path: Path | None, *, seed: int) -> Dataset:
        directory = _require_path(path, name)
        if not directory.is_dir():
            raise DataError(
                f"dataset {name!r}: {directory} is not a directory; {_HOW_TO_GET[name]}"
            )
        x_train, y_train = _idx_pair(directory, "train")
        x_test, y_test = _idx_pair(directory, "t10k")
        if x_train.shape[1:] != x_test.shape[1:]:
            raise DataError(
                f"{directory}: train images {x_train.shape[1:]} != test {x_test.shape[1:]}"
            )
        return Dataset(name, x_train, y_train, x_test, y_test, 10, {})

    load.__doc__ = f"{name} from a directory of IDX files."
    return load


# --------------------------------------------------------------------------- npz

_NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
MIN_IMAGE_SIDE = 4
_NPZ_OPTIONAL = ("groups_train", "groups_test", "coarse_train", "coarse_test", "num_classes")


def _npz_arrays(
    path: Path, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, np.ndarray]:
    """The `required` arrays of a .npz (no pickle) and those of `optional` it holds."""
    try:
        with load_arrays(path, memory_limit(), "arrays") as archive:
            missing = [key for key in required if key not in archive.files]
            if missing:
                raise DataError(
                    f"{path}: missing key(s) {', '.join(missing)} (has {archive.files})"
                )
            return {key: archive[key] for key in required + optional if key in archive.files}
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise DataError(f"{path}: not a readable .npz file ({one_line(exc)})") from None


def _load_npz_file(path: Path, name: str, num_classes: int | None = None) -> Dataset:
    """Images and labels from a .npz (no pickle), validated key by key."""
    arrays = _npz_arrays(path, _NPZ_KEYS, _NPZ_OPTIONAL)
    x_train = _as_images(arrays["x_train"], f"{path}: x_train")
    x_test = _as_images(arrays["x_test"], f"{path}: x_test")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(f"{path}: x_train images {x_train.shape[1:]} != x_test {x_test.shape[1:]}")
    y_train = _as_labels(arrays["y_train"], f"{path}: y_train")
    y_test = _as_labels(arrays["y_test"], f"{path}: y_test")
    for x, y, split in ((x_train, y_train, "train"), (x_test, y_test, "test")):
        if len(x) != len(y):
            raise DataError(f"{path}: x_{split} has {len(x)} images but y_{split} {len(y)} labels")
    if len(y_train) == 0:
        raise DataError(f"{path}: x_train is empty")

    if "num_classes" in arrays:
        declared = arrays["num_classes"]
        if declared.shape != () or declared.dtype.kind not in "iu":
            raise DataError(
                f"{path}: num_classes must be one integer, got {declared.dtype} "
                f"{list(declared.shape)}"
            )
        num_classes = int(declared)
    if num_classes is None:
        num_classes = int(max(y_train.max(), y_test.max(initial=0))) + 1
    if not 1 <= num_classes <= MAX_WIDTH:  # the model's head is this wide
        raise DataError(
            f"{path}: {num_classes} classes (from num_classes or the largest "
            f"label); this trainer takes 1 to {MAX_WIDTH}"
        )
    if min(x_train.shape[1:3]) < MIN_IMAGE_SIDE:
        raise DataError(
            f"{path}: images are {x_train.shape[1]}x{x_train.shape[2]}; the models "
            f"pool twice and need at least {MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE} pixels"
        )
    _check_label_range(y_train, num_classes, f"{path}: y_train")
    _check_label_range(y_test, num_classes, f"{path}: y_test")

    extras: dict[str, np.ndarray | None] = {}
    for kind in ("groups", "coarse"):
        present = [f"{kind}_{s}" in arrays for s in ("train", "test")]
        if any(present) and not all(present):
            raise DataError(f"{path}: {kind}_train and {kind}_test must come together")
        for split, y in (("train", y_train), ("test", y_test)):
            key = f"{kind}_{split}"
            extras[key] = _as_labels(arrays[key], f"{path}: {key}") if key in arrays else None
            if extras[key] is not None and len(extras[key]) != len(y):
                raise DataError(f"{path}: {key} has {len(extras[key])} entries, y_{split} {len(y)}")
    return Dataset(name, x_train, y_train, x_test, y_test, num_classes, {}, **extras)


def load_server_arrays(path: Path, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """x_train and y_train of a .npz the server holds (`knnper export --public-data`; test
    arrays, if any, are not read), its labels checked against the run's `num_classes`."""
    arrays = _npz_arrays(path, ("x_train", "y_train"))
    x = _as_images(arrays["x_train"], f"{path}: x_train")
    y = _as_labels(arrays["y_train"], f"{path}: y_train")
    if len(x) != len(y) or len(y) == 0:
        raise DataError(f"{path}: x_train has {len(x)} images and y_train {len(y)} labels")
    _check_label_range(y, num_classes, f"{path}: y_train")
    return x, y


def _load_npz(path: Path | None, *, seed: int) -> Dataset:
    """Any image data set saved as x_train, y_train, x_test, y_test."""
    return _load_npz_file(_require_path(path, "npz"), "npz")


# --------------------------------------------------------------------------- CIFAR


def _numpy_reconstruct() -> Callable[..., Any]:
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler for the official CIFAR batches: plain containers plus numpy arrays, nothing else.

    The batches are dicts of bytes/str/int/list and numpy arrays; those need only the three
    numpy globals below, so any other global (os.system, builtins.eval, ...) is refused.
    """

    def find_class(self, module: str, name: str) -> Any:
        allowed = {
            ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct,
            ("numpy._core.multiarray", "_reconstruct"): _numpy_reconstruct,
            ("numpy", "ndarray"): lambda: np.ndarray,
            ("numpy", "dtype"): lambda: _plain_dtype,
        }
        if (module, name) not in allowed:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a data batch")
        return allowed[(module, name)]()


def _plain_dtype(*args: Any) -> np.dtype:
    """np.dtype for a batch's arrays, which hold numbers: an object dtype would be a pickle
    inside the pickle."""
    dtype = np.dtype(*args)
    if dtype.hasobject:
        raise pickle.UnpicklingError("object arrays are not allowed in a data batch")
    return dtype


# An official batch holds 10,000 (CIFAR-10) or 50,000 (CIFAR-100) images: 154 MB at most.
MAX_BATCH_BYTES = 1 << 30


def _load_batch(path: Path) -> dict[str, Any]:
    """One official CIFAR batch as a dict with str keys (Python 2 pickles give bytes keys).
    A regular file of at most MAX_BATCH_BYTES, unpickled with numpy arrays as the only
    globals; a pickle's memo can make a few bytes refer to one list a million times, so
    what it decodes to is checked in _batch_arrays before numpy converts it."""
    raw = read_within(
        path, MAX_BATCH_BYTES, lambda why: DataError(f"{path}: the CIFAR batch file {why}")
    )
    try:
        obj = _RestrictedUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        OSError,
        MemoryError,
        RecursionError,
    ) as exc:
        raise DataError(
            f"{path}: not a valid CIFAR batch ({type(exc).__name__}: {one_line(exc)[:200]})"
        ) from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: not a valid CIFAR batch (a {type(obj).__name__}, not a dict)")
    return {k.decode("latin-1") if isinstance(k, bytes) else str(k): v for k, v in obj.items()}


def _batch_arrays(path: Path, label_keys: tuple[str, ...]) -> list[np.ndarray]:
    """Images uint8 [N,32,32,3] then one int64 array per label key."""
    batch = _load_batch(path)
    missing = [key for key in ("data",) + label_keys if key not in batch]
    if missing:
        raise DataError(f"{path}: CIFAR batch lacks {', '.join(missing)}")
    data = batch["data"]
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3 * 32 * 32
    ):
        got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: CIFAR data must be a uint8 array [N,3072], got {got}")
    images = np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    out = [images]
    for key in label_keys:
        labels = _batch_labels(batch[key], f"{path}: {key}")
        if len(labels) != len(images):
            raise DataError(f"{path}: {len(labels)} {key} for {len(images)} images")
        out.append(labels)
    return out


def _batch_labels(value: Any, what: str) -> np.ndarray:
    """A batch's labels: a flat list of ints or a 1-D integer array. Checked element by element
    before numpy sees them: a list of lists shared through the pickle's memo would otherwise
    convert to an array of gigabytes, and a huge int would overflow."""
    if isinstance(value, list):
        if not all(type(v) is int and 0 <= v < 2**31 for v in value):
            raise DataError(f"{what}: labels must be a flat list of small non-negative integers")
        value = np.asarray(value, dtype=np.int64)
    if not isinstance(value, np.ndarray):
        raise DataError(f"{what}: labels must be a list or an array, got {type(value).__name__}")
    return _as_labels(value, what)


def _cifar_pickles(directory: Path, name: str) -> Dataset:
    if name == "cifar10":
        parts = [_batch_arrays(directory / f"data_batch_{i}", ("labels",)) for i in range(1, 6)]
        x_train = np.concatenate([p[0] for p in parts])
        y_train = np.concatenate([p[1] for p in parts])
        x_test, y_test = _batch_arrays(directory / "test_batch", ("labels",))
        _check_label_range(y_train, 10, f"{directory}: labels")
        _check_label_range(y_test, 10, f"{directory}: labels")
        return Dataset(name, x_train, y_train, x_test, y_test, 10, {})
    keys = ("fine_labels", "coarse_labels")
    x_train, y_train, c_train = _batch_arrays(directory / "train", keys)
    x_test, y_test, c_test = _batch_arrays(directory / "test", keys)
    for y, n, what in (
        (y_train, 100, "fine"),
        (y_test, 100, "fine"),
        (c_train, 20, "coarse"),
        (c_test, 20, "coarse"),
    ):
        _check_label_range(y, n, f"{directory}: {what}_labels")
    return Dataset(
        name, x_train, y_train, x_test, y_test, 100, {}, coarse_train=c_train, coarse_test=c_test
    )


_CIFAR = {
    # name: (official archive URL, its md5, folder inside the archive, file marking the folder)
    "cifar10": (
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        "c58f30108f718f92721af3b95e74349a",
        "cifar-10-batches-py",
        "data_batch_1",
    ),
    "cifar100": (
        "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        "eb9058c3a382ffc7106e4002c42a8d85",
        "cifar-100-python",
        "train",
    ),
}


def _cifar_loader(name: str) -> Callable[..., Dataset]:
    def load(path: Path | None, *, seed: int) -> Dataset:
        location = _require_path(path, name)
        num_classes = 10 if name == "cifar10" else 100
        if location.is_file():
            return _load_npz_file(location, name, num_classes)
        if (location / f"{name}.npz").is_file():
            return _load_npz_file(location / f"{name}.npz", name, num_classes)
        _, _, folder, marker = _CIFAR[name]
        for directory in (location / folder, location):
            if (directory / marker).is_file():
                return _cifar_pickles(directory, name)
        raise DataError(f"dataset {name!r}: {location} holds neither {folder}/ nor {name}.npz")

    load.__doc__ = f"{name} from the official python batches or an npz."
    return load


def download_cifar(name: str, dest: str | Path) -> Path:
    """Fetch and unpack the official CIFAR archive into `dest`; returns the batches folder."""
    if name not in _CIFAR:
        raise DataError(f"unknown CIFAR data set {name!r}; known: {', '.join(_CIFAR)}")
    url, md5, folder, marker = _CIFAR[name]
    dest = Path(dest)
    if (dest / folder / marker).is_file():
        return dest / folder
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / url.rsplit("/", 1)[1]
    if not archive.is_file():
        log.info("downloading %s to %s", url, archive)
        try:
            write_path_atomic(archive, lambda tmp: urllib.request.urlretrieve(url, tmp))
        except (urllib.error.URLError, OSError) as exc:
            raise DataError(f"cannot download {url} ({exc})") from exc
    digest = hashlib.md5(archive.read_bytes()).hexdigest()
    if digest != md5:
        raise DataError(f"{archive}: md5 {digest} does not match the official {md5}; delete it")
    with tarfile.open(archive, "r:gz") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python without extraction filters: refuse absolute or escaping member names
            for member in tar.getmembers():
                if member.name.startswith("/") or ".." in Path(member.name).parts:
                    raise DataError(f"{archive}: unsafe member {member.name}")
            tar.extractall(dest)
    return dest / folder


# --------------------------------------------------------------------------- LEAF JSON


def _read_data_json(file: Path, fix: str) -> Any:
    """A JSON data file through the project's one bounded reader (regular files only, at most
    _json_limit bytes even once inflated); DataError naming the file and `fix`."""
    try:
        return read_json(file, limit=_json_limit(), fix=fix, strict=False)
    except FileNotFoundError:
        raise DataError(f"{file}: missing; {fix}") from None
    except JSONFileError as exc:
        raise DataError(str(exc)) from None


def _leaf_split_dirs(location: Path) -> tuple[Path, Path] | None:
    """LEAF's train/ and test/ folders, at `location` or under `location/data`."""
    for base in (location, location / "data"):
        if (base / "train").is_dir() and (base / "test").is_dir():
            return base / "train", base / "test"
    return None


def _read_leaf_users(directory: Path) -> dict[str, dict[str, list]]:
    """Merge user_data of every JSON file in a LEAF split folder."""
    files = sorted(directory.glob("*.json"))
    if not files:
        raise DataError(f"{directory}: no LEAF .json files")
    users: dict[str, dict[str, list]] = {}
    for file in files:
        obj = _read_data_json(file, "restore the LEAF file or remove it from the folder")
        user_data = obj.get("user_data") if isinstance(obj, dict) else None
        if not isinstance(user_data, dict):
            raise DataError(f"{file}: LEAF JSON needs a 'user_data' object")
        for user, data in user_data.items():
            if not isinstance(data, dict) or not {"x", "y"} <= data.keys():
                raise DataError(f"{file}: user {user!r} needs 'x' and 'y' lists")
            if len(data["x"]) != len(data["y"]):
                raise DataError(
                    f"{file}: user {user!r} has {len(data['x'])} x but {len(data['y'])} y"
                )
            merged = users.setdefault(str(user), {"x": [], "y": []})
            merged["x"].extend(data["x"])
            merged["y"].extend(data["y"])
    return users


def _leaf_arrays(
    users: dict[str, dict[str, list]],
    index: dict[str, int],
    convert: Callable[[list, list, str], tuple[np.ndarray, np.ndarray]],
    what: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stack every user's samples; groups hold the user's index."""
    xs, ys, gs = [], [], []
    for user, data in users.items():
        if not data["y"]:
            continue
        x, y = convert(data["x"], data["y"], f"{what} user {user!r}")
        xs.append(x)
        ys.append(y)
        gs.append(np.full(len(y), index[user], dtype=np.int64))
    if not xs:
        raise DataError(f"{what}: no samples")
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(gs)


def _leaf_dataset(
    name: str,
    dirs: tuple[Path, Path],
    convert: Callable[[list, list, str], tuple[np.ndarray, np.ndarray]],
    num_classes: int,
) -> Dataset:
    """LEAF's train/ and test/ folders as a Dataset whose groups are its users, numbered over
    both splits so that a user keeps one index in each."""
    train, test = (_read_leaf_users(d) for d in dirs)
    index = {user: i for i, user in enumerate(sorted(train.keys() | test.keys()))}
    x_train, y_train, g_train = _leaf_arrays(train, index, convert, str(dirs[0]))
    x_test, y_test, g_test = _leaf_arrays(test, index, convert, str(dirs[1]))
    return Dataset(
        name,
        x_train,
        y_train,
        x_test,
        y_test,
        num_classes,
        {},
        groups_train=g_train,
        groups_test=g_test,
    )


def _femnist_user(x: list, y: list, what: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        pixels = np.asarray(x, dtype=np.float32)
    except (ValueError, TypeError) as exc:
        raise DataError(f"{what}: x must be lists of 784 numbers ({exc})") from exc
    if pixels.ndim != 2 or pixels.shape[1] != 28 * 28:
        raise DataError(f"{what}: x must be lists of 784 numbers, got shape {pixels.shape}")
    if not np.isfinite(pixels).all():
        raise DataError(f"{what}: x holds NaN or infinite values")
    images = np.rint(np.clip(pixels, 0.0, 1.0) * 255.0).astype(np.uint8).reshape(-1, 28, 28, 1)
    labels = _as_labels(np.asarray(y), what)
    _check_label_range(labels, 62, what)
    return images, labels


def _load_femnist(path: Path | None, *, seed: int) -> Dataset:
    """LEAF's FEMNIST: 62 classes of handwritten characters, one natural client per writer."""
    location = _require_path(path, "femnist")
    dirs = _leaf_split_dirs(location)
    if dirs is None:
        raise DataError(f"dataset 'femnist': {location} has no train/ and test/ folders")
    return _leaf_dataset("femnist", dirs, _femnist_user, 62)


def _shakespeare_user(x: list, y: list, what: str) -> tuple[np.ndarray, np.ndarray]:
    if not all(isinstance(s, str) and len(s) == SEQ_LEN for s in x):
        raise DataError(f"{what}: x must be strings of {SEQ_LEN} characters")
    if not all(isinstance(s, str) and len(s) == 1 for s in y):
        raise DataError(f"{what}: y must be single characters")
    return encode_text("".join(x)).reshape(-1, SEQ_LEN), encode_text("".join(y))


def _windows(text: str, max_windows: int, min_windows: int) -> tuple[np.ndarray, np.ndarray]:
    """SEQ_LEN-character windows and the next character, evenly strided through `text`.

    Short texts get leading spaces so every kept role yields at least `min_windows` windows.
    """
    ids = encode_text(" " * max(0, SEQ_LEN + min_windows - len(text)) + text)
    positions = len(ids) - SEQ_LEN
    stride = max(1, math.ceil(positions / max_windows))
    starts = np.arange(0, positions, stride)
    view = np.lib.stride_tricks.sliding_window_view(ids, SEQ_LEN)
    return view[starts], ids[starts + SEQ_LEN]


def _shakespeare_by_role(
    file: Path, min_chars: int, max_windows: int, test_fraction: float
) -> Dataset:
    """One client per speaking role; each role's windows split in time, LEAF style."""
    obj = _read_data_json(file, "restore or re-download the by-role file")
    roles = obj.get("users") if isinstance(obj, dict) else None
    if not isinstance(roles, dict):
        raise DataError(f"{file}: by-role JSON needs a 'users' object of role -> lines")
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("xtr", "ytr", "gtr", "xte", "yte", "gte")}
    group = 0
    for role in sorted(roles):
        lines = roles[role]
        if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
            raise DataError(f"{file}: role {role!r} must map to a list of strings")
        text = " ".join(lines)
        if len(text) < min_chars:
            continue
        x, y = _windows(text, max_windows, min_windows=5)
        n_test = max(1, int(math.floor(test_fraction * len(y) + 0.5)))
        cut = len(y) - n_test
        for key, value in (("xtr", x[:cut]), ("ytr", y[:cut]), ("xte", x[cut:]), ("yte", y[cut:])):
            parts[key].append(value)
        parts["gtr"].append(np.full(cut, group, dtype=np.int64))
        parts["gte"].append(np.full(n_test, group, dtype=np.int64))
        group += 1
    if group == 0:
        raise DataError(f"{file}: no role has at least {min_chars} characters")
    a = {key: np.concatenate(value) for key, value in parts.items()}
    return Dataset(
        "shakespeare",
        a["xtr"],
        a["ytr"],
        a["xte"],
        a["yte"],
        VOCAB_SIZE,
        {},
        groups_train=a["gtr"],
        groups_test=a["gte"],
    )


def _load_shakespeare(
    path: Path | None,
    *,
    seed: int,
    min_chars: int = 64,
    max_windows_per_role: int = 200,
    test_fraction: float = 0.2,
) -> Dataset:
    """Next-character prediction from LEAF JSON or the by-role Gutenberg file.

    `min_chars`, `max_windows_per_role` and `test_fraction` apply to the by-role file only
    (LEAF's JSON is already windowed and split).
    """
    location = _require_path(path, "shakespeare")
    if max_windows_per_role < 1 or not 0 < test_fraction < 1:
        raise DataError("shakespeare: max_windows_per_role must be >= 1, test_fraction in (0, 1)")
    if location.is_file():
        return _shakespeare_by_role(location, min_chars, max_windows_per_role, test_fraction)
    dirs = _leaf_split_dirs(location)
    if dirs is not None:
        return _leaf_dataset("shakespeare", dirs, _shakespeare_user, VOCAB_SIZE)
    candidates = sorted(location.glob("*by_role*.json*"))
    if candidates:
        return _shakespeare_by_role(candidates[0], min_chars, max_windows_per_role, test_fraction)
    raise DataError(
        f"dataset 'shakespeare': {location} has neither train/ and test/ folders nor a "
        "*by_role*.json.gz file"
    )


# --------------------------------------------------------------------------- registry and finish

DATASETS: dict[str, Callable[..., Dataset]] = {
    "digits": _load_digits,
    "fashion-mnist": _idx_loader("fashion-mnist"),
    "mnist": _idx_loader("mnist"),
    "npz": _load_npz,
    "cifar10": _cifar_loader("cifar10"),
    "cifar100": _cifar_loader("cifar100"),
    "femnist": _load_femnist,
    "shakespeare": _load_shakespeare,
}


def stratified_subsample(y: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of `size` samples keeping each label's share (largest remainders)."""
    classes, counts = np.unique(y, return_counts=True)
    quota = counts * (size / len(y))
    take = np.floor(quota).astype(np.int64)
    leftover = size - int(take.sum())
    take[np.argsort(-(quota - take), kind="stable")[:leftover]] += 1
    order = rng.permutation(len(y))
    by_label = order[np.argsort(y[order], kind="stable")]  # labels grouped, random within
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    chosen = [by_label[s : s + k] for s, k in zip(starts, take, strict=True)]
    return np.sort(np.concatenate(chosen))


def _channel_stats(x: np.ndarray) -> tuple[list[float], list[float]]:
    """Exact per-channel mean/std on the 0..1 scale, via histograms (no float copy of x)."""
    channels = x.shape[-1]
    flat = x.reshape(-1, channels)
    hist = np.zeros((channels, 256), dtype=np.int64)
    chunk = 1 << 21
    for start in range(0, len(flat), chunk):
        block = flat[start : start + chunk]
        for c in range(channels):
            hist[c] += np.bincount(block[:, c], minlength=256)
    values = np.arange(256) / 255.0
    total = hist.sum(axis=1)
    mean = hist @ values / total
    var = (hist * (values[None, :] - mean[:, None]) ** 2).sum(axis=1) / total
    std = np.sqrt(var)
    std[std < 1e-6] = 1.0  # constant channel: leave it unscaled rather than divide by zero
    return [float(m) for m in mean], [float(s) for s in std]


def _input_spec(ds: Dataset) -> dict:
    if ds.x_train.ndim == 4:
        mean, std = _channel_stats(ds.x_train)
        return {
            "kind": "image",
            "shape": [int(d) for d in ds.x_train.shape[1:]],
            "dtype": "uint8",
            "mean": mean,
            "std": std,
        }
    return {
        "kind": "tokens",
        "shape": [int(ds.x_train.shape[1])],
        "dtype": "int64",
        "vocab_size": int(ds.num_classes),
    }


def load_dataset(
    name: str,
    path: str | Path | None = None,
    *,
    max_train: int | None = None,
    exclude_train: np.ndarray | None = None,
    seed: int = 0,
    **options: Any,
) -> Dataset:
    """Load data set `name` from `path` (or its default location).

    Parameters
    ----------
    name : a key of DATASETS ("digits", "fashion-mnist", "mnist", "npz", "cifar10",
        "cifar100", "femnist", "shakespeare").
    path : the data's file or folder; None uses the data set's default location (digits
        ships with scikit-learn).
    max_train : keep a stratified, seeded subsample of this many training samples (for quick
        runs); None keeps all.
    exclude_train : training-set indices removed first (a server's pretraining split, which
        no client may see).
    seed : seeds the subsample (and any loader's own draws).
    **options : go to the loader (e.g. shakespeare's max_windows_per_role).

    Returns
    -------
    Dataset : train and test arrays, the number of classes and the input spec.
    """
    loader = DATASETS.get(name)
    if loader is None:
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    accepted = set(inspect.signature(loader).parameters) - {"path", "seed"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise DataError(
            f"dataset {name!r} takes no option(s) {', '.join(unknown)}"
            + (f"; it takes {', '.join(sorted(accepted))}" if accepted else "")
        )
    if max_train is not None and (not is_integer(max_train) or max_train < 1):
        raise DataError(f"max_train must be a positive integer, got {max_train!r}")
    ds = loader(None if path is None else Path(path), seed=seed, **options)
    if exclude_train is not None:
        excluded = np.asarray(exclude_train)
        n = len(ds.y_train)
        if excluded.ndim != 1 or (excluded.size and not np.issubdtype(excluded.dtype, np.integer)):
            raise DataError(
                f"exclude_train must be 1-D integer indices, got {excluded.dtype} {excluded.shape}"
            )
        outside = excluded[(excluded < 0) | (excluded >= n)]
        if outside.size:
            raise DataError(
                f"exclude_train holds index {outside[0]}, outside the {n} training "
                f"samples of {name!r}"
            )
        _keep_train(ds, np.setdiff1d(np.arange(n), excluded))
    if max_train is not None and max_train < len(ds.y_train):
        _keep_train(
            ds, stratified_subsample(ds.y_train, int(max_train), np.random.default_rng(seed))
        )
    ds.input_spec = _input_spec(ds)
    return ds


def _keep_train(ds: Dataset, keep: np.ndarray) -> None:
    """Keep only these training samples, with their groups and coarse labels."""
    ds.x_train, ds.y_train = ds.x_train[keep], ds.y_train[keep]
    if ds.groups_train is not None:
        ds.groups_train = ds.groups_train[keep]
    if ds.coarse_train is not None:
        ds.coarse_train = ds.coarse_train[keep]
