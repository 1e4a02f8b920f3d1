"""The flat datastore holds its keys as stored (transposed, in their dtype: no widened copy) and
searches them exactly as the float32 keys they stand for; the top-k methods agree; thread
pinning restores the caller's setting."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from edge_runtime._io import save_npz_atomic
from edge_runtime.datastores import FlatDatastore
from edge_runtime.knn import (
    _float32_blocks,
    blockwise_topk,
    exact_search,
    int8_query,
    transposed_key_norms,
)
from edge_runtime.threads import BlasThreads


def _data(n=3000, dim=24, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, dim)).astype(np.float32), rng.integers(0, 5, n)


@pytest.mark.parametrize("dtype, itemsize", [("fp32", 4), ("fp16", 2), ("int8", 1)])
def test_keys_stay_in_their_stored_dtype_after_save_and_load(tmp_path, dtype, itemsize):
    z, y = _data()
    ds = FlatDatastore(5, dtype=dtype).fit(z, y)
    names = ds.save(tmp_path)
    back = FlatDatastore.load(tmp_path, {"num_classes": 5, "dtype": dtype}, files=names)
    assert back.keys_t_.shape == (24, 3000) and back.keys_t_.flags.c_contiguous
    assert back.keys_t_.nbytes == 3000 * 24 * itemsize  # no float32 copy of narrower keys
    with np.load(tmp_path / names[0]) as f:
        assert f["keys"].shape == (3000, 24)  # on disk: [n, p], in Fortran order
    q = _data(7, seed=1)[0]
    if dtype == "int8":  # int8 keys meet the query quantised as the integer scan does
        quantised, s = int8_query(q, back.scale_)
        q_seen = quantised * s / back.scale_[None, :]
        want = exact_search(q_seen, back.keys(), 10)
        want = (want[0] + (q**2).sum(1, keepdims=True) - (q_seen**2).sum(1, keepdims=True), want[1])
    else:
        want = exact_search(q, back.keys(), 10)  # the float32 keys they stand for
    got = back.kneighbors(q)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-4)


def test_batch_one_and_batches_search_alike():
    z, y = _data()
    ds = FlatDatastore(5, dtype="int8").fit(z, y)
    q = _data(9, seed=2)[0]
    sq, idx = ds.kneighbors(q)
    for i in range(len(q)):
        one_sq, one_idx = ds.kneighbors(q[i : i + 1])
        np.testing.assert_array_equal(one_idx[0], idx[i])
        np.testing.assert_allclose(one_sq[0], sq[i], rtol=1e-5, atol=1e-5)


def test_half_precision_widening_is_exact_and_rejects_non_finite():
    rng = np.random.default_rng(3)
    half = rng.normal(size=(5, 4100)).astype(np.float16)
    half[0, :4] = [0.0, -0.0, 6e-8, -65504.0]  # zeros, a subnormal, the largest
    widened = np.concatenate([b.copy() for _, _, b in _float32_blocks(half)], axis=1)
    np.testing.assert_array_equal(widened, half.astype(np.float32))
    assert np.array_equal(np.signbit(widened), np.signbit(half.astype(np.float32)))
    half[3, 4000] = np.inf
    assert not np.isfinite(transposed_key_norms(half)).all()


def test_blockwise_top_k_equals_argpartition():
    rng = np.random.default_rng(4)
    sq = rng.random((3, 20_000)).astype(np.float32)
    for k in (1, 10, 50):
        want = np.sort(np.argpartition(sq, k - 1, axis=1)[:, :k], axis=1)
        np.testing.assert_array_equal(np.sort(blockwise_topk(sq, k), axis=1), want)


def test_unsorted_or_repeated_order_stamps_are_refused(tmp_path):
    z, y = _data(10)
    for order in ([0, 1, 2, 3, 5, 4, 6, 7, 8, 9], [0, 1, 2, 3, 4, 4, 6, 7, 8, 9]):
        save_npz_atomic(
            tmp_path / "datastore.npz", {"keys": z, "labels": y, "order": np.array(order)}
        )
        with pytest.raises(ValueError, match="order stamps must be increasing"):
            FlatDatastore.load(tmp_path, {"num_classes": 5})


def test_blas_threads_are_pinned_while_computing_and_restored_after():
    blas = [lib for lib in threadpool_info() if lib["user_api"] == "blas"]
    if not blas:
        pytest.skip("numpy's BLAS is not visible to threadpoolctl")
    before = [lib["num_threads"] for lib in blas]
    pin = BlasThreads(1)
    with pin():
        inside = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    after = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    assert inside == [1] * len(blas) and after == before
    with pytest.raises(ValueError, match="positive integer"):
        BlasThreads(0)
