"""Several processes sharing one bundle: writers adding and readers loading and predicting at the
same time. Every acknowledged sample must be in the datastore afterwards, the bundle must load
after every step, and no reader may ever fail on it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edge_runtime.bundle import BundleBusy, BundleError
from edge_runtime.locking import directory_lock
from edge_runtime.runtime import Runtime
from tests.helpers.bundles import REPO, build_bundle, make_images, raw_outputs, snapshot

STRESS_SECONDS = 6.0
BATCH = 5

_WORKER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from edge_runtime.bundle import BundleBusy, BundleError
    from edge_runtime.runtime import Runtime

    role, bundle, worker, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    deadline = time.monotonic() + seconds
    steps = 0
    if role == "writer":
        rt = Runtime.load(bundle, intra_op_threads=1)
        batch = 0
        while time.monotonic() < deadline:
            rng = np.random.default_rng([worker, batch])
            x = rng.integers(0, 256, ({batch_size}, 8, 8, 1), dtype=np.uint8)
            y = rng.integers(0, 4, {batch_size})
            try:
                rt.add(x, y, strategy="concatenate")
            except BundleBusy:
                continue
            except BundleError as exc:
                if "changed on disk" not in str(exc):
                    raise
                rt = Runtime.load(bundle, intra_op_threads=1)  # another writer committed
                continue
            print("ack", worker, batch, flush=True)  # only after add returned
            batch += 1
    else:
        x = np.random.default_rng(worker).integers(0, 256, (8, 8, 8, 1), dtype=np.uint8)
        while time.monotonic() < deadline:
            rt = Runtime.load(bundle, intra_op_threads=1)
            assert rt.predict_proba(x).shape == (8, 4)
            steps += 1
        print("loads", steps, flush=True)
""").replace("{batch_size}", str(BATCH))


def _start(role: str, bundle: Path, worker: int) -> subprocess.Popen:
    script = bundle.parent / "worker.py"
    script.write_text(_WORKER)
    return subprocess.Popen(
        [sys.executable, str(script), role, str(bundle), str(worker), str(STRESS_SECONDS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )


def test_two_writers_and_a_reader_lose_nothing_and_never_see_a_torn_bundle(tmp_path):
    bundle = build_bundle(tmp_path, n=60, budget=10**7)
    start = Runtime.load(bundle)
    procs = [_start("writer", bundle, 1), _start("writer", bundle, 2), _start("reader", bundle, 3)]
    results = [p.communicate(timeout=STRESS_SECONDS + 60) for p in procs]
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
    acked = [line.split()[1:] for out, _ in results[:2] for line in out.splitlines()]
    assert len(acked) >= 4, "the writers made too little progress to test anything"
    assert int(results[2][0].split()[1]) >= 3, "the reader made too little progress"

    final = Runtime.load(bundle)
    assert len(final.datastore) == len(start.datastore) + BATCH * len(acked)
    for worker, batch in acked:
        rng = np.random.default_rng([int(worker), int(batch)])
        x = rng.integers(0, 256, (BATCH, 8, 8, 1), dtype=np.uint8)
        z, _ = raw_outputs(tmp_path / "encoder.onnx", x)
        nearest, _ = final.datastore.kneighbors(z)  # each acknowledged sample finds itself
        assert np.all(nearest[:, 0] < 1e-4), f"lost batch {batch} of writer {worker}"


def test_add_waits_for_the_lock_then_reports_busy_and_changes_nothing(tmp_path):
    bundle = build_bundle(tmp_path)
    rt = Runtime.load(bundle, lock_timeout=0.2)
    before = snapshot(bundle)
    with directory_lock(bundle, exclusive=True):  # another writer mid-update
        with pytest.raises(BundleBusy, match="is busy"):
            rt.add(*make_images(3, 1))
        with pytest.raises(BundleBusy, match="is busy"):
            Runtime.load(bundle, lock_timeout=0.2)
    assert snapshot(bundle) == before and len(rt.datastore) == 60
    rt.add(*make_images(3, 1))  # once the lock is free
    assert len(Runtime.load(bundle).datastore) == 60  # fifo at capacity


def test_readers_share_the_lock(tmp_path):
    bundle = build_bundle(tmp_path)
    with directory_lock(bundle, exclusive=False):
        Runtime.load(bundle, lock_timeout=0.2)


def test_a_writer_that_loaded_before_another_commit_is_refused_not_merged(tmp_path):
    bundle = build_bundle(tmp_path, budget=10**7)
    first, second = Runtime.load(bundle), Runtime.load(bundle)
    first.add(*make_images(4, 1), strategy="concatenate")
    with pytest.raises(BundleError, match="load it again"):
        second.add(*make_images(4, 2), strategy="concatenate")
    assert len(Runtime.load(bundle).datastore) == 64


def test_empty_strategy_is_an_error_not_the_default(tmp_path):
    bundle = build_bundle(tmp_path)
    with pytest.raises(ValueError, match="update strategy must be one of"):
        Runtime.load(bundle).add(*make_images(2, 1), strategy="")
