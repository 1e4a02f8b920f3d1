"""What every datastore backend shares: the recipe string that names it, the checks a loaded
one goes through before its files are read, the file layout check, and (for the backends that
store samples) the kernel posterior over the k nearest. Each backend adds its own search and its
own files."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..knn import kernel_posterior
from .common import _check_load_params
from .recipes import format_recipe


class Datastore:
    """The interface the runtime and the exporter use: fit, add, evict_oldest, predict_proba,
    save / load, recipe, estimate_nbytes, nbytes, sample_store. Subclasses set `backend`."""

    backend: str = ""

    def check_params(self) -> None:
        """Raise ValueError for constructor arguments the backend cannot use."""
        raise NotImplementedError

    def recipe_params(self) -> dict:
        raise NotImplementedError

    @property
    def recipe(self) -> str:
        return format_recipe(self.backend, self.recipe_params())

    @property
    def nbytes(self) -> int:
        return self.estimate_nbytes(len(self), self.embedding_dim_)

    def estimate_nbytes(self, n: int, dim: int) -> int:
        raise NotImplementedError

    def file_nbytes(self, n: int, dim: int) -> int:
        """Upper bound on the saved files alone: `estimate_nbytes` without what a device holds
        beside them (the bytes candidates are ranked by, as the exporter measures files)."""
        return self.estimate_nbytes(n, dim)

    @classmethod
    def from_params(cls, params: dict) -> Any:
        """An unfitted datastore from a manifest's (hostile) params, checked before any file
        of it is read."""
        ds = cls(**_check_load_params(cls, params))
        ds.check_params()
        return ds

    @staticmethod
    def files_by_kind(files: Sequence[str], layout: dict[str, int], what: str) -> dict[str, list]:
        """The listed files grouped by extension, refused unless they are exactly `layout`
        ({".npz": 1, ".bin": 1}: one of each)."""
        grouped = {ext: [f for f in files if f.endswith(ext)] for ext in layout}
        if any(len(grouped[ext]) != count for ext, count in layout.items()) or \
                len(files) != sum(layout.values()):
            raise ValueError(f"{what}, got {list(files)}")
        return grouped


class SampleDatastore(Datastore):
    """A backend that stores samples and searches them (flat, HNSW): the kNN-Per posterior is
    the kernel over what `kneighbors` finds."""

    def kneighbors(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def predict_proba(self, z: np.ndarray) -> np.ndarray:
        sq, rows = self.kneighbors(z)
        return kernel_posterior(
            sq, self.labels_[rows], self.num_classes, self.sigma, self.embedding_dim_
        )
