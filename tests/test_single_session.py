"""The runtime's fast path: int8 keys through onnxruntime's integer kernels give exactly the
integer products of the quantised query and keys; the whole prediction as one session gives
what the numpy head gives; and after `add`, every backend predicts what a fresh load of the
updated bundle predicts."""

from __future__ import annotations

import importlib.util
from itertools import product

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_runtime import onnx_proto as P
from edge_runtime import predictor
from edge_runtime.bundle import write_bundle
from edge_runtime.datastores import FlatDatastore, HNSWDatastore, ProtoNNDatastore
from edge_runtime.knn import int8_query, key_products
from edge_runtime.manifest import BundleFields
from edge_runtime.predictor_graph import _Graph, _int8_products, build_predictor
from edge_runtime.preprocess import InputSpec
from edge_runtime.runtime import Runtime

SPEC = {"kind": "image", "shape": [8, 8, 1], "dtype": "uint8", "mean": [0.5], "std": [0.25]}
DIM, CLASSES = 12, 4


def _integer_scan_session(scale: np.ndarray) -> ort.InferenceSession:
    g = _Graph(17)
    g.input("q", P.FLOAT, ["m", DIM])
    g.input("keys_t", P.INT8, [DIM, "n"])
    g.input("key_offsets", P.INT32, ["n"])
    out = _int8_products(g, "q", "keys_t", "key_offsets", scale)
    g.nodes.append(P.node("Identity", [out], ["products"]))
    graph = P.graph(
        "scan", g.nodes, g.inputs, [P.value_info("products", P.FLOAT, None)], g.initializers
    )
    model = P.model(graph, ir_version=8, opsets={"": 17}, producer="test")
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def test_integer_scan_equals_the_float_reference_on_quantised_keys():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(3000, DIM)).astype(np.float32)
    ds = FlatDatastore(CLASSES, dtype="int8").fit(z, rng.integers(0, CLASSES, 3000))
    # the extremes a saturating 16-bit pair sum would get wrong: keys at +-127, a query at
    # its peak in every dimension
    ds.keys_t_[:, :2] = np.array([[127], [-127]], np.int8).T.repeat(DIM, axis=0)
    ds._set(ds.keys_t_, ds.labels_, ds.first_stamp_)
    q = rng.normal(size=(5, DIM)).astype(np.float32)
    q[0] = 3.0 / ds.scale_  # q * scale = 3 in every dimension: all at the peak
    q[1] = 0.0
    session = _integer_scan_session(ds.scale_)
    (got,) = session.run(None, {"q": q, "keys_t": ds.keys_t_, "key_offsets": ds.key_offsets_})
    quantised, s = int8_query(q, ds.scale_)
    exact = quantised.astype(np.float64) @ ds.keys_t_.astype(np.float64)
    want = exact.astype(np.float32) * s
    np.testing.assert_array_equal(got, -2 * want)  # the graph's products carry the distance's -2
    np.testing.assert_array_equal(key_products(q, ds.keys_t_, ds.scale_), want)
    assert np.abs(quantised).max() == 63 and exact[0, 0] == 63 * 127 * DIM


def test_integer_scan_rounds_the_query_half_to_even_as_the_reference_does():
    # scale 0.5 and q = 2v make q * scale = v exactly; the peak 63 makes s = 1, so the query's
    # levels are v itself: halves, which Round (the reference's np.rint) and QuantizeLinear
    # both send to the even neighbour
    rng = np.random.default_rng(1)
    ds = FlatDatastore(CLASSES, dtype="int8").fit(
        rng.normal(size=(50, DIM)).astype(np.float32), rng.integers(0, CLASSES, 50)
    )
    scale = np.full(DIM, 0.5, np.float32)
    halves = np.array([63, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 62.5, -62.5, 3.5, -3.5, 0], np.float32)
    q = 2 * halves[None, :DIM]
    session = _integer_scan_session(scale)
    (got,) = session.run(None, {"q": q, "keys_t": ds.keys_t_, "key_offsets": ds.key_offsets_})
    quantised, s = int8_query(q, scale)
    assert s[0, 0] == 1 and list(quantised[0, 1:9]) == [0, 2, 2, -0, -2, -2, 62, -62]
    exact = quantised.astype(np.float64) @ ds.keys_t_.astype(np.float64)
    np.testing.assert_array_equal(got, -2 * exact.astype(np.float32))


