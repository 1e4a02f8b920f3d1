"""Turn raw device inputs (uint8 images or token ids) into the encoder's input tensor.

The server-side trainer imports `prepare_input` too, so a model sees exactly the same numbers in
training, in server-side evaluation and on the device.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .values import is_integer, is_real

INPUT_KINDS = ("image", "tokens")
# Values in one sample: 4096 x 4096 x 1 (64 MiB as float32); what a manifest's shape may ask
# a device to allocate per sample, checked before anything is.
MAX_INPUT_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class InputSpec:
    """What an encoder takes (see CONTRACTS: "Input spec"), checked once when built: its
    members as attributes, and `json`, the object as given (a manifest's "input"), which is
    what `to_json` writes back, in the same bytes. ValueError, naming the field, for a spec
    that is not one.

    Image: {"kind": "image", "shape": [H, W, C], "dtype": "uint8", "mean": [C floats],
    "std": [C floats > 0]}. Tokens: {"kind": "tokens", "shape": [L], "dtype": "int64",
    "vocab_size": V}.
    """

    json: dict[str, Any]
    kind: str = field(init=False)
    shape: tuple[int, ...] = field(init=False)
    dtype: str = field(init=False)  # of a raw sample: "uint8" pixels or "int64" token ids
    mean: tuple[float, ...] = field(init=False)  # per channel, images only (else ())
    std: tuple[float, ...] = field(init=False)
    vocab_size: int | None = field(init=False)  # tokens only

    def __post_init__(self) -> None:
        spec = _checked(self.json)
        image = spec["kind"] == "image"
        members = {
            "json": copy.deepcopy(dict(spec)),
            "kind": spec["kind"],
            "shape": tuple(int(s) for s in spec["shape"]),
            "dtype": "uint8" if image else "int64",
            "mean": tuple(float(v) for v in spec["mean"]) if image else (),
            "std": tuple(float(v) for v in spec["std"]) if image else (),
            "vocab_size": None if image else int(spec["vocab_size"]),
        }
        for name, value in members.items():
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, spec: InputSpec | Mapping[str, Any]) -> InputSpec:
        """`spec` as an InputSpec (checked where it is the JSON object of one)."""
        return spec if isinstance(spec, InputSpec) else cls(spec)  # type: ignore[arg-type]

    def to_json(self) -> dict[str, Any]:
        """A copy of the object to write (a manifest's "input")."""
        return copy.deepcopy(self.json)


def _checked(spec: Any) -> Mapping[str, Any]:
    if not isinstance(spec, Mapping):
        raise ValueError(f"input spec must be a JSON object, got {type(spec).__name__}")
    kind = spec.get("kind")
    if kind not in INPUT_KINDS:
        raise ValueError(f"input spec 'kind' must be one of {list(INPUT_KINDS)}, got {kind!r}")
    shape = spec.get("shape")
    want_rank = 3 if kind == "image" else 1
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) != want_rank
        or not all(is_integer(s) and s > 0 for s in shape)
    ):
        raise ValueError(
            f"input spec 'shape' for {kind} must be {want_rank} positive integers, got {shape!r}"
        )
    if math.prod(shape) > MAX_INPUT_ELEMENTS:  # before any buffer of that shape is made
        raise ValueError(
            f"input spec 'shape' {list(shape)} has {math.prod(shape)} values per sample, over "
            f"the {MAX_INPUT_ELEMENTS} this runtime takes"
        )
    if kind == "image":
        if spec.get("dtype", "uint8") != "uint8":
            raise ValueError(f"image input spec 'dtype' must be 'uint8', got {spec.get('dtype')!r}")
        channels = shape[2]
        for field in ("mean", "std"):
            values = spec.get(field)
            if (
                not isinstance(values, (list, tuple))
                or len(values) != channels
                or not all(is_real(v, finite=True) for v in values)
            ):
                raise ValueError(
                    f"image input spec '{field}' must be {channels} finite numbers (one per "
                    f"channel), got {values!r}"
                )
        if any(v <= 0 for v in spec["std"]):
            raise ValueError(f"image input spec 'std' must be positive, got {spec['std']!r}")
    else:
        if spec.get("dtype", "int64") != "int64":
            raise ValueError(
                f"tokens input spec 'dtype' must be 'int64', got {spec.get('dtype')!r}"
            )
        vocab = spec.get("vocab_size")
        if not is_integer(vocab) or vocab < 1:
            raise ValueError(
                f"tokens input spec 'vocab_size' must be a positive integer, got {vocab!r}"
            )
    return spec


