"""What crosses the wire between ServerApp and ClientApp, as Flower records: model weights and a
client's sums as ArrayRecords, a client's state split into arrays (kept on its SuperNode) and
scalars (also sent to the server, whose aggregation may need them: ClusteredFL's cluster index),
what a personalization chose as a ConfigRecord, kNN-Per's grid points as a ConfigRecord of
columns. Whatever a client sends is read back with its shape, dtype and size checked."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from io import BytesIO
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.app.typing import ConfigRecordValues
from flwr.common.constant import SType
from numpy.lib import format as npy

from edge_runtime.errors import one_line
from edge_runtime.knn import LambdaRule
from fed_train.algorithms.base import Weights, get_weights
from fed_train.knn_setting import KNNChoice, KNNConfig
from fed_train.models import ModelFactory, build_model

STATE_ARRAYS, STATE_SCALARS = "knnper-state-arrays", "knnper-state-scalars"
_SEP = "/"  # weight names use dots; lambda keys such as "10.0" too


def to_array_record(weights: Weights) -> ArrayRecord:
    return ArrayRecord({name: Array(np.asarray(w, order="C")) for name, w in weights.items()})


def decode(name: str, array: Array) -> np.ndarray:
    """The ndarray an Array carries, refused (ValueError) unless its .npy header agrees with the
    Array's declared dtype and shape and the payload holds exactly that many bytes: np.load
    allocates what the header claims, so a header is read before anything is allocated."""
    stream = BytesIO(array.data)
    try:
        version = npy.read_magic(stream)
        read_header = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}[
            version
        ]
        shape, _, dtype = read_header(stream)
    except (EOFError, KeyError, ValueError) as err:
        raise ValueError(f"{name} is not an .npy payload ({err})") from None
    payload = len(array.data) - stream.tell()
    if (
        array.stype != SType.NUMPY
        or str(dtype) != array.dtype
        or shape != tuple(array.shape)
        or payload != dtype.itemsize * math.prod(shape)
    ):
        raise ValueError(
            f"{name} declares {array.dtype} {tuple(array.shape)} but carries "
            f"{payload} bytes of {dtype} {shape}"
        )
    return array.numpy()


def to_weights(record: ArrayRecord) -> Weights:
    return {name: decode(name, array) for name, array in record.items()}


def counts_record(phase: str, counts: np.ndarray) -> ArrayRecord:
    """A client's sums for one phase of the kNN-Per choice, named by the phase it answers."""
    return ArrayRecord({phase: Array(np.asarray(counts, dtype=np.float64, order="C"))})


def read_counts(record: ArrayRecord, phase: str, shape: tuple[int, ...]) -> np.ndarray:
    """A client's sums (samples right, summed log-loss, samples, ...), refused unless they are
    float64 of exactly `shape`, finite and non-negative: the server pools only what an honest
    client can have computed. Declared dtype and shape are checked before decoding."""
    if phase not in record:
        raise ValueError(f"no sums for {phase} (sent: {sorted(record)[:3]})")
    array = record[phase]
    if array.dtype != "float64" or tuple(array.shape) != shape:
        raise ValueError(
            f"{phase} sums are {array.dtype} {tuple(array.shape)}, not float64 {shape}"
        )
    counts = decode(phase, array)
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise ValueError(f"{phase} sums are not all finite and non-negative")
    return counts


def points_record(points: Sequence[KNNConfig]) -> ConfigRecord:
    """kNN-Per's grid points as columns (one typed list per field) in grid order."""
    rows = [point.to_dict() for point in points]
    return ConfigRecord({field: [row[field] for row in rows] for field in rows[0]})


def points_from_record(record: ConfigRecord) -> list[KNNConfig]:
    return [
        KNNConfig(**dict(zip(record, values, strict=True)))
        for values in zip(*record.values(), strict=True)
    ]


def knn_choice_record(choice: KNNChoice) -> ConfigRecord:
    """kNN-Per's setting as Flower's named scalars ("knn-k", "knn-sigma", ...; the lambda
    rule's pooled evidence one flat list, three numbers per grid value); `knn_choice_from`
    reads it back."""
    rule = choice.lambda_rule
    values = {
        "k": int(choice.config.k),
        "sigma": float(choice.config.sigma),
        "normalize": choice.config.normalize,
        "lambda-estimator": choice.lambda_estimator,
        "base": choice.base,
        "l2": [] if choice.l2 is None else float(choice.l2),  # a ConfigRecord holds no None
        "lambda-rule": rule.name,
        "lambda-pooled": [float(v) for row in rule.pooled for v in row],
        "lambda-prior-samples": float(rule.prior_samples),
        "lambda-grid": [float(v) for v in rule.grid],
    }
    return ConfigRecord({f"knn-{name}": value for name, value in values.items()})


