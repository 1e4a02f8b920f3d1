"""What every datastore backend shares: its parameters, read from its `__init__` signature (as
scikit-learn's `BaseEstimator` reads an estimator's) and checked through one table; the recipe
string that names it; and the start of `load`, which a bundle's hostile params and files go
through before a backend reads what the files hold. For the backends that store samples, also
the kernel posterior over the k nearest. Each backend adds its own search and its own files."""

from __future__ import annotations

import inspect
import os
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from zipfile import BadZipFile

import numpy as np

from .._io import load_npz, save_npz_atomic
from ..knn import kernel_posterior
from ..versions import EMBEDDING_ARRAY, ModelVersion, id_from_arrays
from . import recipes
from .common import (
    _NPZ_ARRAY_OVERHEAD,
    ParamCheck,
    _check_positive_number,
    _optional,
    _require,
    _subsample,
    check_fit_inputs,
    check_positive_int,
    datastore_file_name,
)

DatastoreT = TypeVar("DatastoreT", bound="BaseDatastore")
# what `load` raises for damaged or hostile files: a bundle reader turns each into one line
LOAD_ERRORS = (ValueError, TypeError, KeyError, OSError, EOFError, RuntimeError, BadZipFile)
INPUTS_ARRAY = "inputs"
# what kept raw inputs may be: uint8 images or int64 token ids (edge_runtime.preprocess)
INPUT_DTYPES = (np.dtype(np.uint8), np.dtype(np.int64))
SampleT = TypeVar("SampleT", bound="SampleDatastore")


@dataclass(frozen=True)
class SavedFiles:
    """A saved datastore as `load` found it: the listed files by extension (the layout checked),
    and the arrays of its .npz (read bounded, the backend's required arrays present)."""

    directory: Path
    by_kind: dict[str, list[str]]
    npz: str
    arrays: dict[str, np.ndarray]


