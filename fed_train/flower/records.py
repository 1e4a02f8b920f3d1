"""What crosses the wire between ServerApp and ClientApp, as Flower records: model weights as an
ArrayRecord, a client's state split into arrays (kept on its SuperNode) and scalars (also sent to
the server, whose aggregation may need them: ClusteredFL's cluster index)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fed_train.algorithms.base import Weights, get_weights
from fed_train.models import EmbedHeadModel, build_model

STATE_ARRAYS, STATE_SCALARS = "knnper-state-arrays", "knnper-state-scalars"
_SEP = "/"  # weight names use dots; lambda keys such as "10.0" too


def to_array_record(weights: Weights) -> ArrayRecord:
    return ArrayRecord({name: Array(np.asarray(w, order="C")) for name, w in weights.items()})


def to_weights(record: ArrayRecord) -> Weights:
    return {name: array.numpy() for name, array in record.items()}


def _flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if _SEP in str(key):
            raise ValueError(f"client state key {key!r} may not contain {_SEP!r}")
        if isinstance(value, dict):
            flat.update(_flatten(value, name + _SEP))
        else:
            flat[name] = value
    return flat


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split(_SEP)
        node = state
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return state


def split_state(state: dict[str, Any]) -> tuple[ArrayRecord, ConfigRecord]:
    """A client's state as (arrays, scalars); bools, ints, floats and strings are scalars."""
    arrays, scalars = ArrayRecord(), ConfigRecord()
    for name, value in _flatten(state).items():
        if isinstance(value, np.ndarray):
            arrays[name] = Array(np.asarray(value, order="C"))
        elif isinstance(value, (bool, int, float, str, np.integer, np.floating)):
            scalars[name] = value.item() if isinstance(value, np.generic) else value
        else:
            raise TypeError(f"client state entry {name!r} is a {type(value).__name__}; only "
                            "arrays and scalars can be kept between rounds")
    return arrays, scalars


def join_state(arrays: ArrayRecord | None, scalars: ConfigRecord | None) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    if arrays is not None:
        flat.update({name: a.numpy() for name, a in arrays.items()})
    if scalars is not None:
        flat.update(scalars)
    return _nest(flat)


def load_state(store: RecordDict) -> dict[str, Any]:
    """The state this SuperNode kept for its client in earlier rounds of the run."""
    arrays = store.get(STATE_ARRAYS)
    scalars = store.get(STATE_SCALARS)
    return join_state(arrays if isinstance(arrays, ArrayRecord) else None,
                      scalars if isinstance(scalars, ConfigRecord) else None)


def save_state(store: RecordDict, state: dict[str, Any]) -> ConfigRecord:
    """Keep the state on the node; return its scalars for the reply."""
    arrays, scalars = split_state(state)
    store[STATE_ARRAYS] = arrays
    store[STATE_SCALARS] = scalars
    return scalars


@dataclass(frozen=True)
class ModelSpec:
    """Which model the server trains, so a client builds the same one (and can say when its
    data does not fit it)."""

    name: str
    num_classes: int
    input_spec: dict
    device: str = "cpu"  # where model_fn places the model; not sent

    def on(self, device: torch.device | str) -> ModelSpec:
        return replace(self, device=str(device))

    def to_record(self) -> ConfigRecord:
        return ConfigRecord({"name": self.name, "num-classes": self.num_classes,
                             "input-spec": json.dumps(self.input_spec)})

    @classmethod
    def from_record(cls, record: ConfigRecord) -> ModelSpec:
        return cls(str(record["name"]), int(record["num-classes"]),
                   json.loads(str(record["input-spec"])))

    def model_fn(self) -> Callable[[], EmbedHeadModel]:
        return lambda: build_model(self.name, self.num_classes, self.input_spec).to(self.device)

    def shapes(self) -> Weights:
        """A freshly built model's weights: what received weights are checked against."""
        return get_weights(self.model_fn()())


def check_shapes(received: Weights, model: Weights, *, sender: str) -> None:
    """Refuse weights whose shapes differ from this side's model before torch sees them. A name
    may carry a prefix ("cluster1/conv1.weight": ClusteredFL packs one model per cluster); the
    part after the last "/" is the model's parameter name."""
    matched = 0
    for name, value in received.items():
        base = name.rsplit(_SEP, 1)[-1]
        if base not in model:
            continue
        matched += 1
        if tuple(value.shape) != tuple(model[base].shape):
            raise ValueError(f"{sender} sent {name} with shape {tuple(value.shape)}, but this "
                             f"side's model has {tuple(model[base].shape)}: the server and the "
                             "client build different models")
    if received and not matched:
        raise ValueError(f"{sender} sent weights named {sorted(received)[:3]}..., none of them "
                         "a parameter of this side's model")
