"""The portable predictor (`knnper-edge export-onnx`): one ONNX graph that gives what the Python
runtime gives, in Python onnxruntime and in onnxruntime-node, for flat and ProtoNN bundles made
by the real exporter from a digits run; and its refusals."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edge_runtime import cli as edge_cli
from edge_runtime.datastores import HNSWDatastore
from edge_runtime.portable import portable_samples, write_portable
from edge_runtime.preprocess import prepare_input
from edge_runtime.runtime import Runtime
from export.exporter import ExportSettings, export_run
from export.sizing import SearchSpace
from fed_train.algorithms.base import TrainingConfig
from fed_train.knn_setting import KNNChoice
from fed_train.run import RunConfig, load_run, train
from tests.helpers.int8_reference import node_differences

NODE_DIR = Path(__file__).resolve().parent / "node"
SPACES = {
    "flat-int8": SearchSpace(backends=("flat",), flat_dtypes=("int8",)),
    "flat-fp16": SearchSpace(backends=("flat",), flat_dtypes=("fp16",)),
    "flat-fp32": SearchSpace(backends=("flat",), flat_dtypes=("fp32",)),
    "protonn": SearchSpace(
        backends=("protonn",), protonn_dims=(8,), protonn_fractions=(0.3,), protonn_steps=30
    ),
}
# the linear base (a linear head the device refits after `add`), with every value from a flag
LINEAR = KNNChoice(
    base="linear",
    l2=1e-2,
    source={
        name: "flag"
        for name in ("k", "sigma", "normalize", "lambda_estimator", "lambda_rule", "base")
    },
)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    root = tmp_path_factory.mktemp("portable")
    config = RunConfig(
        dataset="digits",
        clients=4,
        seed=0,
        training=TrainingConfig(rounds=3, epochs=1, batch_size=16, lr=0.05, momentum=0.9),
    )
    train(config, root / "run", progress=False)
    return root, load_run(root / "run")


@pytest.fixture(scope="module")
def bundles(digits):
    """One bundle of client 0 per backend (global base), and flat / ProtoNN with the linear
    base ("linear-flat-fp32", "linear-protonn")."""
    root, run = digits
    out = {}
    settings = {name: ExportSettings(space=space) for name, space in SPACES.items()}
    for name in ("flat-fp32", "protonn"):
        settings[f"linear-{name}"] = ExportSettings(space=SPACES[name], knn=LINEAR)
    for name, setting in settings.items():
        report = export_run(run, root / name, {0: 10**7}, setting, clients="0", progress=False)
        out[name] = root / name / report["clients"][0]["bundle"]
    return out


def _inputs(run, n: int = 120) -> np.ndarray:
    return np.ascontiguousarray(run.dataset.x_test[:n])


def _run_python(path: Path, x: np.ndarray, samples=None) -> tuple[np.ndarray, np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"input": x}
    if samples is not None:
        feeds.update(keys=samples[0], labels=samples[1])
    return tuple(session.run(["probabilities", "key"], feeds))


def _assert_same(portable: np.ndarray, runtime: np.ndarray) -> None:
    np.testing.assert_array_equal(portable.argmax(1), runtime.argmax(1))
    np.testing.assert_allclose(portable, runtime, atol=1e-4)


@pytest.mark.parametrize("name", list(SPACES))
@pytest.mark.parametrize("keys_as_inputs", [False, True])
def test_portable_predictor_equals_the_runtime(digits, bundles, tmp_path, name, keys_as_inputs):
    _, run = digits
    runtime = Runtime.load(bundles[name])
    assert runtime.datastore.backend == name.split("-")[0]
    x = _inputs(run)
    out = tmp_path / "predictor.onnx"
    written = write_portable(runtime, out, keys_as_inputs=keys_as_inputs)
    samples = portable_samples(runtime) if keys_as_inputs else None
    assert written == [out] + (
        [Path(f"{out}.{suffix}") for suffix in ("keys.f32", "labels.i64", "app.json")]
        if samples is not None
        else []
    )
    probs, _ = _run_python(out, x, samples)
    _assert_same(probs, runtime.predict_proba(x))


def app_learns(contract: dict, samples, new_keys: np.ndarray, new_labels: np.ndarray):
    """An app following <out>.app.json: append the new keys and labels, keep the newest
    `capacity` ("fixed": append nothing)."""
    keys, labels = samples
    if contract["update_strategy"] == "fixed":
        return keys, labels
    keys, labels = np.concatenate([keys, new_keys]), np.concatenate([labels, new_labels])
    first = max(0, len(keys) - contract["capacity"])
    return keys[first:], labels[first:]


@pytest.mark.parametrize("name", [*SPACES, "linear-protonn"])
def test_keys_as_inputs_keep_learning_like_the_runtime(digits, bundles, tmp_path, name):
    """An app that follows the written contract (append the graph's "key" output and the
    label, keep the newest `capacity`) holds the keys `add` stores (an int8 bundle's
    re-quantised with the datastore's scale) and predicts what the runtime predicts after
    `add`, up to float rounding (the 40 new samples overflow ProtoNN's buffer and the int8
    store's fifo capacity: the oldest are evicted)."""
    _, run = digits
    runtime = _copy(bundles[name], tmp_path / "bundle")
    out = tmp_path / "predictor.onnx"
    write_portable(runtime, out, keys_as_inputs=True)
    contract = json.loads(Path(f"{out}.app.json").read_text())
    assert contract["capacity"] == runtime.kept_by_add() >= 1
    samples = portable_samples(runtime)
    new_x, new_y = _inputs(run, 160)[120:], run.dataset.y_test[120:160].astype(np.int64)
    _, new_keys = _run_python(out, new_x, samples)
    keys, labels = app_learns(contract, samples, new_keys, new_y)
    report = runtime.add(new_x, new_y)
    assert report.size == len(labels) == min(contract["capacity"], len(samples[1]) + 40)
    stored_keys, stored_labels = portable_samples(runtime)
    np.testing.assert_array_equal(labels, stored_labels)
    np.testing.assert_allclose(keys, stored_keys, rtol=1e-6, atol=1e-6)  # float32 W z
    x = _inputs(run)
    probs, _ = _run_python(out, x, (keys, labels))
    np.testing.assert_array_equal(probs.argmax(1), runtime.predict_proba(x).argmax(1))
    # float rounding only: the app's keys are the graph's W z, the runtime's numpy's (1e-6
    # apart above); through the kernel that reached 1.7e-6 on an AMX Xeon
    np.testing.assert_allclose(probs, runtime.predict_proba(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name, keys_as_inputs", [("flat-int8", False), ("protonn", True)])
def test_the_ort_format_predicts_as_the_onnx_graph(digits, bundles, tmp_path, name, keys_as_inputs):
    """`export-onnx --format ort` (onnxruntime's mobile format) loads in the installed
    onnxruntime and predicts as the .onnx graph does; its config lists exactly the operators
    onnxruntime's own tool reads from the .ort file (what a reduced build must include)."""
    _, run = digits
    x, paths = _inputs(run), {}
    for fmt in ("onnx", "ort"):
        paths[fmt] = tmp_path / f"predictor.{fmt}"
        argv = ["export-onnx", str(bundles[name]), "--out", str(paths[fmt]), "--format", fmt]
        assert edge_cli.main(argv + ["--keys-as-inputs"] * keys_as_inputs) == 0
    samples = portable_samples(Runtime.load(bundles[name])) if keys_as_inputs else None
    onnx_probs, onnx_keys = _run_python(paths["onnx"], x, samples)
    ort_probs, ort_keys = _run_python(paths["ort"], x, samples)
    np.testing.assert_array_equal(ort_probs.argmax(1), onnx_probs.argmax(1))
    np.testing.assert_allclose(ort_probs, onnx_probs, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ort_keys, onnx_keys, rtol=0, atol=1e-6)
    from onnxruntime.tools.ort_format_model import create_config_from_models

    tool = tmp_path / "tool.config"
    create_config_from_models([paths["ort"]], tool, enable_type_reduction=False)
    ours = Path(f"{paths['ort']}.required_operators.config").read_text()

    def lines(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith("#")]

    assert lines(ours) == lines(tool.read_text()) and "QLinearConv" in ours


def test_export_onnx_refuses_an_out_of_the_other_format(bundles, tmp_path, capsys):
    out = tmp_path / "predictor.onnx"
    assert (
        edge_cli.main(
            ["export-onnx", str(bundles["flat-int8"]), "--out", str(out), "--format", "ort"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "--out must end in .ort" in err and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())


def test_keys_as_inputs_refuses_a_base_that_add_refits(bundles, tmp_path, capsys):
    """A flat bundle with the linear base: `add` refits its head on the stored keys, which an
    app appending keys to the graph cannot do, so --keys-as-inputs refuses (plain works)."""
    bundle, out = bundles["linear-flat-fp32"], tmp_path / "p.onnx"
    assert edge_cli.main(["export-onnx", str(bundle), "--out", str(out), "--keys-as-inputs"]) == 2
    err = capsys.readouterr().err
    assert "linear head that `add` refits" in err and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())
    assert edge_cli.main(["export-onnx", str(bundle), "--out", str(out)]) == 0


def test_the_bundles_int8_encoder_equals_the_exact_integers(digits, bundles):
    """What Node and the browser are compared with is itself exact: the exported bundle's
    encoder, on this CPU, equals the exact-integer reference node by node (so agreeing with
    the runtime here means agreeing with the reference, on any CPU)."""
    _, run = digits
    x = prepare_input(_inputs(run), run.dataset.input_spec)
    report = node_differences(bundles["flat-int8"] / "encoder.onnx", x)
    assert {d["op_type"] for d in report.values()} >= {"QuantizeLinear", "QLinearConv", "QGemm"}
    for node, diff in report.items():
        assert diff["max_steps"] <= 1 and diff["share_differing"] <= 1e-3, (node, diff)


def test_portable_predictor_runs_in_onnxruntime_node(digits, bundles, tmp_path):
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed (CI installs it)")
    if not (NODE_DIR / "node_modules" / "onnxruntime-node").is_dir():
        pytest.skip(
            "onnxruntime-node is not installed: cd tests/node && npm install --ignore-scripts"
        )
    _, run = digits
    x = _inputs(run)
    for name, keys_as_inputs in (("flat-int8", False), ("protonn", True)):
        runtime = Runtime.load(bundles[name])
        out = tmp_path / f"{name}.onnx"
        write_portable(runtime, out, keys_as_inputs=keys_as_inputs)
        (tmp_path / "x.u8").write_bytes(x.tobytes())
        args = [
            "node",
            str(NODE_DIR / "run_predictor.mjs"),
            str(out),
            str(tmp_path / "x.u8"),
            ",".join(map(str, x.shape)),
            str(tmp_path / "p.f32"),
        ]
        if keys_as_inputs:
            keys, _ = portable_samples(runtime)
            args += [f"{out}.keys.f32", f"{out}.labels.i64", str(keys.shape[1])]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=NODE_DIR)
        assert done.returncode == 0, done.stderr
        probs = np.fromfile(tmp_path / "p.f32", dtype="<f4").reshape(len(x), -1)
        _assert_same(probs, runtime.predict_proba(x))


def test_export_onnx_refuses_hnsw_tampered_and_unwritable(digits, bundles, tmp_path, capsys):
    root, run = digits
    report = export_run(
        run,
        root / "hnsw",
        {0: 10**7},
        ExportSettings(space=SearchSpace(backends=("hnsw",), hnsw_M=(8,), prune=False)),
        clients="0",
        progress=False,
    )
    hnsw = root / "hnsw" / report["clients"][0]["bundle"]
    assert isinstance(Runtime.load(hnsw).datastore, HNSWDatastore)
    tampered = tmp_path / "tampered"
    shutil.copytree(bundles["flat-int8"], tampered)
    with open(tampered / "encoder.onnx", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01")
    cases = [
        ([str(hnsw), "--out", str(tmp_path / "p.onnx")], "no ONNX form"),
        ([str(tampered), "--out", str(tmp_path / "p.onnx")], "sha256"),
        (
            [str(bundles["flat-int8"]), "--out", str(tmp_path / "nowhere" / "p.onnx")],
            "not a directory",
        ),
        ([str(bundles["flat-int8"]), "--out", str(tmp_path / "p.txt")], "must end in .onnx"),
    ]
    for args, message in cases:
        assert edge_cli.main(["export-onnx", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "p.onnx").exists()
    assert (
        edge_cli.main(["export-onnx", str(bundles["protonn"]), "--out", str(tmp_path / "p.onnx")])
        == 0
    )
    assert (tmp_path / "p.onnx").is_file()


# -- in a real browser: Debian's chromium, onnxruntime-web (WebAssembly), playwright-core

BROWSER_DIR = Path(__file__).resolve().parent / "browser"
REPO = Path(__file__).resolve().parents[1]


def _browser_missing() -> str | None:
    """Why the browser test cannot run here, or None."""
    if shutil.which("chromium") is None:
        return "chromium is not installed (apt-get install chromium; CI installs it)"
    if shutil.which("node") is None:
        return "Node.js is not installed (CI installs it)"
    for module in ("onnxruntime-web", "playwright-core"):
        if not (BROWSER_DIR / "node_modules" / module).is_dir():
            return f"{module} is not installed: cd tests/browser && npm install --ignore-scripts"
    return None


class _Files(http.server.SimpleHTTPRequestHandler):
    extensions_map = {
        **http.server.SimpleHTTPRequestHandler.extensions_map,
        ".mjs": "text/javascript",
        ".wasm": "application/wasm",
    }

    def log_message(self, *args) -> None:  # quiet: the test reads the results, not the log
        pass


@contextlib.contextmanager
def serve(root: Path):
    """`root` over HTTP on 127.0.0.1 at an ephemeral port, in a thread, shut down after."""
    handler = functools.partial(_Files, directory=str(root))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/"
        finally:
            server.shutdown()
            thread.join(timeout=10)


def _copy(bundle: Path, where: Path) -> Runtime:
    """A loaded copy of a bundle, so `add` leaves the module's bundles as they are."""
    shutil.copytree(bundle, where)
    return Runtime.load(where)


@pytest.fixture(scope="module")
def browser(digits, bundles, tmp_path_factory):
    """Every exportable backend's predictor, plain and keys-as-inputs (after 40 keys appended
    by the example's Device), and the example page used as a person would, in one launch of
    the system Chromium; with what the Python runtime gives for the same inputs."""
    missing = _browser_missing()
    if missing:
        pytest.skip(missing)
    image_module = pytest.importorskip("PIL.Image", reason="Pillow writes the page's image")
    _, run = digits
    root = tmp_path_factory.mktemp("browser")
    (root / "tests").mkdir()
    (root / "tests" / "browser").symlink_to(BROWSER_DIR)
    (root / "examples").symlink_to(REPO / "examples")
    data = root / "data"
    data.mkdir()
    x, new_x = _inputs(run), _inputs(run, 160)[120:]
    new_y = run.dataset.y_test[120:160].astype(np.int64)
    (data / "x.u8").write_bytes(x.tobytes())
    (data / "new_x.u8").write_bytes(new_x.tobytes())
    jobs, expected = [], {}
    for name in SPACES:
        for learns in (False, True):
            job = f"{name}-{'app' if learns else 'plain'}"
            runtime = _copy(bundles[name], root / "bundles" / job)
            write_portable(runtime, data / f"{job}.onnx", keys_as_inputs=learns)
            spec = {
                "name": job,
                "model": f"/data/{job}.onnx",
                "learns": learns,
                "input": "/data/x.u8",
                "shape": list(x.shape),
            }
            if learns:
                spec["learn"] = {
                    "input": "/data/new_x.u8",
                    "shape": list(new_x.shape),
                    "labels": new_y.tolist(),
                }
                runtime.add(new_x, new_y)
            jobs.append(spec)
            expected[job] = (runtime.predict_proba(x), *portable_samples(runtime))
    # the example page: one image predicted, then learnt with its label
    page_rt = _copy(bundles["flat-int8"], root / "bundles" / "page")
    write_portable(page_rt, data / "page.onnx", keys_as_inputs=True)
    image, label = x[:1], int(run.dataset.y_test[0])
    image_module.fromarray(image[0, :, :, 0], mode="L").save(data / "image.png")
    page_before = page_rt.predict_proba(image)
    page_rt.add(image, [label])
    page_expected = (page_before, page_rt.predict_proba(image), len(page_rt.datastore.labels_))
    with serve(root) as base:
        plan = {
            "browser": shutil.which("chromium"),
            "harness": f"{base}tests/browser/harness.html",
            "jobs": jobs,
            "example": {
                "url": f"{base}examples/browser/index.html?model=/data/page.onnx",
                "image": str(data / "image.png"),
                "label": label,
            },
        }
        (root / "plan.json").write_text(json.dumps(plan))
        done = subprocess.run(
            [
                "node",
                str(BROWSER_DIR / "drive.mjs"),
                str(root / "plan.json"),
                str(root / "out.json"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=BROWSER_DIR,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((root / "out.json").read_text())
    assert results["errors"] == []
    return results, expected, page_expected


@pytest.mark.parametrize("name", list(SPACES))
@pytest.mark.parametrize("learns", [False, True])
def test_the_browser_predicts_what_the_runtime_predicts(browser, name, learns):
    """onnxruntime-web in Chromium, the same graph and inputs as the Python runtime: argmax
    equal on every input, probabilities within 1e-5; with keys as inputs after the example's
    Device appended 40 keys as its contract says, the keys and labels `add` stores."""
    results, expected, _ = browser
    job = f"{name}-{'app' if learns else 'plain'}"
    got, (probs, keys, labels) = results["jobs"][job], expected[job]
    got_probs = np.asarray(got["probabilities"], np.float32).reshape(probs.shape)
    np.testing.assert_array_equal(got_probs.argmax(1), probs.argmax(1))
    np.testing.assert_allclose(got_probs, probs, rtol=0, atol=1e-5)
    if learns:
        np.testing.assert_array_equal(got["labels"], labels)
        np.testing.assert_allclose(np.reshape(got["keys"], keys.shape), keys, rtol=1e-6, atol=1e-6)


def test_the_example_page_predicts_and_learns_like_the_runtime(browser):
    """examples/browser/index.html served over HTTP: an image chosen in its file input is
    predicted as the runtime predicts it, and "Learn it" stores its key as `add` does."""
    results, _, (before, after, stored) = browser
    page = results["example"]
    np.testing.assert_allclose(page["before"], before[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(page["after"], after[0], rtol=0, atol=1e-5)
    assert f"{stored} stored keys" in page["statusAfter"]


_PAGE_WITHOUT_ITS_PACKAGES = """
const elements = {};
globalThis.location = { search: "" };
globalThis.document = {
  getElementById: (id) =>
    (elements[id] ??= { textContent: id === "status" ? "loading..." : "", addEventListener() {} }),
};
try { await import(process.argv[1]); } catch (error) { /* the page's own error: not shown */ }
console.log(elements.status.textContent);
"""


def test_the_example_page_shows_why_it_cannot_load(tmp_path):
    """Without onnxruntime-web beside the tests the page stayed at "loading...", the error in
    the browser's console only. The page's module runs in Node with the few DOM calls it makes
    before loading, from a copy with no packages beside it."""
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed (CI installs it)")
    shutil.copytree(REPO / "examples" / "browser", tmp_path / "examples" / "browser")
    page = tmp_path / "examples" / "browser" / "app.mjs"
    shown = subprocess.run(
        ["node", "--input-type=module", "-e", _PAGE_WITHOUT_ITS_PACKAGES, page.as_uri()],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    assert shown.startswith("error: onnxruntime-web is not installed at"), shown
