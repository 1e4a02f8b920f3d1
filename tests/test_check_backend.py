"""`check_backend` (edge_runtime.datastores.checks), scikit-learn's `check_estimator` for
datastore backends: every registered backend and the toy of docs/extending.md pass it, and a
backend that breaks one of its promises fails it, named."""

from __future__ import annotations

import numpy as np
import pytest

from edge_runtime.datastores import BACKENDS, check_backend, register_backend
from edge_runtime.datastores.checks import (
    check_add_and_evict,
    check_damaged_file_refused,
    check_estimate_bounds_saved_bytes,
)
from tests.helpers.projection_store import ProjectionDatastore


@pytest.fixture
def registered():
    """Register backends for one test (a recipe names its backend through the registry)."""
    added = []

    def register(cls):
        register_backend(cls)
        added.append(cls.backend)

    yield register
    for name in added:
        del BACKENDS[name]


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_registered_backend_passes(name):
    check_backend(BACKENDS[name])


def test_the_toy_backend_of_the_extending_page_passes(registered):
    registered(ProjectionDatastore)
    check_backend(ProjectionDatastore)


class _Undercounting(ProjectionDatastore):
    backend = "undercounting"

    def estimate_nbytes(self, n_samples: int, dim: int) -> int:
        return n_samples  # one byte a sample


class _EvictsTheNewest(ProjectionDatastore):
    backend = "evictsnewest"

    def _drop_oldest(self, count: int) -> None:
        self.keys_, self.labels_, self.order_ = (
            a[:-count] for a in (self.keys_, self.labels_, self.order_)
        )


class _ReadsAnything(ProjectionDatastore):
    backend = "readsanything"

    @classmethod
    def load(cls, directory, params, *, files=None, embedding_dim=None):
        ds = cls.from_params(params)
        z = np.zeros((1, embedding_dim), np.float32)
        return ds.fit(z, np.zeros(1, np.int64))


@pytest.mark.parametrize(
    "cls, check, message",
    [
        (_Undercounting, check_estimate_bounds_saved_bytes, "estimate_nbytes 24$"),
        (_EvictsTheNewest, check_add_and_evict, "did not leave the newest"),
        (_ReadsAnything, check_damaged_file_refused, "loaded with a damaged file list"),
    ],
)
def test_a_backend_that_breaks_a_promise_fails_by_name(registered, cls, check, message):
    registered(cls)
    with pytest.raises(AssertionError, match=f"^{cls.__name__} \\({cls.backend}\\): .*{message}"):
        check_backend(cls, (check,))
