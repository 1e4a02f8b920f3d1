"""Datastore backends (flat / hnsw / protonn) behind one small surface, and their recipe strings.
A new backend is one module plus one `register_backend` line below (docs/extending.md).

Every backend answers the local kNN-Per posterior `predict_proba(z) -> [n, C]` and knows how to
save itself into a bundle directory and load back. The surface, scikit-learn style:

    ds = make_datastore("flat:int8:n500", num_classes=10, k=10, sigma=1.0).fit(z, y)
    ds.predict_proba(z_query); ds.add(z_new, y_new); ds.evict_oldest(3); len(ds)
    ds.estimate_nbytes(n, dim)        # bytes the saved files take for n samples (an upper bound
    ds.nbytes                         #   for flat and protonn, an estimate for hnsw)
    names = ds.save(directory, generation=0)
    ds = FlatDatastore.load(directory, {"num_classes": 10, "k": 10, "sigma": 1.0, "dtype": "int8"},
                            files=names, embedding_dim=64)

Every sample carries an insertion stamp (int64, increasing), so "evict the oldest" is defined for
the on-device update strategies. File names carry a generation number after the first save
(datastore.npz, datastore.1.npz, ...) so that an update never overwrites the files the current
manifest points at.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..knn import DEFAULT_K, DEFAULT_SIGMA
from .base import LOAD_ERRORS, BaseDatastore, SampleDatastore, SavedFiles
from .checks import BACKEND_CHECKS, check_backend
from .common import (
    DATASTORE_FILE_RE,
    FLAT_DTYPES,
    check_fit_inputs,
    check_labels_array,
    check_positive_int,
    datastore_file_name,
    file_generation,
    max_count_within,
)
from .flat import FlatDatastore
from .hnsw import HNSWDatastore
from .protonn import ProtoNNDatastore
from .recipes import format_recipe, parse_recipe, recipe_without
from .registry import BACKENDS, backend_class, register_backend

__all__ = [
    "BACKENDS",
    "BACKEND_CHECKS",
    "LOAD_ERRORS",
    "BaseDatastore",
    "DATASTORE_FILE_RE",
    "DEVICE_RECIPES",
    "EXACT_BACKEND",
    "EXACT_RECIPE",
    "FLAT_DTYPES",
    "FlatDatastore",
    "HNSWDatastore",
    "ProtoNNDatastore",
    "SampleDatastore",
    "SavedFiles",
    "TYPICAL_RECIPES",
    "backend_class",
    "check_backend",
    "check_fit_inputs",
    "check_labels_array",
    "check_positive_int",
    "datastore_file_name",
    "file_generation",
    "format_recipe",
    "load_datastore",
    "make_datastore",
    "max_count_within",
    "parse_recipe",
    "recipe_without",
    "register_backend",
]

register_backend(FlatDatastore)
register_backend(HNSWDatastore)
register_backend(ProtoNNDatastore)

# what `knnper-edge init` tries where no --recipes are given (every flat key dtype), and the
# exact float32 search a reference accuracy is measured with
DEVICE_RECIPES = ("flat:fp32", "flat:fp16", "flat:int8")
EXACT_BACKEND = FlatDatastore.backend  # every key compared with the query
EXACT_RECIPE = "flat:fp32"
# one typical recipe per built-in backend: what the runtime benchmarks measure by default
TYPICAL_RECIPES = ("flat:fp32", "hnsw:M16:ef64", "protonn:d32:m0.3")


def make_datastore(
    recipe: str, num_classes: int, k: int = DEFAULT_K, sigma: float = DEFAULT_SIGMA, **options: Any
) -> FlatDatastore | HNSWDatastore | ProtoNNDatastore:
    """An unfitted datastore for a recipe string.

    Parameters
    ----------
    recipe : "flat:fp32", "flat:fp16", "flat:int8", "hnsw:M16:ef64" or "protonn:d32:m0.3"
        (a backend and its parameters).
    num_classes : the number of classes the datastore's labels range over.
    k, sigma : the kNN head's neighbours and kernel scale.
    **options : other hyper-parameters (seed...).
    """
    name, params = parse_recipe(recipe)
    ds = BACKENDS[name](num_classes, k=k, sigma=sigma, **params, **options)
    ds.check_params()
    return ds


def load_datastore(
    directory: str | os.PathLike,
    backend: str,
    params: dict,
    *,
    files: Sequence[str] | None = None,
    embedding_dim: int | None = None,
):
    """Load a datastore of the named backend (see each class's `load`)."""
    return backend_class(backend).load(directory, params, files=files, embedding_dim=embedding_dim)
