"""A client's encoder with its linear head: "logits" becomes the head on the "embedding" output,
the embeddings stay as they were, and nothing of the global classifier is left to run."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from edge_runtime.knn import softmax
from edge_runtime.linear_head import LinearHead
from export.errors import ExportError
from export.personal_encoder import with_linear_head
from tests.helpers.bundles import NUM_CLASSES, make_image_encoder, make_images, raw_outputs


def test_logits_become_the_linear_head_on_the_embedding(tmp_path):
    encoder = make_image_encoder(tmp_path / "encoder.onnx")
    x, y = make_images(60, seed=1, signal=30)
    z, _ = raw_outputs(encoder, x)
    head = LinearHead(NUM_CLASSES, l2=1e-3).fit(z, y)
    personal = tmp_path / "personal.onnx"
    personal.write_bytes(with_linear_head(encoder, head))
    z2, logits = raw_outputs(personal, x)
    np.testing.assert_array_equal(z2, z)
    np.testing.assert_allclose(logits, z @ head.coef_ + head.intercept_, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(softmax(logits.astype(np.float64)), head.predict_proba(z), atol=1e-5)
    model = onnx.load(personal)
    names = {i.name for i in model.graph.initializer}
    assert "w2" not in names and "b2" not in names  # the global classifier is gone
    assert [n.op_type for n in model.graph.node][-1] == "Gemm"


def test_a_head_of_another_width_is_refused(tmp_path):
    encoder = make_image_encoder(tmp_path / "encoder.onnx")
    head = LinearHead(NUM_CLASSES).fit(
        np.random.default_rng(0).normal(size=(20, 3)), np.arange(20) % NUM_CLASSES
    )
    with pytest.raises(ExportError, match="linear head was fitted on 3"):
        with_linear_head(encoder, head)
