"""One rule chooses everywhere: the server's kNN-Per evaluation, the exporter's sizer and the
device's `knnper-edge init` fed the same embeddings choose the same lambda and the same
datastore, and a default train -> evaluate -> export -> device run gives every client the
accuracy the server reported."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from edge_runtime.budget import Budget
from edge_runtime.bundle import load_bundle_datastore, read_manifest
from edge_runtime.cli import main as edge_main
from edge_runtime.device_choice import InitSettings
from edge_runtime.device_init import init_bundle
from edge_runtime.encoder import Encoder
from edge_runtime.knn import (
    CLIENT_RULE,
    KNNHead,
    LambdaRule,
    choice_key,
    interpolate,
    lambda_counts,
    normalize_embeddings,
    softmax,
)
from edge_runtime.linear_head import LinearHead
from edge_runtime.personal_head import ClientSplits, PersonalHead
from edge_runtime.preprocess import prepare_input
from edge_runtime.runtime import Runtime
from export.sizing import DatastoreSizer, SearchSpace
from fed_train.client_files import client_split, write_client_files
from fed_train.knn_choice import KNN_CONFIG_FILE
from fed_train.knn_request import FROM_FLAG, FROM_VALIDATION
from fed_train.knn_setting import KNNChoice
from fed_train.run import load_run
from knnper_cli.main import main as knnper_main
from tests.helpers.bundles import (
    IMAGE_SPEC,
    NUM_CLASSES,
    make_image_encoder,
    make_images,
    raw_outputs,
)

DTYPES = ("fp32", "fp16", "int8")


def test_choice_key_ranks_accuracy_then_rounded_log_loss_then_tie_breaks():
    assert choice_key(0.9, 0.5) < choice_key(0.8, 0.1)
    assert choice_key(0.9, 0.30) < choice_key(0.9, 0.32)
    assert choice_key(0.9, 0.301, 0.1) < choice_key(0.9, 0.299, 0.3)  # a tie to 2 decimals
    # ties on accuracy and log-loss go to the smaller lambda
    p_local = np.array([[0.9, 0.1], [0.9, 0.1]])
    assert CLIENT_RULE.choose(p_local, p_local, np.array([0, 1])) == 0.0


def _rule(name: str, encoder, seed: int) -> LambdaRule:
    """A rule of that name whose pooled evidence comes from other clients' images."""
    if name == "client":
        return LambdaRule()
    x, y = make_images(120, seed=seed + 100, signal=20)
    z, logits = raw_outputs(encoder, x)
    evidence = lambda_counts(
        KNNHead(NUM_CLASSES).fit(z[:80], y[:80]).predict_proba(z[80:]), softmax(logits[80:]), y[80:]
    )
    return LambdaRule(name, tuple(map(tuple, evidence)), 25.0)


