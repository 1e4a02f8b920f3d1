"""Models with the two parts kNN-Per needs: embed(x) -> z and head(z) -> logits."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


class EmbedHeadModel(nn.Module):
    """A body that maps inputs to an embedding and a linear head on top; FedRep and kNN-Per both
    rely on this split, so every model here has it."""

    embedding_dim: int

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.classifier(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))

    def head_parameter_names(self) -> list[str]:
        return [f"classifier.{name}" for name, _ in self.classifier.named_parameters()]


# How every algorithm is given its model: a fresh one per call (its working copies, its
# personal models), built for the run's data and placed on the run's device.
ModelFactory = Callable[[], EmbedHeadModel]


class SmallCNN(EmbedHeadModel):
    """Two 3x3 conv blocks and a hidden layer: small enough to train federatedly in minutes on
    2 CPU cores for 28x28x1 or 32x32x3 inputs (and digits' 8x8)."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int,
        image_size: int,
        width: int = 16,
        embedding_dim: int = 128,
    ) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = image_size // 4
        self.hidden = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * side * side, embedding_dim), nn.ReLU()
        )
        self.classifier = nn.Linear(embedding_dim, num_classes)
        self.embedding_dim = embedding_dim

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.hidden(self.features(x))


def _norm(channels: int, norm: str) -> nn.Module:
    """BatchNorm (the paper's) or GroupNorm: no running statistics, so the clients of a round
    can step together (fed_train.algorithms.stepping)."""
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    if norm == "group":
        return nn.GroupNorm(math.gcd(channels, 32), channels)
    raise ValueError(f"norm must be batch or group, got {norm!r}")


def _conv_bn(
    inp: int,
    out: int,
    kernel: int,
    stride: int,
    groups: int = 1,
    act: bool = True,
    norm: str = "batch",
) -> list[nn.Module]:
    layers: list[nn.Module] = [
        nn.Conv2d(inp, out, kernel, stride, kernel // 2, groups=groups, bias=False),
        _norm(out, norm),
    ]
    if act:
        layers.append(nn.ReLU6(inplace=True))
    return layers


class _InvertedResidual(nn.Module):
    def __init__(self, inp: int, out: int, stride: int, expand: int, norm: str) -> None:
        super().__init__()
        hidden = inp * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += _conv_bn(inp, hidden, 1, 1, norm=norm)
        layers += _conv_bn(hidden, hidden, 3, stride, groups=hidden, norm=norm)
        layers += _conv_bn(hidden, out, 1, 1, act=False, norm=norm)
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and inp == out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


class MobileNetV2(EmbedHeadModel):
    """MobileNet-v2 (Sandler et al. 2018), the paper's model: the 1280-d pooled features are the
    embedding. Strides of the stem and the first stages are 1 for 32x32 inputs, as is usual on
    CIFAR. `norm="group"` swaps BatchNorm for GroupNorm (mobilenet-v2-gn)."""

    _SETTINGS = (
        (1, 16, 1, 1),
        (6, 24, 2, 1),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(
        self, num_classes: int, in_channels: int = 3, embedding_dim: int = 1280, norm: str = "batch"
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = _conv_bn(in_channels, 32, 3, 1, norm=norm)
        inp = 32
        for expand, out, repeats, stride in self._SETTINGS:
            for i in range(repeats):
                layers.append(_InvertedResidual(inp, out, stride if i == 0 else 1, expand, norm))
                inp = out
        layers += _conv_bn(inp, embedding_dim, 1, 1, norm=norm)
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(embedding_dim, num_classes)
        self.embedding_dim = embedding_dim

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.features(x)), 1)


class CharLSTM(EmbedHeadModel):
    """Two-layer LSTM over characters; as in the paper, the embedding is the final hidden and cell
    states of both layers (4 x 256 = 1024 dimensions)."""

    def __init__(
        self,
        num_classes: int,
        vocab_size: int,
        hidden: int = 256,
        layers: int = 2,
        char_dim: int = 8,
    ) -> None:
        super().__init__()
        self.chars = nn.Embedding(vocab_size, char_dim)
        self.lstm = nn.LSTM(char_dim, hidden, num_layers=layers, batch_first=True)
        self.embedding_dim = 2 * layers * hidden
        self.classifier = nn.Linear(self.embedding_dim, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        _, (h, c) = self.lstm(self.chars(x))
        return torch.cat([h.transpose(0, 1).flatten(1), c.transpose(0, 1).flatten(1)], dim=1)


def _small_cnn(num_classes: int, spec: dict) -> nn.Module:
    height, width, channels = spec["shape"]
    if height != width:
        raise ValueError(f"small-cnn expects square images, got {height}x{width}")
    return SmallCNN(num_classes, channels, height)


MODELS: dict[str, Callable[[int, dict], nn.Module]] = {
    "small-cnn": _small_cnn,
    "mobilenet-v2": lambda classes, spec: MobileNetV2(classes, spec["shape"][2]),
    "mobilenet-v2-gn": lambda classes, spec: MobileNetV2(classes, spec["shape"][2], norm="group"),
    "char-lstm": lambda classes, spec: CharLSTM(classes, spec["vocab_size"]),
}


def default_model(input_spec: dict) -> str:
    return "char-lstm" if input_spec["kind"] == "tokens" else "small-cnn"


def build_model(name: str, num_classes: int, input_spec: dict) -> EmbedHeadModel:
    """An untrained embedding + linear-head model.

    Parameters
    ----------
    name : a key of MODELS ("small-cnn", "mobilenet-v2", "mobilenet-v2-gn", "char-lstm";
        char-lstm takes token inputs, the others images).
    num_classes : the head's outputs.
    input_spec : the data set's input description (`Dataset.input_spec`).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    kind = input_spec["kind"]
    if (name == "char-lstm") != (kind == "tokens"):
        raise ValueError(f"model {name!r} does not take {kind} inputs")
    return MODELS[name](num_classes, input_spec)
