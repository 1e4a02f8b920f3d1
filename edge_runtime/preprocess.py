"""Turn raw device inputs (uint8 images or token ids) into the encoder's input tensor.

The server-side trainer imports `prepare_input` too, so a model sees exactly the same numbers in
training, in server-side evaluation and on the device.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .values import is_integer, is_real

INPUT_KINDS = ("image", "tokens")
# Values in one sample: 4096 x 4096 x 1 (64 MiB as float32); what a manifest's shape may ask
# a device to allocate per sample, checked before anything is.
MAX_INPUT_ELEMENTS = 1 << 24


def validate_spec(spec: Any) -> dict:
    """Check an input spec (see CONTRACTS: "Input spec") and return it; ValueError names the field.

    Image: {"kind": "image", "shape": [H, W, C], "dtype": "uint8", "mean": [C floats],
    "std": [C floats > 0]}. Tokens: {"kind": "tokens", "shape": [L], "dtype": "int64",
    "vocab_size": V}.
    """
    if not isinstance(spec, dict):
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


def prepare_input(x: np.ndarray, spec: dict) -> np.ndarray:
    """Raw input -> encoder input. A single sample gets a batch axis of 1.

    image: uint8 [N,H,W,C] or [H,W,C] (grey images, C=1, may omit the channel axis)
           -> float32 [N,C,H,W] holding (x/255 - mean) / std.
    tokens: integer [N,L] or [L] with ids in [0, vocab_size) -> int64 [N,L].
    Raises ValueError naming the problem (shape, dtype, NaN, value range).
    """
    return prepare_checked(x, validate_spec(spec))


def prepare_checked(x: np.ndarray, spec: dict) -> np.ndarray:
    """prepare_input for a spec that `validate_spec` already accepted (the runtime checks its
    bundle's spec once, at load, rather than on every call)."""
    x = np.asarray(x)
    _check_dtype(x, spec)
    if spec["kind"] == "image":
        return _normalise_image(_image_batch(x, spec), spec)
    return _prepare_tokens(x, spec)


def raw_checked(x: np.ndarray, spec: dict) -> np.ndarray:
    """The same checks as `prepare_checked`, but the raw inputs back as a batch (uint8
    [N, H, W, C] or int64 [N, L]): what a graph that normalises by itself takes."""
    x = np.asarray(x)
    _check_dtype(x, spec)
    if spec["kind"] == "image":
        return np.ascontiguousarray(_image_batch(x, spec))
    return _prepare_tokens(x, spec)


def _check_dtype(x: np.ndarray, spec: dict) -> None:
    kind = spec["kind"]
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


def is_one_sample(shape: tuple[int, ...], spec: dict) -> bool:
    """Whether an input of this shape is one sample without a batch axis (which the runtime
    accepts), rather than a batch."""
    if spec["kind"] != "image":
        return len(shape) == 1
    h, w, c = (int(s) for s in spec["shape"])
    return shape == (h, w, c) or (c == 1 and shape == (h, w))


def _image_batch(x: np.ndarray, spec: dict) -> np.ndarray:
    """Checked uint8 images [N, H, W, C] (one image gets a batch axis)."""
    h, w, c = (int(s) for s in spec["shape"])
    if is_one_sample(x.shape, spec):
        x = x.reshape(1, h, w, c)
    elif c == 1 and x.ndim == 3 and x.shape[1:] == (h, w):
        x = x.reshape(x.shape[0], h, w, 1)
    elif x.ndim != 4 or x.shape[1:] != (h, w, c):
        raise ValueError(
            f"input shape {list(x.shape)} does not match the model: expected images "
            f"[N, {h}, {w}, {c}] or one image [{h}, {w}, {c}]"
        )
    if x.dtype != np.uint8:
        if x.size and (x.min() < 0 or x.max() > 255):
            raise ValueError(f"pixel values must be in 0..255, got range [{x.min()}, {x.max()}]")
        x = x.astype(np.uint8)
    return x


def _normalise_image(x: np.ndarray, spec: dict) -> np.ndarray:
    c = int(spec["shape"][2])
    mean = np.asarray(spec["mean"], dtype=np.float32).reshape(1, c, 1, 1)
    std = np.asarray(spec["std"], dtype=np.float32).reshape(1, c, 1, 1)
    out = x.transpose(0, 3, 1, 2).astype(np.float32)
    out /= np.float32(255.0)
    out -= mean
    out /= std
    return np.ascontiguousarray(out)


def _prepare_tokens(x: np.ndarray, spec: dict) -> np.ndarray:
    (length,) = (int(s) for s in spec["shape"])
    if x.ndim == 1 and x.shape[0] == length:
        x = x.reshape(1, length)
    elif x.ndim != 2 or x.shape[1] != length:
        raise ValueError(
            f"input shape {list(x.shape)} does not match the model: expected token ids "
            f"[N, {length}] or one sequence [{length}]"
        )
    vocab = int(spec["vocab_size"])
    if x.size and (x.min() < 0 or x.max() >= vocab):
        raise ValueError(f"token ids must be in [0, {vocab}), got range [{x.min()}, {x.max()}]")
    return np.ascontiguousarray(x, dtype=np.int64)
