"""Datastore recipe strings ("flat:int8:n500", "hnsw:M16", "protonn:d32:m0.3") and back, read
from the tokens each registered backend class declares (`RECIPE_TOKENS`, `RECIPE_FORMAT`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .registry import BACKENDS, backend_class


def parse_recipe(recipe: str) -> tuple[str, dict]:
    """ "flat:int8:n500" -> ("flat", {"dtype": "int8", "n": 500}); ValueError on anything else.

    flat:fp32|fp16|int8[:n<count>][:x<input bytes>]
    hnsw[:M16][:ef64][:efc200][:n<count>][:x<input bytes>]
    protonn[:d<dim>][:m<fraction>][:n<count>][:b<buffer capacity>]
    """
    if not isinstance(recipe, str) or not recipe.strip():
        raise ValueError(f"a datastore recipe must be a non-empty string, got {recipe!r}")
    name, *tokens = recipe.strip().split(":")
    if name not in BACKENDS:
        raise ValueError(
            f"unknown datastore backend {name!r} in recipe {recipe!r}; known: {sorted(BACKENDS)}"
        )
    params: dict = {}
    for token in tokens:
        key, value = _read_token(name, token, recipe)
        if key in params:
            raise ValueError(f"recipe {recipe!r} sets {key} twice")
        if key != "dtype" and not value > 0:
            raise ValueError(f"recipe {recipe!r}: {key} must be positive, got {value}")
        params[key] = value
    for key, value in BACKENDS[name].RECIPE_DEFAULTS.items():
        params.setdefault(key, value)
    return name, params


def _read_token(name: str, token: str, recipe: str) -> tuple[str, Any]:
    cls = backend_class(name)
    for pattern, key, convert in cls.RECIPE_TOKENS:
        match = pattern.fullmatch(token)
        if match:
            return key, convert(match.group(1))
    raise ValueError(
        f"cannot read {token!r} in recipe {recipe!r}: {name} recipes take {cls.RECIPE_HELP}"
    )


def recipe_params(name: str, params: Mapping[str, Any]) -> dict:
    """The recipe's parameters among a datastore's `params` (None: unset, left out), in the
    recipe's order and as the recipe reads them (int, float or str): what a manifest records."""
    cls = backend_class(name)
    convert = {key: converter for _, key, converter in cls.RECIPE_TOKENS}
    return {
        key: convert[key](params[key])
        for key, _ in cls.RECIPE_FORMAT
        if params.get(key) is not None
    }


def format_recipe(name: str, params: dict) -> str:
    """The canonical recipe string for (backend name, recipe params); inverse of parse_recipe."""
    parts = [name]
    for key, fmt in backend_class(name).RECIPE_FORMAT:
        if params.get(key) is not None:
            parts.append(fmt.format(params[key]))
    return ":".join(parts)


def recipe_without(recipe: str, *keys: str) -> str:
    """The recipe with the parameters `keys` left out: "flat:int8:n500:x64" without "n" is
    "flat:int8:x64" (what a table groups chosen recipes by), without "inputs" "flat:int8:n500"
    (the same store without raw inputs)."""
    name, params = parse_recipe(recipe)
    return format_recipe(name, {key: value for key, value in params.items() if key not in keys})


def describe_recipe(recipe: str) -> str:
    """A recipe in words, for a person reading `knnper-edge info`: "flat:fp32:n1944" ->
    "flat keys (exact search); keys stored as fp32; n1944: holds at most 1944 samples"."""
    name, params = parse_recipe(recipe)
    cls = BACKENDS[name]
    return "; ".join(
        [cls.DESCRIPTION, *(cls.PARAM_WORDS[key].format(value) for key, value in params.items())]
    )