@pytest.mark.parametrize("rule_name", ["client", "pooled", "shrunk"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_server_sizer_and_device_init_choose_alike(tmp_path, seed, rule_name):
    encoder = make_image_encoder(tmp_path / "encoder.onnx", seed=seed)
    rule = _rule(rule_name, encoder, seed)
    x, y = make_images(160, seed=seed, signal=50)
    val_fraction, budget = 0.25, 10**6
    init = init_bundle(
        encoder,
        x,
        y,
        budget,
        tmp_path / "device",
        input_spec=IMAGE_SPEC,
        settings=InitSettings(
            recipes=[f"flat:{t}" for t in DTYPES],
            val_fraction=val_fraction,
            seed=seed,
            lambda_rule=rule,
        ),
    )
    # the device's own split, fed to the server and the exporter as embeddings
    order = np.random.default_rng(seed).permutation(len(y))
    n_val = int(round(val_fraction * len(y)))
    val, train = order[:n_val], order[n_val:]
    z, logits = raw_outputs(encoder, x)
    data = ClientSplits.from_logits(
        0, True, (z[train], logits[train], y[train]), (z[val], logits[val], y[val])
    )
    sizer = DatastoreSizer(
        NUM_CLASSES,
        space=SearchSpace(backends=("flat",), flat_dtypes=DTYPES),
        seed=seed,
        knn=KNNChoice(lambda_rule=rule),
    )
    sizer.fit(data, Budget(budget, encoder.stat().st_size))
    server = PersonalHead(NUM_CLASSES, rule=rule).fit(data).lambda_

    device = {
        c["recipe"].split(":n")[0]: c
        for c in init.candidates
        if int(c["recipe"].split(":n")[1]) >= len(train)
    }
    exporter = {c.recipe.split(":n")[0]: c for c in sizer.candidates_}
    assert set(device) == set(exporter) == {f"flat:{t}" for t in DTYPES}
    for recipe, cand in exporter.items():
        assert device[recipe]["lambda"] == cand.lam, recipe
        assert device[recipe]["val_accuracy"] == pytest.approx(cand.val_accuracy)
    assert exporter["flat:fp32"].lam == server
    assert init.recipe.split(":n")[0] == sizer.best_.recipe.split(":n")[0]
    assert init.lam == sizer.best_.lam


def _device_correct(capsys, bundle, data) -> tuple[int, int]:
    """(samples right, samples) as `knnper-edge evaluate` prints them."""
    assert edge_main(["evaluate", str(bundle), "--data", str(data)]) == 0
    match = re.search(r"on (\d+) samples \((\d+) right", capsys.readouterr().out)
    return int(match.group(2)), int(match.group(1))


# What int8 may cost against the float32 model on the same bundle configuration. The int8
# encoder's numbers depend on the CPU's integer kernels (onnxruntime picks AVX2, AVX-512 VNNI or
# AMX code paths with different requantisation), so this bound is the one comparison here whose
# margin is a property of the CPU. Measured on this test's run: 2 samples on one client (0.4 pp of
# the mean) on an AMD EPYC (AVX-512 VNNI) and on an Intel Xeon (AVX-512 VNNI, AMX), 0 on the
# others; the bound leaves room for other kernels and is stated in the README.
INT8_MAX_CLIENT_SAMPLES = 3
INT8_MAX_MEAN_PP = 1.5


def _server_int8_correct(run, cid: int, bundle, manifest: dict) -> int:
    """The exporter's measurement of one bundle, made on the server: embeddings from the int8
    encoder the bundle ships (its own session, not the device's fused graph), the bundle's
    datastore through numpy's scan, the manifest's normalisation and lambda. Computed on this
    CPU with this CPU's kernels, it is what the device must equal exactly, whatever they are."""
    encoder = Encoder(bundle / "encoder.onnx", intra_op_threads=1)
    store = load_bundle_datastore(bundle, read_manifest(bundle))
    x_test, y_test = client_split(run, cid, "test")
    z_test, logits = encoder.run(prepare_input(x_test, manifest["input"]))
    normalize = manifest["knn_choice"]["normalize"]["value"]
    p = interpolate(
        store.predict_proba(normalize_embeddings(z_test, normalize)),
        softmax(logits.astype(np.float64)),
        manifest["lambda"],
    )
    return int(np.sum(p.argmax(axis=1) == y_test))


PIPELINES = {
    "default": [],
    "linear-pooled": ["--base", "linear", "--lambda-rule", "pooled"],
    "global-shrunk": ["--base", "global", "--lambda-rule", "shrunk"],
}


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_default_pipeline_devices_get_the_servers_kNN_Per_accuracy(tmp_path, capsys, pipeline):
    """Like with like: each device equals, sample for sample, the server's kNN-Per on the int8
    encoder it was shipped (any CPU: both sides run the same kernels); against the float32
    model the int8 encoder's cost is bounded separately (INT8_MAX_*)."""
    run = tmp_path / "run"
    assert (
        knnper_main(
            [
                "--no-progress",
                "train",
                "--dataset",
                "digits",
                "--clients",
                "8",
                "--rounds",
                "6",
                "--out",
                str(run),
            ]
        )
        == 0
    )
    flags = PIPELINES[pipeline]
    assert (
        knnper_main(
            [
                "--no-progress",
                "evaluate",
                str(run),
                "--methods",
                "knnper",
                "--json",
                str(tmp_path / "eval.json"),
                *flags,
            ]
        )
        == 0
    )
    server = json.loads((tmp_path / "eval.json").read_text())
    chosen = server["knn"]["config"]
    pinned = {"lambda_rule", "base"} if flags else set()
    assert server["knn"]["source"] == {
        name: FROM_FLAG if name in pinned else FROM_VALIDATION
        for name in ("k", "sigma", "normalize", "lambda_estimator", "lambda_rule", "base")
    }
    if flags:
        assert [server["knn"]["base"]["name"], server["knn"]["lambda_rule"]["name"]] == [
            flags[1],
            flags[3],
        ]
    assert (
        knnper_main(
            [
                "--no-progress",
                "export",
                str(run),
                "--out",
                str(tmp_path / "b"),
                "--budget",
                "2MB",
                "--workers",
                "1",
                *flags,
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "b" / "export.json").read_text())
    assert report["knn"]["k"] == {"value": chosen["k"], "source": FROM_VALIDATION}
    saved = json.loads((run / KNN_CONFIG_FILE).read_text())
    assert len(saved["choices"]) == 1  # export reused evaluate's choice
    loaded = load_run(run)
    capsys.readouterr()
    device_total = float_total = n_total = 0
    for row in server["clients"]:
        cid = row["client_id"]
        bundle = tmp_path / "b" / f"client_{cid:04d}"
        manifest = json.loads((bundle / "manifest.json").read_text())
        assert (manifest["k"], manifest["sigma"]) == (chosen["k"], chosen["sigma"])
        assert manifest["knn_choice"]["normalize"]["value"] == chosen["normalize"]
        assert manifest["knn_choice"]["lambda_estimator"]["value"] == server["knn"]["estimator"]
        for name in ("lambda_rule", "base"):
            assert manifest["knn_choice"][name] == {
                "value": server["knn"][name]["name"],
                "source": server["knn"]["source"][name],
            }
        write_client_files(loaded, cid, tmp_path / f"c{cid}")
        device, n = _device_correct(capsys, bundle, tmp_path / f"c{cid}" / "test.npz")
        assert n == row["n_test"]
        assert device == _server_int8_correct(loaded, cid, bundle, manifest), cid
        float_correct = round(row["knnper"] * n)
        assert abs(device - float_correct) <= INT8_MAX_CLIENT_SAMPLES, (cid, device, float_correct)
        device_total, float_total, n_total = (
            device_total + device,
            float_total + float_correct,
            n_total + n,
        )
    assert 100 * abs(device_total - float_total) / n_total <= INT8_MAX_MEAN_PP
    if server["knn"]["base"]["name"] == "linear":
        _device_refits_its_head(capsys, tmp_path, server)


def _device_refits_its_head(capsys, tmp_path, server) -> None:
    """A device that learns with `add` refits its linear head with the exporter's l2 on what it
    then stores, and evaluates from the refitted bundle."""
    cid = server["clients"][0]["client_id"]
    bundle = tmp_path / "b" / f"client_{cid:04d}"
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["knn_choice"]["l2"]["value"] == server["knn"]["base"]["l2"]
    assert edge_main(["add", str(bundle), "--data", str(tmp_path / f"c{cid}" / "val.npz")]) == 0
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert [n for n in manifest["files"] if n.startswith("linear_head")] == ["linear_head.1.npz"]
    store = load_bundle_datastore(bundle, read_manifest(bundle))
    head = LinearHead(manifest["num_classes"], l2=server["knn"]["base"]["l2"]).fit(
        store.keys(), store.labels_
    )
    model = Encoder(bundle / "encoder.onnx")  # as exported: the shipped head
    refitted = Runtime.load(bundle)
    with np.load(tmp_path / f"c{cid}" / "test.npz", allow_pickle=False) as data:
        x = data["x"]
    xp = prepare_input(x[:16], manifest["input"])
    z, logits = refitted.embed(x[:16])
    np.testing.assert_allclose(logits, z @ head.coef_ + head.intercept_, atol=1e-4)
    assert not np.allclose(logits, model.run(xp)[1], atol=1e-4)
    capsys.readouterr()
    _device_correct(capsys, bundle, tmp_path / f"c{cid}" / "test.npz")
