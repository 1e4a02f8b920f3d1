"""kNN-Per's configuration for one trained model, chosen once and used everywhere.

What is chosen on validation (k, sigma, the embedding normalisation and the lambda estimator) is
written into the run directory with its evidence (every grid point's validation score, the
estimators' cross-validated accuracies, which splits were used and the model's sha256) and read
back by every later command: `evaluate`, `export`, `bench table`, `demo`, `experiment` and the
Flower evaluation. Each bundle's manifest records the values and where each came from, so what a
device runs is what the server measured.

Two settings: "tuned" (the default) searches knn_tuning's grids on the seen clients' pooled
validation splits and picks the lambda estimator by 2-fold cross-validation inside them;
"paper" is the paper's fixed point (k = 10, sigma = 1, raw embeddings, lambda on validation).
An explicit k, sigma, normalisation or estimator overrides either by pinning that axis.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from edge_runtime.knn import LAMBDA_ESTIMATORS, NORMALIZATIONS
from fed_train.algorithms.base import ClientData
from fed_train.errors import KnnperError
from fed_train.knn_request import (
    ESTIMATOR_CHOICES,
    KNN_MODES,
    KNNRequest,
)
from fed_train.knn_tuning import KNNConfig, choose_knn
from fed_train.models import EmbedHeadModel

log = logging.getLogger(__name__)

KNN_CONFIG_FILE = "knn_config.json"
_MAX_FILE_BYTES = 16 << 20  # a real file is a few hundred kB (the grid and per-client lambdas)


@dataclass(frozen=True)
class KNNChoice:
    """The configuration a model's devices run, where each value came from, and the evidence."""

    config: KNNConfig
    lambda_estimator: str
    source: dict[str, str]
    record: dict[str, Any] = field(repr=False)

    def hyper(self) -> dict[str, Any]:
        """KNNPer's keyword arguments."""
        return {**self.config.to_dict(), "lambda_estimator": self.lambda_estimator}

    def provenance(self) -> dict[str, dict[str, Any]]:
        """Each value with where it came from: what manifests and export.json record."""
        values = self.hyper()
        return {name: {"value": values[name], "source": self.source[name]} for name in values}

    def describe(self) -> str:
        return describe_record(self.record)


def describe_record(record: dict[str, Any]) -> str:
    """One line: the values and where each came from."""
    c, source = record["config"], record["source"]
    return (f"kNN-Per: k={c['k']} ({source['k']}), sigma={c['sigma']:g} ({source['sigma']}), "
            f"embeddings {c['normalize']} ({source['normalize']}), lambda by "
            f"{record['estimator']} ({source['lambda_estimator']})")


def model_sha256(model: torch.nn.Module) -> str:
    """A fingerprint of the weights that does not depend on the device they sit on or on how
    they were saved: every tensor's name, dtype, shape and bytes, in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.numpy().tobytes() if t.dtype != torch.bfloat16
                      else t.float().numpy().tobytes())
    return digest.hexdigest()


def make_record(request: KNNRequest, config: KNNConfig, estimator: str, sha: str, *,
                grid: list[dict], lambda_cv: dict[str, float], clients: Sequence[int],
                samples: int, **extra: Any) -> dict[str, Any]:
    """The evidence saved with a choice, wherever it was made (here or in a Flower run)."""
    return {"config": config.to_dict(), "estimator": estimator, "request": asdict(request),
            "source": request.sources(), "model_sha256": sha, "grid": grid,
            "lambda_cv": lambda_cv,
            "chosen_on": {"splits": "validation splits of the seen clients, pooled",
                          "clients": [int(c) for c in clients], "samples": int(samples)},
            **extra}


def choose(model: EmbedHeadModel, clients: Sequence[ClientData], request: KNNRequest, *,
           seed: int = 0) -> KNNChoice:
    """Make the choice (no files): the request's grid on the seen clients' validation splits."""
    ks, sigmas, normalizations = request.grids()
    config, estimator, found = choose_knn(model, clients, ks=ks, sigmas=sigmas,
                                          normalizations=normalizations,
                                          estimator=request.estimator(), seed=seed)
    record = make_record(request, config, estimator, model_sha256(model), grid=found["grid"],
                         lambda_cv=found["lambda_cv"], clients=found["chosen_on"]["clients"],
                         samples=found["chosen_on"]["samples"],
                         lambda_report=found["lambda_report"])
    return KNNChoice(config, estimator, request.sources(), record)


def load_or_choose(directory: str | Path, model: EmbedHeadModel, clients: Sequence[ClientData],
                   request: KNNRequest, *, seed: int = 0) -> KNNChoice:
    """The choice saved in DIRECTORY/knn_config.json for this request and these weights, or a
    new one (then saved). Saved choices of other weights are dropped with one line: a changed
    model is chosen for again, never run with another model's settings."""
    path = Path(directory) / KNN_CONFIG_FILE
    record = saved_choice(path, model_sha256(model), request)
    if record is not None:
        return choice_from_record(record, path)
    choice = choose(model, clients, request, seed=seed)
    save_choice(path, choice.record)
    return choice


