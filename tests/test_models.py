"""Every model exposes the embed/head split kNN-Per needs, with the paper's embedding sizes."""

import pytest
import torch

from fed_train.models import build_model


@pytest.mark.parametrize(
    ("name", "spec", "x", "dim"),
    [
        ("small-cnn", {"kind": "image", "shape": [28, 28, 1]}, torch.zeros(2, 1, 28, 28), 128),
        ("small-cnn", {"kind": "image", "shape": [32, 32, 3]}, torch.zeros(2, 3, 32, 32), 128),
        ("small-cnn", {"kind": "image", "shape": [8, 8, 1]}, torch.zeros(2, 1, 8, 8), 128),
        ("mobilenet-v2", {"kind": "image", "shape": [32, 32, 3]}, torch.zeros(2, 3, 32, 32), 1280),
        (
            "char-lstm",
            {"kind": "tokens", "shape": [80], "vocab_size": 81},
            torch.zeros(2, 80, dtype=torch.long),
            1024,
        ),
    ],
)
def test_forward_is_head_of_embed(name, spec, x, dim):
    model = build_model(name, 10, spec).eval()
    with torch.no_grad():
        z = model.embed(x)
        assert z.shape == (2, dim) == (2, model.embedding_dim)
        torch.testing.assert_close(model(x), model.head(z))
    assert model(x).shape == (2, 10)


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="unknown model"):
        build_model("resnet", 10, {"kind": "image", "shape": [28, 28, 1]})


def test_model_and_input_kind_must_agree():
    with pytest.raises(ValueError, match="does not take"):
        build_model("char-lstm", 10, {"kind": "image", "shape": [28, 28, 1]})
