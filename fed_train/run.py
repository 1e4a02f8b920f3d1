"""A run directory: its configuration, partition, checkpoints, metrics and final global model.
Training writes one; evaluation and export read it back with `load_run`."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edge_runtime._io import (
    JSONFileError,
    memory_limit,
    read_json,
    read_regular,
    remove_dead_writers_files,
    write_atomic,
    write_json_atomic,
)
from edge_runtime.errors import one_line
from edge_runtime.preprocess import prepare_input
from fed_train.algorithms import build_algorithm
from fed_train.algorithms.base import ClientData, Weights, get_weights, set_weights
from fed_train.data import Dataset, load_dataset
from fed_train.models import EmbedHeadModel, build_model, default_model
from fed_train.partition import Partition, make_partition
from fed_train.pretrain import Init, check_init_record, init_weights, load_init
from fed_train.run_config import RunConfig, RunError
from fed_train.simulation import SimulationResult, simulate
from fed_train.torch_files import load_tensors

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
PARTITION_FILE = "partition.npz"
MODEL_FILE = "model.pt"


@dataclass
class LoadedRun:
    """A finished run read back by `load_run`, with the pieces every later stage needs.

    Parameters
    ----------
    config : the run's settings, from its config.json.
    dataset : the data set as the run loaded it.
    partition : the clients' splits, from partition.npz.
    model : the trained global model (model.pt's weights).
    model_name : the model's name (`build_model`).
    run_dir : the run's folder.
    device : torch's device where `clients()` and `model_factory()` place work.
    """

    config: RunConfig
    dataset: Dataset
    partition: Partition
    model: EmbedHeadModel
    model_name: str
    run_dir: Path
    device: torch.device = torch.device("cpu")  # where clients() and model_factory() place work

    def clients(self) -> list[ClientData]:
        return prepare_clients(self.dataset, self.partition, self.device)

    def model_factory(self):
        return lambda: build_model(
            self.model_name, self.dataset.num_classes, self.dataset.input_spec
        ).to(self.device)


def prepare_clients(
    dataset: Dataset, partition: Partition, device: torch.device | str = "cpu"
) -> list[ClientData]:
    """Model-ready tensors per client, preprocessed once for the whole data set and placed on
    `device` once for the whole run."""
    x_train = torch.from_numpy(prepare_input(dataset.x_train, dataset.input_spec))
    x_test = torch.from_numpy(prepare_input(dataset.x_test, dataset.input_spec))
    y_train = torch.from_numpy(np.asarray(dataset.y_train, dtype=np.int64))
    y_test = torch.from_numpy(np.asarray(dataset.y_test, dtype=np.int64))
    out = []
    for cid, split in enumerate(partition.clients):
        tr, va, te = (
            torch.from_numpy(np.asarray(s, dtype=np.int64))
            for s in (split.train, split.val, split.test)
        )
        out.append(
            ClientData(
                cid,
                x_train[tr],
                y_train[tr],
                x_train[va],
                y_train[va],
                x_test[te],
                y_test[te],
                bool(partition.unseen[cid]),
            ).to(torch.device(device))
        )
    return out


def load_run_data(config: RunConfig) -> tuple[Dataset, Init | None]:
    """The run's data set and its --init. A pretrain directory's server split is removed from
    the training set here, before any partition is drawn or reloaded, so that train, bench,
    evaluate and export all give the clients the same samples and none of the server's."""
    if config.continue_from is not None:
        init = continued_init(config)
    else:
        init = load_init(config.init) if config.init is not None else None
    dataset = load_dataset(
        config.dataset,
        config.data,
        max_train=config.max_train,
        exclude_train=None if init is None else init.server_indices,
        seed=config.seed,
    )
    if init is not None:
        check_init_record(init, config.dataset, config.model or default_model(dataset.input_spec))
    return dataset, init


MAX_CONFIG_BYTES = 1 << 20


def server_split_source(config: RunConfig) -> str | None:
    """The pretrain directory whose server split this run leaves to the server: its --init, or
    that of the run it continues."""
    if config.continue_from is not None:
        return server_split_source(continued_config(Path(config.continue_from)))
    return config.init if config.init is not None and Path(config.init).is_dir() else None


def continued_init(config: RunConfig) -> Init:
    """The start of a run that continues another (`knnper train --continue-from RUN`): that
    run's final weights, and the server split of its pretraining, if any."""
    if config.init is not None:
        raise RunError(
            "--continue-from starts from that run's model; it cannot be combined with --init"
        )
    prior_dir = Path(config.continue_from)
    prior = continued_config(prior_dir)
    if prior.dataset != config.dataset:
        raise RunError(
            f"--continue-from {prior_dir} was trained on {prior.dataset}, this run "
            f"uses {config.dataset}"
        )
    if not (prior_dir / MODEL_FILE).is_file():
        raise RunError(
            f"--continue-from {prior_dir} is not a finished run: {MODEL_FILE} is missing"
        )
    weights = load_init(prior_dir / MODEL_FILE)
    source = server_split_source(prior)
    server = load_init(source) if source is not None else None
    return Init(
        weights.path,
        weights.state,
        weights.sha256,
        None if server is None else server.server_indices,
        None if server is None else server.record,
    )


def continued_config(prior_dir: Path) -> RunConfig:
    """The configuration of the run another continues; unreadable (deleted, say), the error
    names it as that run, not as a config.json the user never touched."""
    try:
        return RunConfig.from_dict(read_config(prior_dir))
    except RunError as err:
        raise RunError(f"the run this one continues (--continue-from {prior_dir}): {err}") from None


def read_config(run_dir: Path) -> dict:
    """config.json as a JSON object; RunError (one line) for anything else."""
    path = run_dir / CONFIG_FILE
    try:
        data = read_json(path, limit=MAX_CONFIG_BYTES, fix="restore it or train the run again")
    except (OSError, JSONFileError) as err:
        raise RunError(f"{path} is not readable JSON: {one_line(err)}") from None
    if not isinstance(data, dict):
        raise RunError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def load_partition(run_dir: Path, dataset: Dataset, clients: int) -> Partition:
    """partition.npz, checked against the data set it indexes and against config.json's client
    count (the data fingerprint covers the partition, not that field; an edit must not pass)."""
    partition = Partition.load(run_dir / PARTITION_FILE)
    partition.check(dataset)
    if partition.num_clients != clients:
        raise RunError(
            f"{run_dir / CONFIG_FILE} says 'clients' is {clients} but the run was "
            f"trained with {partition.num_clients} ({PARTITION_FILE}); restore the "
            "file or train the run again"
        )
    return partition


def data_fingerprint(dataset: Dataset, partition: Partition) -> str:
    """sha256 of what the clients are given: the data set's arrays as loaded (after --init's
    server split is removed and --max-train subsamples) and every client's indices. Later
    stages recompute it, so a changed server split, seed or data file cannot silently give
    them other client data."""
    h = hashlib.sha256()
    for array in (
        dataset.x_train,
        dataset.y_train,
        dataset.x_test,
        dataset.y_test,
        partition.unseen,
    ):
        h.update(str((array.dtype.str, array.shape)).encode())
        h.update(np.ascontiguousarray(array).data)
    for split in partition.clients:
        for part in (split.train, split.val, split.test):
            h.update(np.asarray(part, dtype=np.int64).tobytes() + b"|")
    return h.hexdigest()


def check_same_data(recorded: dict, dataset: Dataset, partition: Partition, run_dir: Path) -> None:
    """Refuse a run whose data no longer match the fingerprint it recorded (runs from before
    fingerprints recorded none and are not checked)."""
    expected = recorded.get("data_sha256")
    if expected is None:
        return
    if expected != data_fingerprint(dataset, partition):
        raise RunError(
            f"{run_dir}: the data this run was trained on have changed (the data "
            "file, --init's server split, the seed or the partition): its clients "
            "would get other samples; retrain it or restore them"
        )


def init_record(init: Init | None) -> dict[str, str]:
    """What config.json keeps of the init besides its path: the weights' sha256."""
    return {} if init is None else {"init_sha256": init.sha256}


def check_same_init(previous: dict, saved: dict, where: Path) -> None:
    """Resuming from other initial weights would mix two runs in one folder."""

    def where_from(record: dict) -> tuple[str | None, str | None]:
        path = record.get("init")  # a run from before absolute paths may hold a relative one
        return (
            path if not isinstance(path, str) else str(Path(path).resolve()),
            record.get("init_sha256"),
        )

    before, now = where_from(previous), where_from(saved)
    if before[0] == now[0] and before[1] != now[1]:
        raise RunError(
            f"--init {now[0]} has changed since {where} was started from it (sha256 "
            f"{before[1]} then, {now[1]} now)"
        )
    if before != now:
        raise RunError(
            f"{where} was started from --init {before[0]}, not {now[0]}; choose "
            "another --out or delete it"
        )


def run_partition(config: RunConfig, dataset: Dataset) -> Partition:
    """The run's partition: the same for every engine and for every node that holds the data."""
    return make_partition(
        dataset,
        config.partition,
        config.clients,
        alpha=config.alpha,
        beta=config.beta,
        classes_per_client=config.classes_per_client,
        val_fraction=config.val_fraction,
        unseen_fraction=config.unseen_fraction,
        seed=config.seed,
    )


def initial_weights(model_fn, seed: int, init: Init | None = None) -> Weights:
    """Where every method starts: the init's weights, or the seeded random initialisation."""
    torch.manual_seed(seed)
    model = model_fn()
    return get_weights(model) if init is None else init_weights(init, model)


@dataclass
class OpenRun:
    """A run directory ready to train into: its data, partition, model and starting weights."""

    dataset: Dataset
    partition: Partition
    model_name: str
    start: Weights

    def model_fn(self) -> EmbedHeadModel:
        return build_model(self.model_name, self.dataset.num_classes, self.dataset.input_spec)


def open_run(config: RunConfig, run_dir: Path) -> OpenRun:
    """Write config.json and partition.npz into a new run_dir, or check that run_dir holds this
    same run (then its partition is read back). `knnper train` and the Flower server both start
    here, so their run directories are interchangeable."""
    if (
        config.continue_from is not None
        and Path(config.continue_from).resolve() == run_dir.resolve()
    ):
        raise RunError(
            f"--continue-from {config.continue_from} is --out too: a continued run trains into "
            "a folder of its own; choose another --out"
        )
    dataset, init = load_run_data(config)
    model_name = config.model or default_model(dataset.input_spec)

    def model_fn() -> EmbedHeadModel:
        return build_model(model_name, dataset.num_classes, dataset.input_spec)

    start = initial_weights(model_fn, config.seed, init)  # checked before anything is written
    saved = {
        **config.to_dict(),
        "model_name": model_name,
        "num_classes": dataset.num_classes,
        "input_spec": dataset.input_spec,
        **init_record(init),
    }
    config_path = run_dir / CONFIG_FILE
    if config_path.exists():
        remove_dead_writers_files(run_dir)
        previous = read_config(run_dir)
        if previous.get("clients") != config.clients:  # a flag, not the file: say which
            raise RunError(
                f"{run_dir} holds a run of {previous.get('clients')} clients, not --clients "
                f"{config.clients}; choose another --out or delete it"
            )
        check_same_init(previous, saved, run_dir)
        if "init" in previous:  # the same file, perhaps recorded relative by an older version
            saved["init"] = previous["init"]
        partition = load_partition(run_dir, dataset, config.clients)
        check_same_data(previous, dataset, partition, run_dir)
        saved["data_sha256"] = previous.get("data_sha256")  # a run from before fingerprints
        if saved["data_sha256"] is None:
            del saved["data_sha256"]
        if previous != json.loads(json.dumps(saved)):
            raise RunError(
                f"{run_dir} holds a run with a different configuration; "
                "choose another --out or delete it"
            )
    else:
        partition = run_partition(config, dataset)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # --out is a file, or lies under one
            raise RunError(f"cannot make run directory {run_dir}: {err.strerror}") from None
        partition.save(run_dir / PARTITION_FILE)
        saved["data_sha256"] = data_fingerprint(dataset, partition)
        write_json_atomic(config_path, saved)
    return OpenRun(dataset, partition, model_name, start)


def save_model(run_dir: Path, model: EmbedHeadModel, weights: Weights) -> None:
    """The final global model, written under a unique temporary name and renamed."""
    set_weights(model, weights)
    state = model.state_dict()
    write_atomic(run_dir / MODEL_FILE, lambda f: torch.save(state, f))


def train(
    config: RunConfig,
    run_dir: Path,
    *,
    progress: bool = True,
    device: torch.device | str = "cpu",
    client_batch: int = 1,
) -> SimulationResult:
    """Train FedAvg's global model into run_dir, resuming if run_dir holds the same run. The
    checkpoints and model.pt hold CPU arrays whatever the device.

    Parameters
    ----------
    config : the data set, partition, model and training settings (`RunConfig`).
    run_dir : the run's folder: config.json, partition.npz, metrics.jsonl, checkpoints/,
        model.pt.
    progress : a bar on a terminal, a line every 30 s in a log.
    device : torch's device for training ("cpu", "cuda", ...).
    client_batch : clients stepped together on the device (fed_train.algorithms.stepping).
    """
    run_dir = Path(run_dir)
    run = open_run(config, run_dir)
    device = torch.device(device)
    clients = prepare_clients(run.dataset, run.partition, device)
    algorithm = build_algorithm("fedavg", lambda: run.model_fn().to(device), config.training)
    result = simulate(
        algorithm,
        clients,
        config.training,
        run.start,
        seed=config.seed,
        run_dir=run_dir,
        checkpoint_every=config.checkpoint_every,
        progress=progress,
        client_batch=client_batch,
    )
    save_model(run_dir, run.model_fn(), result.weights)
    return result


def load_run(run_dir: str | Path, device: torch.device | str = "cpu") -> LoadedRun:
    """A finished run, its model loaded on the CPU and then moved to `device`.

    Parameters
    ----------
    run_dir : a folder `train` wrote.
    device : torch's device the model is moved to.
    """
    run_dir = Path(run_dir)
    for name in (CONFIG_FILE, PARTITION_FILE, MODEL_FILE):
        if not (run_dir / name).is_file():
            raise RunError(
                f"{run_dir} is not a finished run: {name} is missing "
                "(train it with `knnper train ... --out RUN`)"
            )
    raw = read_config(run_dir)
    config = RunConfig.from_dict(raw)
    dataset, init = load_run_data(config)
    check_same_init(raw, {"init": config.init, **init_record(init)}, run_dir)
    partition = load_partition(run_dir, dataset, config.clients)
    check_same_data(raw, dataset, partition, run_dir)
    model_name = raw.get("model_name") or default_model(dataset.input_spec)
    if not isinstance(model_name, str):
        raise RunError(f"{run_dir / CONFIG_FILE}: 'model_name' must be a string")
    model = build_model(model_name, dataset.num_classes, dataset.input_spec)
    try:
        raw = read_regular(run_dir / MODEL_FILE, memory_limit())
        if raw is None:
            raise ValueError("it is larger than half of this machine's memory")
        model.load_state_dict(load_tensors(raw, memory_limit()))
    except Exception as err:  # torch raises several types for a corrupt or mismatched file
        reason = one_line(err, first_line=True)
        raise RunError(f"{run_dir / MODEL_FILE} cannot be loaded: {reason}") from err
    if not all(
        torch.isfinite(t).all() for t in model.state_dict().values() if t.is_floating_point()
    ):
        raise RunError(f"{run_dir / MODEL_FILE} holds NaN or infinite weights")
    device = torch.device(device)
    model.to(device).eval()
    return LoadedRun(config, dataset, partition, model, model_name, run_dir, device)