class BaseDatastore:
    """The interface the runtime and the exporter use: fit, add, evict_oldest, predict_proba,
    save / load, recipe, estimate_nbytes, nbytes, sample_store.

    A backend sets `backend`, `FILES`, `FILES_RULE` and `NPZ_ARRAYS`, adds the checks of its
    own parameters to `PARAM_CHECKS`, implements `_restore`, and writes `__init__` as its
    signature over the body `self._init_params(locals())`: the one list of its parameters.
    It declares what the rest of the code asks of it below (recipe tokens, ONNX form, device
    extra, the sizer's axes) and its memory model in `estimate_nbytes`; the code outside
    `datastores/` reads these, never the backend's name (docs/extending.md)."""

    backend: ClassVar[str] = ""
    # the names of __init__'s parameters, read from its signature when a backend is defined
    PARAM_NAMES: ClassVar[tuple[str, ...]] = ()
    # per parameter name, the check a value must pass; a parameter without one is unchecked
    PARAM_CHECKS: ClassVar[dict[str, ParamCheck]] = {
        "num_classes": check_positive_int,
        "k": check_positive_int,
        "sigma": _check_positive_number,
        "n": _optional(check_positive_int),
    }
    # the files a save writes (their generation-0 names: one of each extension), the sentence a
    # different list is refused with, and the arrays the .npz must hold
    FILES: ClassVar[tuple[str, ...]] = ()
    FILES_RULE: ClassVar[str] = ""
    NPZ_ARRAYS: ClassVar[tuple[str, ...]] = ()
    # its recipe ("name:token:token"): per token (pattern, parameter, converter), the first full
    # match winning; the tokens in words for an error; the order and format a recipe writes them
    # in; parameters a recipe leaves out that it still records
    RECIPE_TOKENS: ClassVar[tuple[tuple[re.Pattern, str, Callable[[str], Any]], ...]] = ()
    RECIPE_HELP: ClassVar[str] = ""
    RECIPE_FORMAT: ClassVar[tuple[tuple[str, str], ...]] = ()
    RECIPE_DEFAULTS: ClassVar[dict[str, Any]] = {}
    # the backend and each recipe parameter in words (`knnper-edge info`)
    DESCRIPTION: ClassVar[str] = ""
    PARAM_WORDS: ClassVar[dict[str, str]] = {}
    # trained on the server (needs torch), not filled with samples: a device cannot init one, an
    # upgrade cannot re-key one, and the sizer trains it after the sample stores
    TRAINED: ClassVar[bool] = False
    # which of predictor_graph's forms writes its search as ONNX ops (None: it has no ONNX form,
    # so no one-session predictor and no `knnper-edge export-onnx`)
    ONNX_FORM: ClassVar[str | None] = None
    # the knnper-edge extra a device must install to load it (None: the runtime alone)
    DEVICE_EXTRA: ClassVar[str | None] = None
    # searches every stored key (the sizer prefers it among equals when nothing validates)
    EXACT_SEARCH: ClassVar[bool] = False
    # the sizer's grid of constructor parameters: their values, or the name of the SearchSpace
    # field that holds them (a sequence, or one value)
    SEARCH_AXES: ClassVar[dict[str, str | tuple]] = {}
    # a recipe that holds more samples in the same room and searches them exactly: the pruned
    # search skips this backend where that recipe is among the candidates
    DOMINATED_BY: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in vars(cls):
            cls.PARAM_NAMES = tuple(inspect.signature(cls.__init__).parameters)[1:]
            stray = sorted(set(cls.PARAM_CHECKS) - set(cls.PARAM_NAMES))
            if stray:
                raise TypeError(f"{cls.__name__} checks parameters it does not take: {stray}")

    def _init_params(self, arguments: Mapping[str, Any]) -> None:
        """The shared constructor: each parameter kept as the attribute of its name, unchecked
        (scikit-learn's convention; `check_params` checks them)."""
        for name in self.PARAM_NAMES:
            setattr(self, name, arguments[name])

    def get_params(self) -> dict[str, Any]:
        """The constructor's arguments by name, as scikit-learn's `get_params` gives them."""
        return {name: getattr(self, name) for name in self.PARAM_NAMES}

    def check_params(self) -> None:
        """Raise ValueError for constructor arguments the backend cannot use."""
        for name in self.PARAM_NAMES:
            check = self.PARAM_CHECKS.get(name)
            if check is not None:
                check(name, getattr(self, name))

    def recipe_params(self) -> dict:
        return recipes.recipe_params(self.backend, self.get_params())

    @property
    def recipe(self) -> str:
        return recipes.format_recipe(self.backend, self.recipe_params())

    @property
    def nbytes(self) -> int:
        return self.estimate_nbytes(len(self), self.embedding_dim_)

    @property
    def exact_fp32(self) -> bool:
        """Whether it searches every stored key exactly, as float32."""
        return False

    def stored_words(self) -> str:
        """What it holds, for `knnper-edge info`."""
        return f"{len(self)} stored"

    def single_session(self) -> bool:
        """Whether its prediction runs as one onnxruntime session with the encoder."""
        return False

    def estimate_nbytes(self, n: int, dim: int) -> int:
        raise NotImplementedError

    def file_nbytes(self, n: int, dim: int) -> int:
        """Upper bound on the saved files alone: `estimate_nbytes` without what a device holds
        beside them (the bytes candidates are ranked by, as the exporter measures files)."""
        return self.estimate_nbytes(n, dim)

    @classmethod
    def for_checks(cls: type[DatastoreT], z: np.ndarray, y: np.ndarray) -> DatastoreT:
        """A small datastore fitted on (z, y) with k = 3, for `check_backend` (checks.py). A
        backend that is trained rather than fitted with `fit` says how to build one."""
        return cls(int(y.max()) + 1, k=3).fit(z, y)

    @classmethod
    def from_params(cls: type[DatastoreT], params: dict) -> DatastoreT:
        """An unfitted datastore from a manifest's (hostile) params, checked before any file
        of it is read."""
        unknown = sorted(set(params) - set(cls.PARAM_NAMES))
        if unknown:
            raise ValueError(f"unknown {cls.backend} datastore parameter(s) {unknown}")
        if "num_classes" not in params:
            raise ValueError("loading a datastore needs num_classes")
        ds = cls(**params)
        ds.check_params()
        return ds

    @classmethod
    def load(
        cls: type[DatastoreT],
        directory: str | os.PathLike,
        params: dict,
        *,
        files: Sequence[str] | None = None,
        embedding_dim: int | None = None,
    ) -> DatastoreT:
        """Rebuild from saved files (`FILES` when none are named); ValueError names what is
        inconsistent. The params are checked before any file is read, the file list before the
        .npz is, and the .npz is read bounded; then the backend checks what the files hold."""
        ds = cls.from_params(params)
        names = list(files) if files is not None else list(cls.FILES)
        layout = Counter(Path(name).suffix for name in cls.FILES)
        by_kind = {ext: [f for f in names if f.endswith(ext)] for ext in layout}
        if any(len(by_kind[ext]) != count for ext, count in layout.items()) or len(names) != sum(
            layout.values()
        ):
            raise ValueError(f"{cls.FILES_RULE}, got {names}")
        npz = by_kind[".npz"][0]
        arrays = load_npz(Path(directory) / npz)
        _require(arrays, cls.NPZ_ARRAYS, npz)
        embedding = id_from_arrays(arrays, npz)
        ds = ds._restore(SavedFiles(Path(directory), by_kind, npz, arrays), embedding_dim)
        ds.embedding_id_ = embedding
        ds._restore_inputs(arrays, npz)
        return ds

    def _restore_inputs(self, arrays: dict[str, np.ndarray], npz: str) -> None:
        """Samples' raw inputs, where the recipe keeps them (SampleDatastore)."""
        if INPUTS_ARRAY in arrays:
            raise ValueError(f"{npz} holds raw inputs its recipe does not keep")

    def extra_arrays(self) -> dict[str, np.ndarray]:
        """What a save adds to its .npz: the embedding id of the encoder that embedded the
        keys (edge_runtime.versions), when it is known, and kept raw inputs."""
        version = ModelVersion.of_keys(self)
        out = {} if version is None else {EMBEDDING_ARRAY: version.as_array()}
        if getattr(self, "inputs_", None) is not None:
            out[INPUTS_ARRAY] = self.inputs_
        return out

    def save_npz(
        self, directory: str | os.PathLike, generation: int, arrays: dict, *, sync_dir: bool = True
    ) -> str:
        """Write `arrays` and `extra_arrays()` as datastore[.<generation>].npz (atomically,
        fsynced, uncompressed); returns its name: the .npz every backend's `save` writes."""
        name = datastore_file_name("datastore", "npz", generation)
        save_npz_atomic(
            Path(directory) / name, {**arrays, **self.extra_arrays()}, sync_dir=sync_dir
        )
        return name

    def _restore(self: DatastoreT, saved: SavedFiles, embedding_dim: int | None) -> DatastoreT:
        """This (unfitted, checked) datastore filled from its saved files, each checked."""
        raise NotImplementedError


