"""`check_backend(cls)`: what a datastore backend must do to be registered, checked the way
scikit-learn's `check_estimator` checks an estimator. Every built-in backend passes it, and so
must a new one (docs/extending.md): its saved files load back to the same predictions, its
memory model (`estimate_nbytes`) bounds the bytes it writes, it adds and evicts the oldest
samples as the runtime's update strategies ask, it predicts one distribution per query, and it
refuses a damaged file with an error a bundle reader turns into one line (`LOAD_ERRORS`).

Each check is a function of a fitted datastore (`cls.for_checks`) and an empty directory, and
fails with an AssertionError that names the backend and what it got wrong."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .base import LOAD_ERRORS

DIM, CLASSES, SAMPLES = 6, 3, 24


def _data(seed: int, count: int = SAMPLES) -> tuple[np.ndarray, np.ndarray]:
    """Separable float32 embeddings of CLASSES classes, every class present."""
    rng = np.random.default_rng(seed)
    y = np.arange(count) % CLASSES
    centres = rng.normal(scale=4.0, size=(CLASSES, DIM))
    return (centres[y] + rng.normal(size=(count, DIM))).astype(np.float32), y.astype(np.int64)


def _fail(ds: Any, what: str) -> AssertionError:
    return AssertionError(f"{type(ds).__name__} ({ds.backend}): {what}")


def _load(ds: Any, directory: Path, names: list[str]) -> Any:
    """What a bundle reader loads back: the recipe's params plus the head's, by the class."""
    params = {**ds.recipe_params(), "num_classes": ds.num_classes, "k": ds.k, "sigma": ds.sigma}
    return type(ds).load(directory, params, files=names, embedding_dim=ds.embedding_dim_)


def check_save_load_round_trip(ds: Any, directory: Path) -> None:
    """Saved and loaded, it is the same datastore: recipe, length and predictions."""
    queries, _ = _data(seed=1, count=5)
    again = _load(ds, directory, ds.save(directory, generation=0))
    if again.recipe != ds.recipe or len(again) != len(ds):
        raise _fail(ds, f"loads back as {again.recipe} ({len(again)}), saved {ds.recipe}")
    if not np.allclose(again.predict_proba(queries), ds.predict_proba(queries), atol=1e-6):
        raise _fail(ds, "predicts otherwise once saved and loaded")


def check_estimate_bounds_saved_bytes(ds: Any, directory: Path) -> None:
    """The files a save writes take at most `file_nbytes`, and that at most `estimate_nbytes`,
    for what it holds: the budget every caller sizes a datastore by."""
    names = ds.save(directory, generation=0)
    written = sum((directory / name).stat().st_size for name in names)
    files, estimate = ds.file_nbytes(len(ds), DIM), ds.estimate_nbytes(len(ds), DIM)
    if not written <= files <= estimate:
        raise _fail(ds, f"wrote {written} bytes; file_nbytes {files}, estimate_nbytes {estimate}")


def check_add_and_evict(ds: Any, directory: Path) -> None:
    """`add` grows what the update strategies hold (`sample_store`) by the samples given,
    `evict_oldest` takes the oldest first, and evicting more than is held is refused."""
    store = ds.sample_store()
    held = len(store)
    z, y = _data(seed=2, count=3)
    store.add(z, y)
    if len(store) != held + 3:
        raise _fail(ds, f"holds {len(store)} after adding 3 to {held}")
    store.evict_oldest(held)
    queries, _ = _data(seed=1, count=5)
    fresh = type(ds).for_checks(*_data(seed=0))
    fresh.sample_store().evict_oldest(held)
    fresh.sample_store().add(z, y)
    if len(store) != 3 or not np.allclose(ds.predict_proba(queries), fresh.predict_proba(queries)):
        raise _fail(ds, "evicting the oldest did not leave the newest samples")
    try:
        store.evict_oldest(4)
    except ValueError:
        return
    raise _fail(ds, "evicted 4 samples of 3 without a ValueError")


def check_predict_shapes(ds: Any, directory: Path) -> None:
    """One probability distribution over the classes per query, one query or many."""
    for count in (1, 7):
        queries, _ = _data(seed=3, count=count)
        p = ds.predict_proba(queries)
        if p.shape != (count, CLASSES) or not np.isfinite(p).all() or (p < 0).any():
            raise _fail(ds, f"predict_proba of {count} queries gave {p.dtype} {p.shape}")
        if not np.allclose(p.sum(axis=1), 1.0, atol=1e-5):
            raise _fail(ds, "predict_proba's rows do not sum to 1")


def check_damaged_file_refused(ds: Any, directory: Path) -> None:
    """A saved file cut short, or a file list not the backend's, is refused by `load` with one
    of `LOAD_ERRORS`, never read as a datastore."""
    names = ds.save(directory, generation=0)
    _load(ds, directory, names)  # whole, it loads
    for damage in ("file list", *names):
        if damage == "file list":
            listed = names[:-1] or [*names, names[0]]
        else:
            listed = names
            data = (directory / damage).read_bytes()
            (directory / damage).write_bytes(data[: len(data) // 2])
        try:
            _load(ds, directory, listed)
        except LOAD_ERRORS:
            continue
        raise _fail(ds, f"loaded with a damaged {damage}")


BACKEND_CHECKS: tuple[Callable[[Any, Path], None], ...] = (
    check_save_load_round_trip,
    check_estimate_bounds_saved_bytes,
    check_add_and_evict,
    check_predict_shapes,
    check_damaged_file_refused,
)


def check_backend(cls: type, checks: tuple[Callable[[Any, Path], None], ...] = BACKEND_CHECKS):
    """Run `checks` on a fitted datastore of backend `cls` each (`cls.for_checks` on a small
    separable sample), in a directory of its own; AssertionError at the first that fails."""
    for check in checks:
        with tempfile.TemporaryDirectory() as directory:
            check(cls.for_checks(*_data(seed=0)), Path(directory))
