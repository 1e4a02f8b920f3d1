"""Central pretraining on a server-held split that no client ever sees, the stand-in for the
official kNN-Per code's ImageNet-pretrained MobileNet, so that every method can start from the
same strong weights; and `load_init`, which reads such a directory (or any `.pt` state dict)
back for `--init` as a hostile file: bounded in size, loaded without code execution, and checked
key by key against the model before any weight is used."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_runtime._io import array_file_bytes, parse_json, read_within, write_atomic
from edge_runtime.arg_types import SEED_MAX
from edge_runtime.errors import one_line
from edge_runtime.preprocess import prepare_input
from fed_train.algorithms.base import TrainingConfig, Weights, get_weights, local_sgd, predict_proba
from fed_train.data import Dataset, load_dataset, stratified_subsample
from fed_train.errors import KnnperError
from fed_train.models import EmbedHeadModel, build_model, default_model
from fed_train.progress import Progress
from fed_train.run_config import PretrainConfig
from fed_train.simulation import client_seed
from fed_train.torch_files import load_tensors

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.pt"
RECORD_FILE = "pretrain.json"
SERVER_INDICES_FILE = "server_indices.npy"
MAX_WEIGHTS_BYTES = 1 << 30  # MobileNet-v2 is about 9 MB; anything near this is not a model
MAX_RECORD_BYTES = 1 << 20
MAX_INDICES_BYTES = 1 << 28
SERVER_STREAM = 0x5E4  # the server split's own random stream, apart from max_train's subsample


class InitError(KnnperError, ValueError):
    """Initial weights that cannot be used: unreadable, not a state dict, or not this model's."""


def server_split(
    y: np.ndarray, fraction: float, seed: int, max_train: int | None = None
) -> np.ndarray:
    """Sorted indices of a stratified `fraction` of the training set (of `max_train` samples when
    given, as `train --max-train` would see it), drawn before any client partition exists."""
    if not 0 < fraction < 1:
        raise InitError(f"server fraction must be in (0, 1), got {fraction}")
    pool = len(y) if max_train is None else min(len(y), max_train)
    size = max(1, int(math.floor(fraction * pool + 0.5)))
    return stratified_subsample(y, size, np.random.default_rng([seed, SERVER_STREAM]))


