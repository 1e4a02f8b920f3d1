"""Datastore recipe strings ("flat:int8:n500", "hnsw:M16", "protonn:d32:m0.3") and back."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

# Per backend: (token pattern, parameter name, converter); the first full match wins.
_TOKENS: dict[str, list[tuple[re.Pattern, str, Callable[[str], Any]]]] = {
    "flat": [
        (re.compile(r"(fp32|fp16|int8)"), "dtype", str),
        (re.compile(r"n(\d+)"), "n", int),
        (re.compile(r"x(\d+)"), "inputs", int),
    ],
    "hnsw": [
        (re.compile(r"M(\d+)"), "M", int),
        (re.compile(r"efc(\d+)"), "ef_construction", int),
        (re.compile(r"ef(\d+)"), "ef", int),
        (re.compile(r"n(\d+)"), "n", int),
        (re.compile(r"x(\d+)"), "inputs", int),
    ],
    "protonn": [
        (re.compile(r"d(\d+)"), "d", int),
        (re.compile(r"m(\d+(?:\.\d*)?|\.\d+)"), "m", float),
        (re.compile(r"n(\d+)"), "n", int),
        (re.compile(r"b(\d+)"), "buffer", int),
    ],
}
_TOKEN_HELP = {
    "flat": "fp32|fp16|int8, n<count> and x<input bytes>",
    "hnsw": "M<links>, ef<search width>, efc<construction width>, n<count> and x<input bytes>",
    "protonn": "d<projection dim>, m<prototype fraction>, n<count> and b<buffer capacity>",
}
_FORMAT = {
    "flat": [("dtype", "{}"), ("n", "n{}"), ("inputs", "x{}")],
    "hnsw": [("M", "M{}"), ("ef", "ef{}"), ("ef_construction", "efc{}"), ("n", "n{}"),
             ("inputs", "x{}")],
    "protonn": [("d", "d{}"), ("m", "m{:g}"), ("n", "n{}"), ("buffer", "b{}")],
}


def parse_recipe(recipe: str) -> tuple[str, dict]:
    """ "flat:int8:n500" -> ("flat", {"dtype": "int8", "n": 500}); ValueError on anything else.

    flat:fp32|fp16|int8[:n<count>][:x<input bytes>]
    hnsw[:M16][:ef64][:efc200][:n<count>][:x<input bytes>]
    protonn[:d<dim>][:m<fraction>][:n<count>][:b<buffer capacity>]
    """
    if not isinstance(recipe, str) or not recipe.strip():
        raise ValueError(f"a datastore recipe must be a non-empty string, got {recipe!r}")
    name, *tokens = recipe.strip().split(":")
    if name not in _TOKENS:
        raise ValueError(
            f"unknown datastore backend {name!r} in recipe {recipe!r}; known: {sorted(_TOKENS)}"
        )
    params: dict = {}
    for token in tokens:
        key, value = _read_token(name, token, recipe)
        if key in params:
            raise ValueError(f"recipe {recipe!r} sets {key} twice")
        if key != "dtype" and not value > 0:
            raise ValueError(f"recipe {recipe!r}: {key} must be positive, got {value}")
        params[key] = value
    if name == "flat":
        params.setdefault("dtype", "fp32")
    return name, params


def _read_token(name: str, token: str, recipe: str) -> tuple[str, Any]:
    for pattern, key, convert in _TOKENS[name]:
        match = pattern.fullmatch(token)
        if match:
            return key, convert(match.group(1))
    raise ValueError(
        f"cannot read {token!r} in recipe {recipe!r}: {name} recipes take {_TOKEN_HELP[name]}"
    )


def recipe_params(name: str, params: Mapping[str, Any]) -> dict:
    """The recipe's parameters among a datastore's `params` (None: unset, left out), in the
    recipe's order and as the recipe reads them (int, float or str): what a manifest records."""
    convert = {key: converter for _, key, converter in _TOKENS[name]}
    return {key: convert[key](params[key]) for key, _ in _FORMAT[name]
            if params.get(key) is not None}


def format_recipe(name: str, params: dict) -> str:
    """The canonical recipe string for (backend name, recipe params); inverse of parse_recipe."""
    parts = [name]
    for key, fmt in _FORMAT[name]:
        if params.get(key) is not None:
            parts.append(fmt.format(params[key]))
    return ":".join(parts)


_BACKEND_WORDS = {"flat": "flat keys (exact search)", "hnsw": "an HNSW graph index",
                  "protonn": "ProtoNN prototypes"}
_PARAM_WORDS = {"dtype": "keys stored as {}", "n": "n{0}: built from {0} of the client's samples",
                "M": "M{0}: {0} links per node", "ef": "ef{0}: search width {0}",
                "ef_construction": "efc{0}: construction width {0}",
                "d": "d{0}: keys projected to {0} dimensions",
                "m": "m{0:g}: prototypes {0:g} x the samples",
                "buffer": "b{0}: room for {0} samples added on the device",
                "inputs": "x{0}: keeps each sample's raw input ({0} bytes) to re-embed it "
                "when the model changes"}
# flat and HNSW keep the samples themselves: n is how many they may hold, not how many they do
# (`info` prints that count beside it); a ProtoNN datastore was trained on n of them
_STORED_N = "n{0}: holds at most {0} samples"


def describe_recipe(recipe: str) -> str:
    """A recipe in words, for a person reading `knnper-edge info`: "flat:fp32:n1944" ->
    "flat keys (exact search); keys stored as fp32; n1944: holds at most 1944 samples"."""
    name, params = parse_recipe(recipe)
    words = {**_PARAM_WORDS, **({"n": _STORED_N} if name != "protonn" else {})}
    return "; ".join([_BACKEND_WORDS[name], *(words[key].format(value)
                                               for key, value in params.items())])
