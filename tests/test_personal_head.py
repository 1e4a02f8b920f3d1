"""The personal head: its math by hand, and one head from server to device: the server's kNN-Per,
the exporter's sizer, `knnper-edge init` and the runtime, fed the same embeddings, choose the
same lambda and predict the same classes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_runtime.budget import Budget
from edge_runtime.device_choice import InitSettings
from edge_runtime.device_init import init_bundle
from edge_runtime.knn import CLIENT_RULE, LAMBDA_GRID, KNNHead, LambdaRule, softmax
from edge_runtime.knn_provenance import KNNProvenance
from edge_runtime.linear_head import LinearHead
from edge_runtime.manifest import BundleFields
from edge_runtime.personal_head import ClientSplits, PersonalHead
from edge_runtime.preprocess import InputSpec
from edge_runtime.runtime import Runtime
from export.sizing import DatastoreSizer, SearchSpace
from fed_train.knn_setting import KNNChoice, KNNConfig
from tests.helpers.bundles import (
    IMAGE_SPEC,
    NUM_CLASSES,
    make_image_encoder,
    make_images,
    raw_outputs,
)


def _splits(z_train, y_train, z_val, y_val, p_val, p_train=None) -> ClientSplits:
    p_train = np.full((len(y_train), 2), 0.5) if p_train is None else p_train
    return ClientSplits(
        0,
        False,
        np.asarray(z_train, np.float32),
        np.asarray(y_train),
        np.asarray(z_val, np.float32),
        np.asarray(y_val),
        np.zeros((0, 1), np.float32),
        np.zeros(0, np.int64),
        p_train,
        np.asarray(p_val, np.float64),
        np.zeros((0, 2)),
    )


def test_prediction_is_the_hand_computed_mixture():
    # keys at 0 and 3 on a line (p = 1), k = 2, sigma = 1: a query at 1 has squared distances
    # 1 and 4, so p_knn = softmax(-[1, 4] / 1) over the labels [0, 1]
    data = _splits([[0.0], [3.0]], [0, 1], [[0.0]], [0], [[0.5, 0.5]])
    head = PersonalHead(2, k=2, sigma=1.0).fit(data).with_lambda(0.3)
    w = np.exp([-1.0, -4.0]) / np.exp([-1.0, -4.0]).sum()
    p_global = np.array([[0.2, 0.8]])
    expected = 0.3 * w + 0.7 * p_global[0]
    np.testing.assert_allclose(
        head.predict_proba(np.array([[1.0]], np.float32), p_global)[0], expected, rtol=1e-12
    )


def test_lambda_is_the_rules_choice_on_validation():
    # the kNN is right on every validation sample, the global model says 0.9 for the wrong
    # class: every lambda above 4/9 classifies all right, and the log-loss is lowest at 1
    z = [[0.0], [10.0]]
    data = _splits(z, [0, 1], z, [0, 1], [[0.1, 0.9], [0.9, 0.1]])
    head = PersonalHead(2, k=1).fit(data)
    assert head.lambda_ == 1.0
    assert head.val_accuracy_ == 1.0
    np.testing.assert_array_equal(head.evidence_[:, 2], 2)  # two samples at each grid point
    assert head.evidence_[LAMBDA_GRID.index(0.3), 0] == 0  # 0.3 + 0.7 * 0.1 < 0.5: both wrong


def test_without_validation_the_rule_decides():
    data = _splits(
        [[0.0], [1.0]], [0, 1], np.zeros((0, 1)), np.zeros(0, np.int64), np.zeros((0, 2))
    )
    assert PersonalHead(2, k=1, rule=CLIENT_RULE).fit(data).lambda_ == 0.5
    pooled = np.zeros((len(LAMBDA_GRID), 3))
    pooled[:, 2] = 10
    pooled[:, 0] = [5, 5, 6, 9, 7, 5, 5]  # 0.5 is right most often
    head = PersonalHead(2, k=1, rule=LambdaRule("pooled", tuple(map(tuple, pooled)))).fit(data)
    assert head.lambda_ == 0.5 and head.val_accuracy_ is None
    pooled[:, 0] = [5, 5, 6, 7, 9, 5, 5]
    head = PersonalHead(2, k=1, rule=LambdaRule("pooled", tuple(map(tuple, pooled)))).fit(data)
    assert head.lambda_ == 0.7


def test_linear_base_is_a_linear_head_on_the_normalised_train_embeddings():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 60)
    z = (rng.normal(size=(60, 4)) + 3 * y[:, None]).astype(np.float32)
    data = _splits(z[:40], y[:40], z[40:], y[40:], np.full((20, 2), 0.5))
    head = PersonalHead(2, normalize="l2", l2=0.1).fit(data)
    norm = z[:40] / np.linalg.norm(z[:40], axis=1, keepdims=True)
    linear = LinearHead(2, l2=0.1).fit(norm, y[:40])
    queries = z[40:] / np.linalg.norm(z[40:], axis=1, keepdims=True)
    np.testing.assert_allclose(head.base_proba(z[40:], None), linear.predict_proba(queries))
    with pytest.raises(ValueError, match="l2 must be positive"):
        PersonalHead(2, l2=0.0)


def test_a_client_without_train_data_is_refused():
    data = _splits(np.zeros((0, 1)), np.zeros(0, np.int64), [[0.0]], [0], [[0.5, 0.5]])
    with pytest.raises(ValueError, match="no training samples"):
        PersonalHead(2).fit(data)


@pytest.mark.parametrize("rule_name", ["client", "pooled"])
def test_server_exporter_device_init_and_runtime_choose_and_predict_alike(tmp_path, rule_name):
    encoder = make_image_encoder(tmp_path / "encoder.onnx", seed=3)
    rule = CLIENT_RULE
    if rule_name == "pooled":
        xo, yo = make_images(120, seed=103, signal=20)
        zo, lo = raw_outputs(encoder, xo)
        other = ClientSplits.from_logits(
            9, False, (zo[:80], lo[:80], yo[:80]), (zo[80:], lo[80:], yo[80:])
        )
        rule = LambdaRule(
            "pooled", tuple(map(tuple, PersonalHead(NUM_CLASSES).fit(other).evidence_))
        )
    x, y = make_images(160, seed=3, signal=50)
    val_fraction, budget = 0.25, 10**6
    init = init_bundle(
        encoder,
        x,
        y,
        budget,
        tmp_path / "device",
        input_spec=IMAGE_SPEC,
        settings=InitSettings(
            recipes=["flat:fp32"], val_fraction=val_fraction, seed=3, lambda_rule=rule
        ),
    )
    order = np.random.default_rng(3).permutation(len(y))
    n_val = int(round(val_fraction * len(y)))
    val, train = order[:n_val], order[n_val:]
    z, logits = raw_outputs(encoder, x)
    data = ClientSplits.from_logits(
        0, True, (z[train], logits[train], y[train]), (z[val], logits[val], y[val])
    )
    server = PersonalHead(NUM_CLASSES, rule=rule).fit(data)
    sizer = DatastoreSizer(
        NUM_CLASSES,
        space=SearchSpace(backends=("flat",), flat_dtypes=("fp32",)),
        seed=3,
        knn=KNNChoice(lambda_rule=rule),
    ).fit(data, Budget(budget, encoder.stat().st_size))
    assert server.lambda_ == sizer.best_.lam == init.lam
    assert server.val_accuracy_ == pytest.approx(sizer.best_.val_accuracy)
    assert server.val_accuracy_ == pytest.approx(init.val_accuracy)

    # the device keeps every sample it has (validation ones too): the server's head refitted
    # on them with its lambda is what the runtime must predict, sample for sample
    x_new, _ = make_images(64, seed=33, signal=50)
    z_new, logits_new = raw_outputs(encoder, x_new)
    refit = PersonalHead.fitted(NUM_CLASSES, KNNHead(NUM_CLASSES).fit(z, y), server.lambda_)
    on_server = refit.predict_proba(z_new, softmax(logits_new.astype(np.float64)))
    runtime = Runtime.load(tmp_path / "device")
    np.testing.assert_allclose(runtime.predict_proba(x_new), on_server, atol=1e-5)
    np.testing.assert_array_equal(runtime.predict(x_new), on_server.argmax(axis=1))


def test_the_experiments_pool_lambda_at_each_point_as_the_server_does():
    from experiments.views import choice_rows
    from fed_train.knn_tuning import fit_rule

    rng = np.random.default_rng(5)
    views = []
    for cid in range(6):
        y = rng.integers(0, 2, 50)
        z = (rng.normal(size=(50, 3)) + 1.5 * y[:, None]).astype(np.float32)
        p = softmax(rng.normal(size=(50, 2)))
        views.append(
            ClientSplits(
                cid,
                cid == 5,
                z[:30],
                y[:30],
                z[30:40],
                y[30:40],
                z[40:],
                y[40:],
                p[:30],
                p[30:40],
                p[40:],
            )
        )
    own = choice_rows(views, 2, KNNChoice(KNNConfig(5, 1.0)), seed=0)
    # the pooled rule is fitted at the point, from the clients' own evidence: the rule's own
    # pooled sums (here uniform) are not what choice_rows uses
    uniform = LambdaRule("pooled", tuple((1.0, 1.0, 1.0) for _ in LAMBDA_GRID))
    pooled = choice_rows(views, 2, KNNChoice(KNNConfig(5, 1.0), lambda_rule=uniform), seed=0)
    heads = [PersonalHead(2, k=5).fit(v) for v in views]
    expected = fit_rule("pooled", [h.evidence_ for h in heads[:5]]).choose_from_counts(
        heads[0].evidence_
    )
    assert {r["info"]["lambda"] for r in pooled} == {expected}  # one lambda, from seen clients
    assert [r["info"]["lambda"] for r in own] == [h.lambda_ for h in heads]
    assert len({h.lambda_ for h in heads}) > 1  # their own evidence disagrees


def test_init_like_a_bundle_chooses_lambda_by_the_rule_it_ships(tmp_path, capsys):
    from edge_runtime.bundle import read_manifest, write_bundle
    from edge_runtime.cli import main as edge_main
    from edge_runtime.datastores import FlatDatastore

    encoder = make_image_encoder(tmp_path / "encoder.onnx", seed=4)
    x, y = make_images(60, seed=4, signal=50)
    z, _ = raw_outputs(encoder, x)
    pooled = np.zeros((len(LAMBDA_GRID), 3))
    pooled[:, 2] = 100
    pooled[LAMBDA_GRID.index(0.9), 0] = 100  # the seen clients were right at 0.9 alone
    rule = LambdaRule("pooled", tuple(map(tuple, pooled)))
    write_bundle(
        tmp_path / "exported",
        BundleFields(1, InputSpec(IMAGE_SPEC), 0.9, 10**6, lambda_rule=rule),
        encoder,
        FlatDatastore(NUM_CLASSES).fit(z, y),
    )
    np.savez(tmp_path / "own.npz", x=x, y=y)
    for name, like in (("device", True), ("plain", False)):
        spec = (
            ["--like", str(tmp_path / "exported")]
            if like
            else ["--input-spec", str(tmp_path / "spec.json")]
        )
        (tmp_path / "spec.json").write_text(json.dumps(IMAGE_SPEC))
        assert (
            edge_main(
                [
                    "init",
                    "--encoder",
                    str(encoder),
                    "--data",
                    str(tmp_path / "own.npz"),
                    "--budget",
                    "1MB",
                    "--out",
                    str(tmp_path / name),
                    *spec,
                ]
            )
            == 0
        )
    capsys.readouterr()
    own = init_bundle(encoder, x, y, 10**6, tmp_path / "direct", input_spec=IMAGE_SPEC)
    assert read_manifest(tmp_path / "device").lam == 0.9  # the pooled rule's choice
    assert read_manifest(tmp_path / "plain").lam == own.lam != 0.9  # its own evidence


def test_init_like_a_linear_base_bundle_sets_its_pooled_rule_aside(tmp_path, capsys):
    """Pooled evidence measured with the clients' linear heads as the base ranked lambdas for
    another mixture: a new device (global base) got lambda 0 and 2-8% accuracy."""
    from edge_runtime.bundle import read_manifest, write_bundle
    from edge_runtime.cli import main as edge_main
    from edge_runtime.datastores import FlatDatastore

    encoder = make_image_encoder(tmp_path / "encoder.onnx", seed=4)
    x, y = make_images(60, seed=4, signal=50)
    z, _ = raw_outputs(encoder, x)
    pooled = np.zeros((len(LAMBDA_GRID), 3))
    pooled[:, 2] = 100
    pooled[LAMBDA_GRID.index(0.9), 0] = 100
    rule = LambdaRule("pooled", tuple(map(tuple, pooled)))
    choice = {
        "k": {"value": 10, "source": "validation"},
        "sigma": {"value": 1.0, "source": "validation"},
        "normalize": {"value": "none", "source": "validation"},
        "lambda_estimator": {"value": "val", "source": "validation"},
        "lambda_rule": {"value": "pooled", "source": "flag"},
        "base": {"value": "linear", "source": "validation"},
        "l2": {"value": 0.01, "source": "validation"},
    }
    write_bundle(
        tmp_path / "exported",
        BundleFields(
            1, InputSpec(IMAGE_SPEC), 0.9, 10**6, knn_choice=KNNProvenance(choice), lambda_rule=rule
        ),
        encoder,
        FlatDatastore(NUM_CLASSES).fit(z, y),
    )
    np.savez(tmp_path / "own.npz", x=x, y=y)
    capsys.readouterr()
    assert (
        edge_main(
            [
                "init",
                "--encoder",
                str(encoder),
                "--data",
                str(tmp_path / "own.npz"),
                "--budget",
                "1MB",
                "--out",
                str(tmp_path / "device"),
                "--like",
                str(tmp_path / "exported"),
            ]
        )
        == 0
    )
    assert "measured with each client's own linear head" in capsys.readouterr().err
    own = init_bundle(encoder, x, y, 10**6, tmp_path / "direct", input_spec=IMAGE_SPEC)
    assert read_manifest(tmp_path / "device").lam == own.lam != 0.9


def test_the_sizer_scores_candidates_with_the_loo_estimator():
    rng = np.random.default_rng(7)
    y = rng.integers(0, NUM_CLASSES, 90)
    z = (rng.normal(size=(90, 6)) + 2 * y[:, None]).astype(np.float32)
    logits = rng.normal(size=(90, NUM_CLASSES)).astype(np.float32)
    data = ClientSplits.from_logits(
        0, False, (z[:60], logits[:60], y[:60]), (z[60:], logits[60:], y[60:])
    )
    space = SearchSpace(backends=("flat",), flat_dtypes=("fp32",))
    sizer = DatastoreSizer(NUM_CLASSES, space=space, knn=KNNChoice(lambda_estimator="loo+val")).fit(
        data, Budget(10**6, 0)
    )
    loo = PersonalHead(NUM_CLASSES, estimator="loo+val").fit(data)
    assert sizer.best_.lam == loo.lambda_
