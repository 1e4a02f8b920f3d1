"""The device on ARM gives x86's answer: the bundles tests/helpers/arm_cases.py exported on x86
(digits CNN, Fashion-MNIST CNN, MobileNet-v2-gn; flat int8 / fp16 / fp32, HNSW and ProtoNN),
loaded by the device runtime under emulated ARM, predict the same argmax on every input (200
per model) with probabilities (and the int8 encoder's embedding and logits, read from the HNSW
bundle's encoder session) within 1e-5 of x86's.

Run by .ci/arm under qemu-aarch64-static, once per ARM CPU model (one process loads every
bundle), with KNNPER_ARM_CASES naming the x86 side's folder; elsewhere it skips. Each bundle
runs its inputs once, through the path predict_proba takes: the single-session predictor (flat
float32 / int8, ProtoNN) or the encoder session and the numpy head (HNSW, float16 keys), whose
embedding and logits are compared too. Under emulation MobileNet-v2-gn's encoder is nearly all
of the time, one pass per bundle.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
from pathlib import Path

import numpy as np
import pytest

from edge_runtime.runtime import Runtime

CASES = os.environ.get("KNNPER_ARM_CASES")
TOLERANCE = 1e-5


def _cases() -> list:
    if not CASES:
        reason = "runs under emulated ARM from .ci/arm (KNNPER_ARM_CASES: the x86 side's folder)"
        return [pytest.param(None, marks=pytest.mark.skip(reason=reason), id="not-on-arm")]
    record = json.loads((Path(CASES) / "cases.json").read_text())
    return [pytest.param(case, id=case["name"]) for case in record["cases"]]


def test_it_runs_on_arm():
    if not CASES:
        pytest.skip("runs under emulated ARM from .ci/arm")
    assert platform.machine() == "aarch64"


@pytest.mark.parametrize("case", _cases())
def test_the_bundle_answers_as_on_x86(case):
    if case["name"].endswith("/hnsw") and importlib.util.find_spec("hnswlib") is None:
        pytest.skip(
            "hnswlib is not in the emulated userland (.ci/arm could not build it): "
            "this model's HNSW bundle and encoder outputs are not compared"
        )
    runtime = Runtime.load(case["bundle"], intra_op_threads=1)
    x = np.load(case["inputs"], allow_pickle=False)
    if runtime.predictor is None:  # what predict_proba computes, keeping the encoder's outputs
        z, logits = runtime.embed(x)
        probabilities = runtime.posterior(z, logits)
    else:
        probabilities = runtime.predict_proba(x)
    if "embedding" in case:  # the encoder first: a departure there explains one below
        assert runtime.predictor is None, "the encoder's outputs are read from an HNSW bundle"
        for got, name in ((z, "embedding"), (logits, "logits")):
            want = np.load(case[name], allow_pickle=False)
            np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE, err_msg=name)
        np.testing.assert_array_equal(logits.argmax(1), want.argmax(1))
    expected = np.load(case["probabilities"], allow_pickle=False)
    np.testing.assert_array_equal(probabilities.argmax(1), expected.argmax(1))
    np.testing.assert_allclose(probabilities, expected, rtol=0, atol=TOLERANCE)