def prepare_input(x: np.ndarray, spec: InputSpec | Mapping[str, Any]) -> np.ndarray:
    """Raw input -> encoder input. A single sample gets a batch axis of 1.

    image: uint8 [N,H,W,C] or [H,W,C] (grey images, C=1, may omit the channel axis)
           -> float32 [N,C,H,W] holding (x/255 - mean) / std.
    tokens: integer [N,L] or [L] with ids in [0, vocab_size) -> int64 [N,L].
    Raises ValueError naming the problem (shape, dtype, NaN, value range).
    """
    return prepare_checked(x, InputSpec.of(spec))


def prepare_checked(x: np.ndarray, spec: InputSpec) -> np.ndarray:
    """prepare_input for a spec already checked (the runtime checks its bundle's spec once, at
    load, rather than on every call)."""
    x = np.asarray(x)
    _check_dtype(x, spec)
    if spec.kind == "image":
        return _normalise_image(_image_batch(x, spec), spec)
    return _prepare_tokens(x, spec)


def raw_checked(x: np.ndarray, spec: InputSpec | Mapping[str, Any]) -> np.ndarray:
    """The same checks as `prepare_checked`, but the raw inputs back as a batch (uint8
    [N, H, W, C] or int64 [N, L]): what a graph that normalises by itself takes."""
    spec = InputSpec.of(spec)
    x = np.asarray(x)
    _check_dtype(x, spec)
    if spec.kind == "image":
        return np.ascontiguousarray(_image_batch(x, spec))
    return _prepare_tokens(x, spec)


def _check_dtype(x: np.ndarray, spec: InputSpec) -> None:
    kind = spec.kind
    expected = "uint8 pixels (0..255)" if kind == "image" else "integer token ids"
    if x.dtype.kind in "fc":
        if x.size and not np.all(np.isfinite(x)):
            raise ValueError(f"input contains NaN or infinite values; expected {expected}")
        raise ValueError(
            f"input dtype {x.dtype} is not supported: expected {expected}, not floats "
            "(the runtime normalizes itself)"
        )
    if x.dtype.kind not in "iu":
        raise ValueError(f"input dtype {x.dtype} is not supported: expected {expected}")


def is_one_sample(shape: tuple[int, ...], spec: InputSpec) -> bool:
    """Whether an input of this shape is one sample without a batch axis (which the runtime
    accepts), rather than a batch."""
    if spec.kind != "image":
        return len(shape) == 1
    h, w, c = spec.shape
    return shape == (h, w, c) or (c == 1 and shape == (h, w))


def _image_batch(x: np.ndarray, spec: InputSpec) -> np.ndarray:
    """Checked uint8 images [N, H, W, C] (one image gets a batch axis)."""
    if x.ndim != 4 or x.shape[1:] != spec.shape:  # a batch is tried first: batch 1's path
        h, w, c = spec.shape
        if is_one_sample(x.shape, spec):
            x = x.reshape(1, h, w, c)
        elif c == 1 and x.ndim == 3 and x.shape[1:] == (h, w):
            x = x.reshape(x.shape[0], h, w, 1)
        else:
            raise ValueError(
                f"input shape {list(x.shape)} does not match the model: expected images "
                f"[N, {h}, {w}, {c}] or one image [{h}, {w}, {c}]"
            )
    if x.dtype != np.uint8:
        if x.size and (x.min() < 0 or x.max() > 255):
            raise ValueError(f"pixel values must be in 0..255, got range [{x.min()}, {x.max()}]")
        x = x.astype(np.uint8)
    return x


def _normalise_image(x: np.ndarray, spec: InputSpec) -> np.ndarray:
    c = spec.shape[2]
    mean = np.asarray(spec.mean, dtype=np.float32).reshape(1, c, 1, 1)
    std = np.asarray(spec.std, dtype=np.float32).reshape(1, c, 1, 1)
    out = x.transpose(0, 3, 1, 2).astype(np.float32)
    out /= np.float32(255.0)
    out -= mean
    out /= std
    return np.ascontiguousarray(out)


def _prepare_tokens(x: np.ndarray, spec: InputSpec) -> np.ndarray:
    (length,) = spec.shape
    if x.ndim == 1 and x.shape[0] == length:
        x = x.reshape(1, length)
    elif x.ndim != 2 or x.shape[1] != length:
        raise ValueError(
            f"input shape {list(x.shape)} does not match the model: expected token ids "
            f"[N, {length}] or one sequence [{length}]"
        )
    vocab = spec.vocab_size
    if x.size and (x.min() < 0 or x.max() >= vocab):
        raise ValueError(f"token ids must be in [0, {vocab}), got range [{x.min()}, {x.max()}]")
    return np.ascontiguousarray(x, dtype=np.int64)