def _encoder_bytes(seed: int = 0) -> bytes:
    """A small float encoder with the bundle format's two outputs."""
    rng = np.random.default_rng(seed)
    w1 = rng.normal(scale=0.3, size=(64, DIM)).astype(np.float32)
    w2 = rng.normal(scale=0.5, size=(DIM, CLASSES)).astype(np.float32)
    nodes = [
        helper.make_node("Flatten", ["input"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w1"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["embedding"]),
        helper.make_node("MatMul", ["embedding", "w2"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "encoder",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [
            helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", DIM]),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES]),
        ],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 8, 8, 1)).astype(np.uint8)


def _datastores(z: np.ndarray, y: np.ndarray) -> dict:
    rng = np.random.default_rng(1)
    stores = {
        f"flat-{dtype}": FlatDatastore(CLASSES, k=5, dtype=dtype).fit(z, y)
        for dtype in ("fp32", "int8", "fp16")
    }
    stores["protonn"] = ProtoNNDatastore.from_matrices(
        rng.normal(size=(6, DIM)),
        rng.normal(size=(6, 20)),
        rng.random((CLASSES, 20)),
        0.7,
        k=5,
        buffer=50,
    )
    if importlib.util.find_spec("hnswlib") is not None:
        stores["hnsw"] = HNSWDatastore(CLASSES, k=5, M=8).fit(z, y)
    return stores


@pytest.fixture()
def bundles(tmp_path):
    encoder = _encoder_bytes()
    out = {}
    for name, ds in _datastores(*_embedded(encoder, 300, seed=2)).items():
        write_bundle(
            tmp_path / name,
            BundleFields(0, InputSpec(SPEC), 0.6, 10**7),
            encoder,
            ds,
        )
        out[name] = tmp_path / name
    return out


def _embedded(encoder: bytes, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    session = ort.InferenceSession(encoder, providers=["CPUExecutionProvider"])
    x = (_images(n, seed).transpose(0, 3, 1, 2) / np.float32(255) - 0.5) / np.float32(0.25)
    z, logits = session.run(["embedding", "logits"], {"input": x.astype(np.float32)})
    return z, logits.argmax(1)


def test_single_session_prediction_equals_the_numpy_head(bundles):
    x = _images(64, seed=3)
    for name, path in bundles.items():
        rt = Runtime.load(path)
        single = name in ("flat-fp32", "flat-int8", "protonn")
        assert (rt.predictor is not None) == single, name
        reference = rt.posterior(*rt.embed(x))
        got = rt.predict_proba(x)
        assert got.dtype == np.float64 and got.shape == (64, CLASSES)
        np.testing.assert_allclose(got, reference, rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(rt.predict_proba(x[0]), reference[:1], atol=1e-6)


def test_add_then_predict_on_every_backend(bundles):
    x_new, y_new = _images(30, seed=4), np.arange(30) % CLASSES
    x = _images(40, seed=5)
    for name, path in bundles.items():
        rt = Runtime.load(path)
        before = rt.predict_proba(x)
        report = rt.add(x_new, y_new, strategy="concatenate")
        assert report.added == 30, name
        after = rt.predict_proba(x)
        assert not np.allclose(after, before), name  # the new samples are searched
        np.testing.assert_allclose(after, rt.posterior(*rt.embed(x)), atol=1e-6, err_msg=name)
        np.testing.assert_allclose(after, Runtime.load(path).predict_proba(x), atol=1e-12)


def test_small_int8_stores_are_baked_in_and_fed_once_they_outgrow_the_limit(bundles, monkeypatch):
    """int8 keys up to BAKED_KEY_BYTES are constants of the session (packed once), with the
    same probabilities bit for bit (integer products); `add` replaces them, so the next call
    bakes the new ones, or feeds them once they pass the limit."""
    path = bundles["flat-int8"]
    x, y = _images(40, seed=6), np.arange(40) % CLASSES

    def inputs(rt: Runtime) -> list[str]:
        return [i.name for i in rt.predictor.session.get_inputs()]

    baked = Runtime.load(path)
    monkeypatch.setattr(predictor, "BAKED_KEY_BYTES", 0)
    fed = Runtime.load(path)
    assert inputs(baked) == ["input"] and "keys_t" in inputs(fed)
    before = baked.predict_proba(x)
    np.testing.assert_array_equal(before, fed.predict_proba(x))
    assert inputs(Runtime.load(bundles["flat-fp32"])) != ["input"]  # float keys: always fed
    monkeypatch.setattr(predictor, "BAKED_KEY_BYTES", baked.datastore.keys_t_.nbytes + 10 * DIM)
    baked.add(x[:10], y[:10], strategy="concatenate")  # 300 -> 310 keys: within the limit
    after = baked.predict_proba(x)
    assert not np.array_equal(after, before) and inputs(baked) == ["input"]
    np.testing.assert_array_equal(after, Runtime.load(path).predict_proba(x))
    baked.add(x[10:], y[10:], strategy="concatenate")  # 340 keys: fed from now on
    np.testing.assert_array_equal(baked.predict_proba(x), Runtime.load(path).predict_proba(x))
    assert "keys_t" in inputs(baked) and not baked.predictor.baked


def test_a_baked_session_refuses_samples_changed_outside_add(bundles):
    rt = Runtime.load(bundles["flat-int8"])
    ds, x = rt.datastore, _images(8, seed=7)
    before = rt.predict_proba(x)
    ds._set(ds.keys_t_.copy(), ds.labels_.copy(), ds.first_stamp_)  # as reloaded: equal arrays
    np.testing.assert_array_equal(rt.predict_proba(x), before)
    ds.add(np.ones((1, DIM), np.float32), np.array([0]))
    with pytest.raises(ValueError, match="no longer has .* load the bundle again"):
        rt.predict_proba(x)


def test_the_runtime_session_runs_only_nodes_its_outputs_need(bundles):
    """onnxruntime runs every node of a graph whatever outputs a call fetches, so a node that
    neither the probabilities nor the encoder's outputs need costs every prediction."""
    fetched = {"probabilities", "embedding", "logits"}
    for name, samples in product(("flat-fp32", "flat-int8", "protonn"), ("stored", "baked")):
        rt = Runtime.load(bundles[name])
        graph = onnx.load_from_string(
            build_predictor(
                rt.manifest,
                rt.datastore,
                (bundles[name] / "encoder.onnx").read_bytes(),
                samples=samples,
                probabilities="float64",
            )
        ).graph
        assert {o.name for o in graph.output} == fetched, name
        needed, nodes = set(fetched), list(graph.node)
        for node in reversed(nodes):  # a graph's nodes are in topological order
            if needed & set(node.output):
                needed |= set(node.input)
        idle = [n.op_type for n in nodes if not needed & set(n.output)]
        assert idle == [], name