def knn_choice_from(config: ConfigRecord) -> KNNChoice | None:
    """The setting `knn_choice_record` put into `config` (None where it holds none), checked
    as any `KNNChoice` is; ValueError (one line) where a value is missing or wrong."""
    if "knn-k" not in config:
        return None
    try:
        rule = LambdaRule(
            str(config["knn-lambda-rule"]),
            tuple(map(tuple, np.asarray(config["knn-lambda-pooled"], float).reshape(-1, 3))),
            float(config["knn-lambda-prior-samples"]),
            tuple(float(v) for v in config["knn-lambda-grid"]),
        )
        return KNNChoice(
            KNNConfig(config["knn-k"], config["knn-sigma"], str(config["knn-normalize"])),
            str(config["knn-lambda-estimator"]),
            lambda_rule=rule,
            base=str(config["knn-base"]),
            l2=_plain_value(config["knn-l2"]),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"the server's kNN-Per setting: {one_line(err)}") from None


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


def _config_value(name: str, value: Any) -> ConfigRecordValues:
    """A scalar as a ConfigRecord value. A ConfigRecord holds no None: an empty list stands for
    it (no value sent this way is a list)."""
    if value is None:
        return []
    if isinstance(value, (bool, int, float, str, np.integer, np.floating)):
        return value.item() if isinstance(value, np.generic) else value
    raise TypeError(
        f"entry {name!r} is a {type(value).__name__}; only arrays and scalars "
        "travel between ServerApp and ClientApp"
    )


def _plain_value(value: ConfigRecordValues) -> Any:
    return None if value == [] else value


def to_config_record(values: dict[str, Any]) -> ConfigRecord:
    """Nested scalars (None included) as one flat ConfigRecord; from_config_record reverses it."""
    return ConfigRecord({name: _config_value(name, v) for name, v in _flatten(values).items()})


def from_config_record(record: ConfigRecord) -> dict[str, Any]:
    return _nest({name: _plain_value(v) for name, v in record.items()})


def split_state(state: dict[str, Any]) -> tuple[ArrayRecord, ConfigRecord]:
    """A client's state as (arrays, scalars); None, bools, ints, floats and strings are
    scalars."""
    arrays, scalars = ArrayRecord(), ConfigRecord()
    for name, value in _flatten(state).items():
        if isinstance(value, np.ndarray):
            arrays[name] = Array(np.asarray(value, order="C"))
        else:
            scalars[name] = _config_value(name, value)
    return arrays, scalars


def join_state(arrays: ArrayRecord | None, scalars: ConfigRecord | None) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    if arrays is not None:
        flat.update({name: a.numpy() for name, a in arrays.items()})
    if scalars is not None:
        flat.update({name: _plain_value(v) for name, v in scalars.items()})
    return _nest(flat)


def load_state(store: RecordDict) -> dict[str, Any]:
    """The state this SuperNode kept for its client in earlier rounds of the run."""
    arrays = store.get(STATE_ARRAYS)
    scalars = store.get(STATE_SCALARS)
    return join_state(
        arrays if isinstance(arrays, ArrayRecord) else None,
        scalars if isinstance(scalars, ConfigRecord) else None,
    )


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
        return ConfigRecord(
            {
                "name": self.name,
                "num-classes": self.num_classes,
                "input-spec": json.dumps(self.input_spec),
            }
        )

    @classmethod
    def from_record(cls, record: ConfigRecord) -> ModelSpec:
        return cls(
            str(record["name"]), int(record["num-classes"]), json.loads(str(record["input-spec"]))
        )

    def model_fn(self) -> ModelFactory:
        return lambda: build_model(self.name, self.num_classes, self.input_spec).to(self.device)

    def shapes(self) -> Weights:
        """A freshly built model's weights: what received weights are checked against."""
        return get_weights(self.model_fn()())


def check_shapes(received: Weights, model: Weights, *, sender: str) -> None:
    """Refuse weights whose shapes or dtypes differ from this side's model before torch sees
    them. A name may carry a prefix ("cluster1/conv1.weight": ClusteredFL packs one model per
    cluster); the part after the last "/" is the model's parameter name."""
    matched = 0
    for name, value in received.items():
        base = name.rsplit(_SEP, 1)[-1]
        if base not in model:
            continue
        matched += 1
        if tuple(value.shape) != tuple(model[base].shape):
            raise ValueError(
                f"{sender} sent {name} with shape {tuple(value.shape)}, but this "
                f"side's model has {tuple(model[base].shape)}: the server and the "
                "client build different models"
            )
        if value.dtype != model[base].dtype:
            raise ValueError(
                f"{sender} sent {name} as {value.dtype}, but this side's model "
                f"holds {model[base].dtype}"
            )
    if received and not matched:
        raise ValueError(
            f"{sender} sent weights named {sorted(received)[:3]}..., none of them "
            "a parameter of this side's model"
        )