class SampleDatastore(BaseDatastore):
    """A backend that stores samples and searches them (flat, HNSW): it holds a seeded random
    subset of at most `n` of the pairs it is fitted on, is itself what the runtime's update
    strategies add to and evict from, and its kNN-Per posterior is the kernel over what
    `kneighbors` finds. A backend implements `_store`, `_drop_oldest`, `keys` and
    `kneighbors`."""

    PARAM_CHECKS: ClassVar[dict[str, ParamCheck]] = {
        **BaseDatastore.PARAM_CHECKS,
        "inputs": _optional(check_positive_int),
    }

    def fit(
        self: SampleT, z: np.ndarray, y: np.ndarray, inputs: np.ndarray | None = None
    ) -> SampleT:
        """Store (a seeded random subset of at most n of) the pairs (z_i, y_i), and each
        sample's raw input where the recipe keeps them (`inputs`, x<bytes per sample>)."""
        self.check_params()
        z, y = check_fit_inputs(z, y, self.num_classes)
        if z.shape[0] == 0:
            raise ValueError("fit needs at least one sample")
        keep = _subsample(z.shape[0], self.n, self.seed)
        checked = self._checked_inputs(inputs, z.shape[0])
        self._store(z[keep], y[keep])
        self.inputs_ = None if checked is None else checked[keep]
        return self

    def fit_chunks(self: SampleT, chunks, count: int, y: np.ndarray) -> SampleT:
        """`fit` on `count` samples (count <= n) whose embeddings come as float32 chunks,
        oldest first: `chunks()` gives a new iterator each time it is called (a backend may
        read them twice). This default holds them all at once; a backend that can, holds one
        chunk at a time beside what it stores."""
        z = np.concatenate(list(chunks())) if count else np.zeros((0, 0), np.float32)
        return self.fit(z, y)

    def _checked_inputs(self, inputs: np.ndarray | None, count: int) -> np.ndarray | None:
        """`inputs` for `count` samples as the recipe keeps them (None where it keeps none)."""
        if self.inputs is None:
            return None
        if inputs is None:
            raise ValueError(f"{self.recipe} keeps raw inputs: give them with the samples")
        inputs = np.asarray(inputs)
        per_sample = inputs.nbytes // max(1, inputs.shape[0]) if inputs.ndim else -1
        if (
            inputs.dtype not in INPUT_DTYPES
            or inputs.ndim < 2
            or inputs.shape[0] != count
            or per_sample != self.inputs
        ):
            raise ValueError(
                f"{self.recipe} keeps {count} raw inputs of {self.inputs} bytes "
                f"(uint8 or int64), got {inputs.dtype} {list(inputs.shape)}"
            )
        return np.ascontiguousarray(inputs)

    def _append_inputs(self, inputs: np.ndarray | None, count: int) -> None:
        checked = self._checked_inputs(inputs, count)
        if checked is not None:
            self.inputs_ = np.concatenate([self.inputs_, checked.astype(self.inputs_.dtype)])

    def _restore_inputs(self, arrays: dict[str, np.ndarray], npz: str) -> None:
        if self.inputs is None:
            super()._restore_inputs(arrays, npz)
            self.inputs_ = None
            return
        _require(arrays, [INPUTS_ARRAY], npz)
        kept = arrays[INPUTS_ARRAY]
        if (
            kept.dtype not in INPUT_DTYPES
            or kept.ndim < 2
            or kept.shape[0] != len(self)
            or kept[:1].nbytes != self.inputs * min(1, len(self))
        ):
            raise ValueError(
                f"{npz}: inputs must be {len(self)} raw inputs of {self.inputs} "
                f"bytes each (uint8 or int64), got {kept.dtype} "
                f"{list(kept.shape)}"
            )
        self.inputs_ = kept

    def inputs_nbytes(self, n_samples: int) -> int:
        """Bytes the kept raw inputs of n_samples take in the .npz (0 where none are kept)."""
        return 0 if self.inputs is None else n_samples * self.inputs + _NPZ_ARRAY_OVERHEAD

    def _store(self, z: np.ndarray, y: np.ndarray) -> None:
        """Hold exactly these (checked) pairs, oldest first, in place of anything held."""
        raise NotImplementedError

    def sample_store(self: SampleT) -> SampleT:
        """What the runtime's update strategies add to and evict from: the datastore itself."""
        return self

    def evict_oldest(self: SampleT, count: int) -> SampleT:
        """Drop the `count` samples with the smallest insertion stamps."""
        if not 0 <= count <= len(self):
            raise ValueError(f"cannot evict {count} of {len(self)} samples")
        if count:
            self._drop_oldest(count)
            if getattr(self, "inputs_", None) is not None:
                self.inputs_ = self.inputs_[count:]
        return self

    def _drop_oldest(self, count: int) -> None:
        """Drop the `count` oldest samples (0 < count <= len(self))."""
        raise NotImplementedError

    def keys(self) -> np.ndarray:
        """The stored samples [n, p] as the search sees them, as a new float32 array, in the
        order of `labels_`."""
        return self.key_rows(0, len(self))

    def __len__(self) -> int:
        """The samples held: one label each (`labels_`, oldest first)."""
        return int(self.labels_.shape[0]) if hasattr(self, "labels_") else 0

    def key_rows(self, start: int, stop: int) -> np.ndarray:
        """Stored samples start..stop-1 [rows, p] as float32 (a chunk of `keys`, so that what
        reads every key, an upgrade's map, holds one chunk widened at a time)."""
        raise NotImplementedError

    def kneighbors(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def predict_proba(self, z: np.ndarray) -> np.ndarray:
        sq, rows = self.kneighbors(z)
        return kernel_posterior(
            sq, self.labels_[rows], self.num_classes, self.sigma, self.embedding_dim_
        )
