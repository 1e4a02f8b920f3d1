"""A device holds a bundle of 10k keys within its budget in memory, as it does on disk: the peak
private memory of a process that loads it and predicts a batch of 256, above the floor process
(numpy, onnxruntime, the runtime's modules, a one-node session), stays within the budget the
exporter's memory model (estimate_nbytes) gives it plus 2 MiB. Measured the way
benchmarks/runtime_memory.py measures it, with its own code."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_runtime.bundle import write_bundle
from edge_runtime.datastores import ProtoNNDatastore, make_datastore
from experiments.benchmark_support import run_sampled
from tests.helpers.bundles import (
    FIELDS,
    NUM_CLASSES,
    make_image_encoder,
    make_images,
)

KEYS = 10_000
DIM = 128  # keys of 5 MB in float32: a copy of them would show

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="needs /proc to read private memory"
)


def _memory_benchmark():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "runtime_memory.py"
    spec = importlib.util.spec_from_file_location("runtime_memory", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("runtime_memory", module)
    spec.loader.exec_module(module)
    return module


def _datastore(recipe: str):
    rng = np.random.default_rng(0)
    if recipe == "protonn":  # 3,000 prototypes (m0.3 of 10k) and a buffer for 500 samples
        W = rng.normal(size=(32, DIM)).astype(np.float32)
        B = rng.normal(size=(32, 3000)).astype(np.float32)
        Z = rng.random((NUM_CLASSES, 3000)).astype(np.float32)
        return ProtoNNDatastore.from_matrices(W, B, Z, 0.1, m=0.3, buffer=500)
    z = rng.normal(size=(KEYS, DIM)).astype(np.float32)
    return make_datastore(recipe, NUM_CLASSES, k=10).fit(z, rng.integers(0, NUM_CLASSES, KEYS))


@pytest.fixture(scope="module")
def floor_kib(tmp_path_factory) -> dict:
    mem = _memory_benchmark()
    work = tmp_path_factory.mktemp("floor")
    floor = run_sampled(mem.CHILD_FLOOR, [str(mem._one_node_model(work))], threads=1)
    return {"module": mem, "floor_kib": floor["peak_private_kib"]}


@pytest.mark.parametrize("recipe", ["flat:fp32", "flat:int8", "protonn"])
def test_a_bundle_of_10k_keys_predicts_within_its_budget_in_memory(tmp_path, floor_kib, recipe):
    mem = floor_kib["module"]
    encoder = make_image_encoder(tmp_path / "encoder.onnx", p=DIM)
    ds = _datastore(recipe)
    budget = encoder.stat().st_size + ds.nbytes  # the tightest the exporter's model allows
    write_bundle(tmp_path / "bundle", dataclasses.replace(FIELDS, budget_bytes=budget), encoder, ds)
    x, _ = make_images(256, seed=1)
    np.save(tmp_path / "x.npy", x)
    result = run_sampled(
        mem.CHILD_RUNTIME, [str(tmp_path / "bundle"), str(tmp_path / "x.npy"), "1"], threads=1
    )
    assert result["shape"] == [256, NUM_CLASSES]
    above_mib = (result["peak_private_kib"] - floor_kib["floor_kib"]) / 1024
    limit_mib = budget / 2**20 + mem.PRIVATE_SLACK_MIB
    assert above_mib <= limit_mib, (
        f"{recipe}: {above_mib:.2f} MiB above the floor, budget {budget / 2**20:.2f} MiB + "
        f"{mem.PRIVATE_SLACK_MIB} MiB"
    )


def test_a_flat_datastore_holds_its_keys_and_9_bytes_a_key_beside_them(tmp_path):
    """What a loaded flat int8 datastore holds beside its keys: a one-byte label, the norm and
    the integer scan's offset (4 bytes each) a key; no insertion stamps (consecutive: the first
    is enough) and no int64 labels (its file keeps both as int64, 16 bytes a key)."""
    ds = _datastore("flat:int8")
    ds.save(tmp_path)
    loaded = type(ds).load(tmp_path, {**ds.get_params()}, files=["datastore.npz"])
    held = sum(v.nbytes for v in vars(loaded).values() if isinstance(v, np.ndarray))
    assert held <= loaded.keys_t_.nbytes + DIM * 4 + 9 * KEYS, held
    np.testing.assert_array_equal(loaded.order_, np.arange(KEYS))
    assert loaded.labels_.dtype == np.uint8 and np.array_equal(loaded.labels_, ds.labels_)


def test_the_predictor_is_built_without_copies_of_the_encoder(tmp_path):
    """Building the one-session predictor holds at most about three copies of the encoder's
    bytes at once (its graph and the model joined once, and the result), not one per
    concatenation: freed copies stay in a device's heap beside its keys."""
    import tracemalloc

    from edge_runtime.bundle import encoder_model, load_bundle_datastore, read_manifest
    from edge_runtime.predictor_graph import build_predictor

    encoder = make_image_encoder(tmp_path / "encoder.onnx", p=DIM)
    ds = _datastore("flat:int8")
    write_bundle(tmp_path / "b", dataclasses.replace(FIELDS, budget_bytes=10**8), encoder, ds)
    manifest = read_manifest(tmp_path / "b")
    datastore = load_bundle_datastore(tmp_path / "b", manifest)
    model = encoder_model(tmp_path / "b", manifest)
    tracemalloc.start()
    try:
        build_predictor(manifest, datastore, model, samples="stored")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 3 * len(model), (peak, len(model))
