"""The device on ARM gives x86's answer: the bundles tests/helpers/arm_cases.py exported on x86
(digits CNN, Fashion-MNIST CNN, MobileNet-v2-gn; flat int8 / fp16 / fp32 and ProtoNN), loaded
by the device runtime under emulated ARM, predict the same argmax on every input (200 per
model) with probabilities (and the int8 encoder's embedding and logits) within
1e-5 of x86's.

Run by .ci/arm under qemu-aarch64-static, once per ARM CPU model, with KNNPER_ARM_CASES naming
the x86 side's folder; elsewhere it skips.
"""

from __future__ import annotations

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
    runtime = Runtime.load(case["bundle"], intra_op_threads=1)
    x = np.load(case["inputs"], allow_pickle=False)
    expected = np.load(case["probabilities"], allow_pickle=False)
    probabilities = runtime.predict_proba(x)
    np.testing.assert_array_equal(probabilities.argmax(1), expected.argmax(1))
    np.testing.assert_allclose(probabilities, expected, rtol=0, atol=TOLERANCE)
    if "embedding" in case:
        z, logits = runtime.embed(x)
        for got, name in ((z, "embedding"), (logits, "logits")):
            want = np.load(case[name], allow_pickle=False)
            np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE, err_msg=name)
        np.testing.assert_array_equal(logits.argmax(1), want.argmax(1))
