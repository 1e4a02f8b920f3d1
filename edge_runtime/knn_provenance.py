"""Where a bundle's kNN setting came from: a manifest's "knn_choice" record, which says of k,
sigma, the normalisation and the lambda estimator (and, from newer exporters, the lambda rule,
what the kNN is interpolated with and the head's l2) whether validation, a flag or the paper's
default chose it. A device reads the base and the l2 it refits its head with from here."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .knn import KNN_BASES, LAMBDA_RULES
from .values import is_real

KNN_CHOICE_KEYS = ("k", "sigma", "normalize", "lambda_estimator")
# recorded by newer exporters: how lambda pools evidence, what the kNN is interpolated with
KNN_CHOICE_OPTIONAL = ("lambda_rule", "base", "l2")
KNN_CHOICE_SOURCES = ("validation", "flag", "paper default")


class Chosen(NamedTuple):
    """One value of the setting and where it came from (one of KNN_CHOICE_SOURCES)."""

    value: str | int | float
    source: str


@dataclass(frozen=True)
class KNNProvenance:
    """A "knn_choice" record, checked when built (ValueError, one line, for anything else):
    each value as a `Chosen`, None where an older exporter recorded none; `json`, the object
    as given, is what `to_json` writes back, in the same bytes."""

    json: dict[str, Any]
    k: Chosen = field(init=False)
    sigma: Chosen = field(init=False)
    normalize: Chosen = field(init=False)
    lambda_estimator: Chosen = field(init=False)
    lambda_rule: Chosen | None = field(init=False)
    base: Chosen | None = field(init=False)
    l2: Chosen | None = field(init=False)

    def __post_init__(self) -> None:
        record = _checked(self.json)
        object.__setattr__(self, "json", copy.deepcopy(dict(record)))
        for key in (*KNN_CHOICE_KEYS, *KNN_CHOICE_OPTIONAL):
            entry = record.get(key)
            chosen = None if entry is None else Chosen(entry["value"], entry["source"])
            object.__setattr__(self, key, chosen)

    def to_json(self) -> dict[str, Any]:
        """A copy of the object to write (a manifest's "knn_choice")."""
        return copy.deepcopy(self.json)


def _checked(record: Any) -> Mapping[str, Any]:
    if not isinstance(record, Mapping) or sorted(set(record) - set(KNN_CHOICE_OPTIONAL)) != sorted(
        KNN_CHOICE_KEYS
    ):
        raise ValueError(
            f"'knn_choice' must be an object with keys {list(KNN_CHOICE_KEYS)} "
            f"(and, from bundles that record them, {list(KNN_CHOICE_OPTIONAL)})"
        )
    for key, entry in record.items():
        if (
            not isinstance(entry, Mapping)
            or sorted(entry) != ["source", "value"]
            or entry["source"] not in KNN_CHOICE_SOURCES
            or not isinstance(entry["value"], (str, int, float))
            or isinstance(entry["value"], bool)
        ):
            raise ValueError(
                f"'knn_choice' {key!r} must be {{value, source}} with source one of "
                f"{list(KNN_CHOICE_SOURCES)}"
            )
    if "lambda_rule" in record and record["lambda_rule"]["value"] not in LAMBDA_RULES:
        raise ValueError(f"'knn_choice' 'lambda_rule' must be one of {list(LAMBDA_RULES)}")
    if "base" in record and record["base"]["value"] not in KNN_BASES:
        raise ValueError(f"'knn_choice' 'base' must be one of {list(KNN_BASES)}")
    base = record["base"]["value"] if "base" in record else None
    l2 = record["l2"]["value"] if "l2" in record else None
    if "l2" in record and (not is_real(l2, finite=True) or l2 <= 0 or base != "linear"):
        raise ValueError(
            "'knn_choice' 'l2' must be a positive number, recorded with the linear base"
        )
    return record