def saved_choice(path: Path, sha: str, request: KNNRequest) -> dict[str, Any] | None:
    """The saved record for this request and these weights, if there is one."""
    saved = _read(path)
    if saved is not None and saved["model_sha256"] != sha:
        log.warning("%s was chosen for other weights (model sha256 %s..., now %s...): choosing "
                    "kNN-Per's configuration again", path, saved["model_sha256"][:12], sha[:12])
        return None
    return None if saved is None else saved["choices"].get(request.key())


def save_choice(path: Path, record: dict[str, Any]) -> None:
    """Add a record to the file (dropping those of other weights)."""
    saved = _read(path)
    choices = {} if saved is None or saved["model_sha256"] != record["model_sha256"] \
        else saved["choices"]
    choices[KNNRequest(**record["request"]).key()] = record
    _write_atomic(path, {"model_sha256": record["model_sha256"], "choices": choices})


def _read(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    if not path.is_file() or path.stat().st_size > _MAX_FILE_BYTES:
        raise KnnperError(f"{path} is not a kNN configuration file (delete it to choose again)")
    try:
        saved = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise KnnperError(f"{path} is not valid JSON ({err.msg}); delete it to choose "
                          "kNN-Per's configuration again") from None
    if (not isinstance(saved, dict) or not isinstance(saved.get("model_sha256"), str)
            or not isinstance(saved.get("choices"), dict)):
        raise KnnperError(f"{path} lacks model_sha256 or choices; delete it to choose kNN-Per's "
                          "configuration again")
    return saved


def choice_from_record(record: Any, path: Path) -> KNNChoice:
    """A saved record as a choice, checked as flags are: the file may have been edited."""
    try:
        config = KNNConfig(**record["config"])
        request = KNNRequest(**record["request"])
        estimator, source = record["estimator"], record["source"]
        KNNRequest(k=config.k, sigma=config.sigma, normalize=config.normalize,
                   lambda_estimator=estimator)  # the same checks as flags get
        if estimator not in LAMBDA_ESTIMATORS or source != request.sources():
            raise KnnperError("inconsistent estimator or sources")
    except (KeyError, TypeError, KnnperError) as err:
        raise KnnperError(f"{path}: a saved choice is malformed ({err}); delete the file to "
                          "choose kNN-Per's configuration again") from None
    return KNNChoice(config, estimator, dict(source), record)


def _write_atomic(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def add_knn_arguments(p: argparse.ArgumentParser, positive_int: Any, positive_float: Any) -> None:
    """--knn-config and the flags that pin one value of it, for every command that runs
    kNN-Per (evaluate, export, bench table, demo, experiment, deploy)."""
    p.add_argument("--knn-config", choices=KNN_MODES, default="tuned",
                   help="kNN-Per's k, sigma, normalisation and lambda estimator: chosen on the "
                   "seen clients' pooled validation splits (tuned, saved in the run directory "
                   "and reused) or the paper's fixed setting (k=10, sigma=1, raw embeddings, "
                   "lambda on validation)")
    p.add_argument("--k", type=positive_int, default=None,
                   help="pin kNN-Per's number of neighbours (default: from --knn-config)")
    p.add_argument("--sigma", type=positive_float, default=None,
                   help="pin kNN-Per's kernel width (default: from --knn-config)")
    p.add_argument("--normalize", choices=NORMALIZATIONS, default=None,
                   help="pin the embedding normalisation before the kNN (default: from "
                   "--knn-config)")
    p.add_argument("--lambda-estimator", choices=ESTIMATOR_CHOICES, default=None,
                   help="pin how each client picks lambda: its validation split (val), plus "
                   "leave-one-out posteriors of its datastore (loo+val), or whichever wins 2-fold "
                   "cross-validation inside the validation splits (auto; default: from "
                   "--knn-config)")


def knn_request(args: argparse.Namespace) -> KNNRequest:
    return KNNRequest(args.knn_config, args.k, args.sigma, args.normalize, args.lambda_estimator)
