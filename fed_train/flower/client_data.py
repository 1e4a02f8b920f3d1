"""The one client a SuperNode serves, from its node config: `partition-id` (and
`num-partitions`) picks a client of the run's partition, drawn from the data set on this node
exactly as `knnper train` draws it; `data-dir` instead reads this device's own split files
(train.npz, val.npz, test.npz with x and y, as `knnper` writes them for the device commands)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

from edge_runtime._io import load_arrays, memory_limit
from edge_runtime.preprocess import prepare_input
from edge_runtime.values import is_integer
from fed_train.algorithms.base import ClientData
from fed_train.flower.settings import FlowerConfigError
from fed_train.run import RunConfig, load_run_data, run_partition

SPLIT_FILES = ("train", "val", "test")
DATA_KEY = "knnper-client-data"  # this client's raw splits in the node's Context.state
MAX_SPLIT_BYTES = 2 << 30  # a device's split larger than 2 GiB is a mistake, not data


def node_partition_id(node_config: dict[str, Any], clients: int) -> int:
    """This node's client id, checked against the run's number of clients."""
    if "partition-id" not in node_config:
        raise FlowerConfigError(
            "node config has no 'partition-id' (start the SuperNode with "
            "--node-config 'partition-id=N num-partitions=M')"
        )
    pid = node_config["partition-id"]
    if not is_integer(pid):
        raise FlowerConfigError(f"node config 'partition-id' must be an integer, got {pid!r}")
    num = node_config.get("num-partitions", clients)
    if num != clients:
        raise FlowerConfigError(
            f"node config 'num-partitions' is {num!r} but the run has {clients} clients"
        )
    if not 0 <= pid < clients:
        raise FlowerConfigError(
            f"node config 'partition-id' {pid} is out of range: the run has "
            f"clients 0 to {clients - 1}"
        )
    return pid


def _read_split(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise FlowerConfigError(f"missing data file {path}")
    if path.stat().st_size > MAX_SPLIT_BYTES:
        raise FlowerConfigError(f"{path} is larger than {MAX_SPLIT_BYTES} bytes")
    try:
        with load_arrays(path, memory_limit(), "arrays") as archive:
            x, y = archive["x"], archive["y"]
    except (OSError, ValueError, KeyError) as err:
        raise FlowerConfigError(f"{path} is not an npz with arrays x and y: {err}") from err
    if y.ndim != 1 or len(x) != len(y) or not np.issubdtype(y.dtype, np.integer):
        raise FlowerConfigError(
            f"{path}: x has {len(x)} rows and y shape {y.shape} "
            f"({y.dtype}); y must be one integer label per row of x"
        )
    return x, y.astype(np.int64)


def _client(
    client_id: int,
    splits: dict[str, tuple[np.ndarray, np.ndarray]],
    input_spec: dict,
    num_classes: int,
) -> ClientData:
    tensors = []
    for name in SPLIT_FILES:
        x, y = splits[name]
        if len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise FlowerConfigError(
                f"{name} labels must lie in 0..{num_classes - 1}, found {y.min()}..{y.max()}"
            )
        try:
            tensors += [torch.from_numpy(prepare_input(x, input_spec)), torch.from_numpy(y)]
        except ValueError as err:
            raise FlowerConfigError(f"{name} inputs do not fit the model: {err}") from err
    return ClientData(client_id, *tensors)


def load_node_client(
    config: RunConfig,
    node_config: dict[str, Any],
    input_spec: dict,
    num_classes: int,
    store: RecordDict | None = None,
) -> ClientData:
    """This node's client, or a one-line FlowerConfigError naming what is wrong. With `store`
    (the node's Context.state, kept between the messages of a run) the raw splits are read
    once per run: later messages skip loading the data set and drawing the partition."""
    client_id = node_partition_id(node_config, config.clients)
    splits = node_splits(config, node_config, input_spec, num_classes, store)
    return _client(client_id, splits, input_spec, num_classes)


def node_splits(
    config: RunConfig,
    node_config: dict[str, Any],
    input_spec: dict,
    num_classes: int,
    store: RecordDict | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """This node's raw splits (name -> (x, y), inputs as the data set stores them), kept in
    `store` (see load_node_client): what the device runtime builds and teaches a bundle from."""
    client_id = node_partition_id(node_config, config.clients)
    cached = store.get(DATA_KEY) if store is not None else None
    if isinstance(cached, ArrayRecord):
        return {
            name: (cached[f"{name}-x"].numpy(), cached[f"{name}-y"].numpy()) for name in SPLIT_FILES
        }
    splits = _node_splits(client_id, config, node_config, input_spec, num_classes)
    if store is not None:
        store[DATA_KEY] = ArrayRecord(
            {
                f"{name}-{part}": Array(np.ascontiguousarray(a))
                for name, xy in splits.items()
                for part, a in zip("xy", xy, strict=True)
            }
        )
    return splits


def _node_splits(
    client_id: int,
    config: RunConfig,
    node_config: dict[str, Any],
    input_spec: dict,
    num_classes: int,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    if "data-dir" in node_config:
        root = Path(str(node_config["data-dir"])).expanduser()
        if not root.is_dir():
            raise FlowerConfigError(f"node config 'data-dir' {root} is not a directory")
        return {name: _read_split(root / f"{name}.npz") for name in SPLIT_FILES}
    dataset, _ = load_run_data(config)
    local_spec = json.loads(json.dumps(dataset.input_spec))
    if dataset.num_classes != num_classes or local_spec != input_spec:
        raise FlowerConfigError(
            f"this node's {config.dataset} data ({dataset.num_classes} classes, input "
            f"{local_spec}) does not match the server's model ({num_classes} classes, "
            f"input {input_spec})"
        )
    split = run_partition(config, dataset).clients[client_id]
    splits = {
        "train": (dataset.x_train[split.train], dataset.y_train[split.train]),
        "val": (dataset.x_train[split.val], dataset.y_train[split.val]),
        "test": (dataset.x_test[split.test], dataset.y_test[split.test]),
    }
    return {k: (x, np.asarray(y, np.int64)) for k, (x, y) in splits.items()}