def _split_validation(y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions of a stratified held-out slice (at least one sample) and of the rest."""
    size = min(len(y) - 1, max(1, int(math.floor(fraction * len(y) + 0.5))))
    if size < 1:
        raise InitError(f"pretraining needs at least 2 samples, got {len(y)}")
    val = stratified_subsample(y, size, np.random.default_rng([seed, SERVER_STREAM, 1]))
    return np.setdiff1d(np.arange(len(y)), val), val


def augment_images(x: torch.Tensor, rng: np.random.Generator, shift: int = 4) -> torch.Tensor:
    """Each NCHW image flipped left-right with probability 1/2, then cropped back to its size
    from a zero-padded copy at a random offset of up to `shift` pixels."""
    n, channels, height, width = x.shape
    flip = torch.from_numpy(rng.random(n) < 0.5).to(x.device)
    x = torch.where(flip[:, None, None, None], x.flip(3), x)
    padded = torch.nn.functional.pad(x, (shift, shift, shift, shift))
    rows = torch.from_numpy(rng.integers(0, 2 * shift + 1, n))[:, None] + torch.arange(height)
    cols = torch.from_numpy(rng.integers(0, 2 * shift + 1, n))[:, None] + torch.arange(width)
    return padded[
        torch.arange(n)[:, None, None, None],
        torch.arange(channels)[None, :, None, None],
        rows[:, None, :, None],
        cols[:, None, None, :],
    ]


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: np.ndarray) -> float:
    return float((predict_proba(model, x).argmax(1) == y).mean())


def _pretraining_data(config: PretrainConfig) -> tuple[Dataset, Dataset, np.ndarray]:
    """The run's data set (its classes and input spec), the data trained on, and the training
    indices the clients lose (none with public data)."""
    target = load_dataset(config.dataset, config.data, seed=config.seed)
    if config.public_data is None:
        server = server_split(target.y_train, config.server_fraction, config.seed, config.max_train)
        source = copy.copy(target)
        source.x_train, source.y_train = target.x_train[server], target.y_train[server]
        return target, source, server
    public = load_dataset("npz", config.public_data, max_train=config.max_train, seed=config.seed)
    if public.x_train.shape[1:] != target.x_train.shape[1:]:
        raise InitError(
            f"--public-data {config.public_data}: inputs of shape "
            f"{list(public.x_train.shape[1:])}, but {config.dataset} has "
            f"{list(target.x_train.shape[1:])}"
        )
    if public.y_train.max() >= target.num_classes:
        raise InitError(
            f"--public-data {config.public_data}: label {public.y_train.max()} is "
            f"out of range for the {target.num_classes} classes of {config.dataset}"
        )
    return target, public, np.zeros(0, dtype=np.int64)


def pretrain(
    config: PretrainConfig,
    out: str | Path,
    *,
    progress: bool = True,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Train the model centrally on `device`, keep the epoch with the best held-out accuracy,
    and write OUT/model.pt (CPU tensors), OUT/server_indices.npy and OUT/pretrain.json (written
    last: it marks a finished pretraining). Returns the record. One model, no clients: there is
    nothing here to step together."""
    out = Path(out)
    if (out / RECORD_FILE).exists():
        raise InitError(f"{out} already holds a pretraining; choose another --out or delete it")
    if config.weights_seed is not None and (
        isinstance(config.weights_seed, bool)
        or not isinstance(config.weights_seed, int)
        or not 0 <= config.weights_seed <= SEED_MAX
    ):
        raise InitError(
            f"--weights-seed must be an integer in 0 .. {SEED_MAX}, got {config.weights_seed!r}"
        )
    target, source, server = _pretraining_data(config)
    model_name = config.model or default_model(target.input_spec)
    if config.augment and target.input_spec["kind"] != "image":
        raise InitError(
            f"--augment crops and flips images; {config.dataset} holds {target.input_spec['kind']}"
        )
    torch.manual_seed(config.training_seed())
    device = torch.device(device)
    model = build_model(model_name, target.num_classes, target.input_spec).to(device)
    # the run's normalisation, so the weights see the inputs they will see in federated training
    x = torch.from_numpy(prepare_input(source.x_train, target.input_spec)).to(device)
    y = np.asarray(source.y_train, dtype=np.int64)
    fit, val = _split_validation(y, config.val_fraction, config.seed)
    best_state, best_epoch, best_acc, history = _best_epoch(model, x, y, fit, val, config, progress)
    record = {
        **asdict(config),
        "model": model_name,
        "num_classes": target.num_classes,
        "train_size": len(target.y_train),
        "server_samples": int(len(server)),
        "samples": {"train": int(len(fit)), "val": int(len(val))},
        "best_epoch": best_epoch,
        "epochs_run": len(history),
        "val_accuracy": best_acc,
        "history": history,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / SERVER_INDICES_FILE, lambda f: np.save(f, server.astype(np.int64)))
    write_atomic(out / WEIGHTS_FILE, lambda f: torch.save(best_state, f))
    write_atomic(out / RECORD_FILE, lambda f: f.write(json.dumps(record, indent=2).encode()))
    return record


def _best_epoch(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: np.ndarray,
    fit: np.ndarray,
    val: np.ndarray,
    config: PretrainConfig,
    progress: bool,
) -> tuple[dict[str, torch.Tensor], int, float, list[dict[str, float]]]:
    """Up to `config.epochs` epochs on the `fit` samples, stopped after `patience` epochs
    without a better accuracy on the `val` ones: the best epoch's weights (on the CPU), that
    epoch, its accuracy, and every epoch's loss and accuracy."""
    x_fit, y_fit = x[fit], torch.from_numpy(y[fit]).to(x.device)
    training = TrainingConfig(
        batch_size=config.batch_size,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        precision=config.precision,
    )
    history: list[dict[str, float]] = []
    best_state, best_epoch, best_acc = _cpu_state(model), 0, -1.0
    epochs = Progress(config.epochs, desc="pretrain", unit="epoch", enabled=progress)
    for epoch in range(1, config.epochs + 1):
        seed = client_seed(config.training_seed(), epoch, 0)
        x_epoch = (
            augment_images(
                x_fit, np.random.default_rng(client_seed(config.training_seed(), epoch, 1))
            )
            if config.augment
            else x_fit
        )
        loss = local_sgd(model, x_epoch, y_fit, training, config.lr, seed=seed, epochs=1)
        acc = _accuracy(model, x[val], y[val])
        history.append({"epoch": epoch, "train_loss": round(loss, 6), "val_accuracy": acc})
        epochs.set_postfix(f"epoch {epoch}: loss {loss:.3f}, val {acc:.1%}")
        epochs.update()
        if acc > best_acc:
            best_state, best_epoch, best_acc = _cpu_state(model), epoch, acc
        elif epoch - best_epoch >= config.patience:
            log.info(
                "no better validation accuracy for %d epochs: stopping at epoch %d",
                config.patience,
                epoch,
            )
            break
    epochs.close()
    return best_state, best_epoch, best_acc, history


def _cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the weights on the CPU, so model.pt loads on a machine without the GPU."""
    return {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}


# --------------------------------------------------------------------------- --init


@dataclass
class Init:
    """Initial weights read from `path`; a pretrain directory also names the training samples
    its pretraining used, which no client may hold."""

    path: str
    state: dict[str, torch.Tensor]
    sha256: str  # of the weights file
    server_indices: np.ndarray | None = None
    record: dict[str, Any] | None = None


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    """A regular file's bytes (pipes and devices refused before reading), at most `limit`."""
    return read_within(path, limit, lambda why: InitError(f"--init {path}: {what} {why}"))


def _read_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    raw = _read_bounded(path, MAX_WEIGHTS_BYTES, "weights file")
    try:
        obj = load_tensors(raw, MAX_WEIGHTS_BYTES)
    except Exception as err:  # torch raises many types for a corrupt or crafted file
        if "Weights only load failed" in str(err):
            reason = "it holds objects other than tensors (refused without running its code)"
        else:
            first = one_line(err, first_line=True)
            reason = first if first == type(err).__name__ else f"{type(err).__name__}: {first}"
        raise InitError(f"--init {path} is not a readable torch state dict: {reason}") from err
    if not isinstance(obj, Mapping):
        raise InitError(
            f"--init {path} is not a state dict (it holds a {type(obj).__name__}; "
            "save model.state_dict())"
        )
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise InitError(
                f"--init {path} is not a state dict: entry {key!r} is a "
                f"{type(value).__name__}, not a tensor"
            )
    return dict(obj), hashlib.sha256(raw).hexdigest()


def _read_record(path: Path) -> dict[str, Any]:
    try:
        record = parse_json(_read_bounded(path, MAX_RECORD_BYTES, "pretrain record"))
    except ValueError as err:
        raise InitError(f"--init {path} {err}; run `knnper pretrain` again") from None
    if not isinstance(record, dict) or not all(
        isinstance(record.get(k), str) for k in ("dataset", "model")
    ):
        raise InitError(f"--init {path} must be a JSON object naming its dataset and model")
    return record


def _read_indices(path: Path, public: bool) -> np.ndarray:
    raw = _read_bounded(path, MAX_INDICES_BYTES, "server split")
    try:
        array_file_bytes(path)  # the header declares exactly the data the file holds
        indices = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise InitError(f"--init {path} is not a readable .npy file: {err}") from err
    if (
        not isinstance(indices, np.ndarray)
        or indices.ndim != 1
        or (indices.size and not np.issubdtype(indices.dtype, np.integer))
    ):
        raise InitError(f"--init {path} must hold 1-D integer indices")
    if indices.size == 0 and not public:  # a server split of the training set is never empty
        raise InitError(f"--init {path} holds no indices (the server split cannot be empty)")
    if indices.size and (indices.min() < 0 or len(np.unique(indices)) != len(indices)):
        raise InitError(f"--init {path} holds negative or repeated indices")
    return indices.astype(np.int64)


def load_init(path: str | Path) -> Init:
    """Read `--init PATH`: a pretrain directory (model.pt, pretrain.json, server_indices.npy) or
    any `.pt` state dict."""
    location = Path(path)
    if location.is_dir():
        state, digest = _read_state_dict(location / WEIGHTS_FILE)
        record = _read_record(location / RECORD_FILE)
        # pretraining on --public-data takes nothing from the training set: no server split
        public = record.get("public_data") is not None
        return Init(
            str(path), state, digest, _read_indices(location / SERVER_INDICES_FILE, public), record
        )
    if not location.exists():
        raise InitError(
            f"--init {path}: no such file or directory (a pretrain directory from "
            "`knnper pretrain` or a .pt state dict)"
        )
    state, digest = _read_state_dict(location)
    return Init(str(path), state, digest)


def check_init_record(init: Init, dataset: str, model_name: str) -> None:
    """A pretraining's server split only means something for its own data set and model."""
    if init.record is None:
        return
    made_for = (init.record["dataset"], init.record["model"])
    if made_for != (dataset, model_name):
        raise InitError(
            f"--init {init.path} was pretrained for dataset {made_for[0]} with model "
            f"{made_for[1]}; this run uses dataset {dataset} with model {model_name}"
        )


def init_weights(init: Init, model: EmbedHeadModel) -> Weights:
    """The model's weights taken from `init`, after every key and shape has been checked."""
    expected = model.state_dict()
    for key, tensor in expected.items():
        if key not in init.state:
            raise InitError(
                f"--init {init.path} does not fit the model: key {key!r} (shape "
                f"{list(tensor.shape)} in the model) is missing"
            )
        if tuple(init.state[key].shape) != tuple(tensor.shape):
            raise InitError(
                f"--init {init.path} does not fit the model: key {key!r} has shape "
                f"{list(init.state[key].shape)} in the file, {list(tensor.shape)} in "
                "the model"
            )
    extra = [key for key in init.state if key not in expected]
    if extra:
        raise InitError(
            f"--init {init.path} does not fit the model: key {extra[0]!r} is not one of the model's"
        )
    for key, tensor in init.state.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise InitError(f"--init {init.path}: key {key!r} holds NaN or infinite values")
    model.load_state_dict(init.state)
    return get_weights(model)
