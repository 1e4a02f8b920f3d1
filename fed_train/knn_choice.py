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

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from edge_runtime._io import JSONFileError, read_json, write_json_atomic
from edge_runtime.knn import (
    CLIENT_RULE,
    LAMBDA_ESTIMATORS,
    NORMALIZATIONS,
    LambdaRule,
    choice_key,
    k_sigma_problem,
)
from edge_runtime.linear_head import L2_GRID
from fed_train.algorithms.base import ClientData
from fed_train.errors import KnnperError
from fed_train.knn_request import KNNRequest
from fed_train.knn_setting import KNNChoice, KNNConfig
from fed_train.knn_tuning import choose_knn, grid_points, pick_base_and_rule, pick_estimator
from fed_train.models import EmbedHeadModel

log = logging.getLogger(__name__)

KNN_CONFIG_FILE = "knn_config.json"
_MAX_FILE_BYTES = 16 << 20  # a real file is a few hundred kB (the grid and per-client lambdas)


def model_sha256(model: torch.nn.Module) -> str:
    """A fingerprint of the weights that does not depend on the device they sit on or on how
    they were saved: every tensor's name, dtype, shape and bytes, in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(
            t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes()
        )
    return digest.hexdigest()


def make_record(
    request: KNNRequest,
    config: KNNConfig,
    estimator: str,
    sha: str,
    *,
    grid: list[dict],
    lambda_cv: dict[str, float],
    clients: Sequence[int],
    samples: int,
    lambda_rule: dict[str, Any] | None = None,
    base: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The evidence saved with a choice, wherever it was made (here or in a Flower run)."""
    rule = CLIENT_RULE.to_dict() if lambda_rule is None else lambda_rule
    base = {"name": "global", "l2": None, "l2_choice": {}} if base is None else base
    return {
        "config": config.to_dict(),
        "estimator": estimator,
        "lambda_rule": rule,
        "base": base,
        "request": asdict(request),
        "source": request.sources(),
        "model_sha256": sha,
        "grid": grid,
        "lambda_cv": lambda_cv,
        "chosen_on": {
            "splits": "validation splits of the seen clients, pooled",
            "clients": [int(c) for c in clients],
            "samples": int(samples),
        },
        **extra,
    }


def choose(
    model: EmbedHeadModel,
    clients: Sequence[ClientData],
    request: KNNRequest,
    *,
    seed: int = 0,
    progress: bool = False,
) -> KNNChoice:
    """Make the choice (no files): the request's grid on the seen clients' validation splits;
    `progress` says each step (knn_tuning.choose_knn)."""
    ks, sigmas, normalizations = request.grids()
    config, estimator, found = choose_knn(
        model,
        clients,
        ks=ks,
        sigmas=sigmas,
        normalizations=normalizations,
        estimator=request.estimator(),
        rule=request.rule(),
        base=request.base_choice(),
        seed=seed,
        progress=progress,
    )
    record = make_record(
        request,
        config,
        estimator,
        model_sha256(model),
        grid=found["grid"],
        lambda_cv=found["lambda_cv"],
        clients=found["chosen_on"]["clients"],
        samples=found["chosen_on"]["samples"],
        lambda_rule=found["lambda_rule"],
        lambda_rule_cv=found["lambda_rule_cv"],
        base=found["base"],
        base_cv=found["base_cv"],
        lambda_report=found["lambda_report"],
    )
    return choice_from_record(record, Path(KNN_CONFIG_FILE))


def load_or_choose(
    directory: str | Path,
    model: EmbedHeadModel,
    clients: Sequence[ClientData],
    request: KNNRequest,
    *,
    seed: int = 0,
    progress: bool = False,
) -> KNNChoice:
    """The choice saved in DIRECTORY/knn_config.json for this request and these weights, or a
    new one (then saved). Saved choices of other weights are dropped with one line: a changed
    model is chosen for again, never run with another model's settings. `progress`: a new
    choice says each step as it goes (minutes on a large federation)."""
    path = Path(directory) / KNN_CONFIG_FILE
    record = saved_choice(path, model_sha256(model), request)
    if record is not None:
        return choice_from_record(record, path)
    choice = choose(model, clients, request, seed=seed, progress=progress)
    save_choice(path, choice.record)
    return choice


def saved_choice(path: Path, sha: str, request: KNNRequest) -> dict[str, Any] | None:
    """The saved record for this request and these weights, if there is one."""
    saved = _read(path)
    if saved is not None and saved["model_sha256"] != sha:
        log.warning(
            "%s was chosen for other weights (model sha256 %s..., now %s...): choosing "
            "kNN-Per's configuration again",
            path,
            saved["model_sha256"][:12],
            sha[:12],
        )
        return None
    record = None if saved is None else saved["choices"].get(request.key())
    if record is not None and (
        not isinstance(record, dict) or record.get("request") != asdict(request)
    ):
        raise _malformed(path, "a saved choice is filed under another request")
    return record


def save_choice(path: Path, record: dict[str, Any]) -> None:
    """Add a record to the file (dropping those of other weights)."""
    saved = _read(path)
    choices = (
        {} if saved is None or saved["model_sha256"] != record["model_sha256"] else saved["choices"]
    )
    choices[KNNRequest(**record["request"]).key()] = record
    write_json_atomic(path, {"model_sha256": record["model_sha256"], "choices": choices}, indent=1)


_FIX = "delete it to choose kNN-Per's configuration again"


def _malformed(path: Path, problem: str) -> KnnperError:
    return KnnperError(f"{path}: {problem}; {_FIX}")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        saved = read_json(path, limit=_MAX_FILE_BYTES, fix=_FIX)
    except FileNotFoundError:
        return None
    except JSONFileError as err:
        raise KnnperError(str(err)) from None
    if (
        not isinstance(saved, dict)
        or not isinstance(saved.get("model_sha256"), str)
        or not isinstance(saved.get("choices"), dict)
    ):
        raise _malformed(path, "it lacks model_sha256 or choices")
    return saved


def _typed(value: Any, kind: type, what: str) -> Any:
    """`value` when it is a `kind` (a JSON true is no int, an int is a float), else KnnperError."""
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
        raise KnnperError(f"{what} must be {kind.__name__}, got {value!r}")
    return value


def _best(grid: list[dict[str, Any]], what: str) -> int:
    """The grid point its saved scores rank first, as choose_knn ranks them (ties: the first)."""
    scores = [
        (
            _typed(g.get("val_accuracy"), float, f"{what} {i} val_accuracy"),
            _typed(g.get("val_nll"), float, f"{what} {i} val_nll"),
        )
        for i, g in enumerate(grid)
    ]
    return min(range(len(grid)), key=lambda i: choice_key(*scores[i]))


def _config(entry: Any, what: str) -> KNNConfig:
    """A grid point or the chosen point of a saved record, each field's type and range checked."""
    if not isinstance(entry, dict):
        raise KnnperError(f"{what} must be an object")
    try:
        config = KNNConfig(
            _typed(entry["k"], int, f"{what} k"),
            float(_typed(entry["sigma"], float, f"{what} sigma")),
            _typed(entry["normalize"], str, f"{what} normalize"),
        )
    except KeyError as err:
        raise KnnperError(f"{what} lacks {err}") from None
    problem = k_sigma_problem(config.k, config.sigma)
    if problem or config.normalize not in NORMALIZATIONS:
        raise KnnperError(f"{what}: {problem or f'unknown normalisation {config.normalize!r}'}")
    return config


def _check_evidence(
    record: dict[str, Any], request: KNNRequest, config: KNNConfig, estimator: str
) -> None:
    """The saved scores must choose the saved values, as choose_knn would have: the grid must
    be the request's and its best point the saved one, and an "auto" estimator the one its
    cross-validated accuracies rank first. A file edited to other values is refused (an honest
    re-choice costs one evaluation; running an unvalidated setting labelled "validation" would
    mislead every report and manifest)."""
    grid, cv = record.get("grid"), record.get("lambda_cv")
    if not isinstance(grid, list) or not isinstance(cv, dict):
        raise KnnperError("grid or lambda_cv is missing")
    points = grid_points(*request.grids())
    if grid:
        saved = [_config(g, f"grid point {i}") for i, g in enumerate(grid)]
        best = _best(grid, "grid point")
        if saved != points:
            raise KnnperError("its grid is not the one this request searches")
        winner = saved[best]
    else:  # a fixed setting chosen without validation data
        winner = points[0] if len(points) == 1 else None
    if winner != config:
        raise KnnperError(f"its scores choose {winner}, not the saved {config} (edited?)")
    if request.estimator() == "auto":
        if (
            set(cv) != set(LAMBDA_ESTIMATORS)
            or pick_estimator(
                {e: _typed(cv[e], float, f"lambda_cv {e}") for e in LAMBDA_ESTIMATORS}
            )
            != estimator
        ):
            raise KnnperError(
                f"its lambda_cv does not choose the saved estimator {estimator!r} (edited?)"
            )
    elif estimator != request.estimator():
        raise KnnperError(
            f"estimator {estimator!r} is not the requested {request.estimator()!r} (edited?)"
        )


def choice_from_record(record: Any, path: Path) -> KNNChoice:
    """A saved record as a choice, checked as flags are (types and ranges) and against its own
    evidence: the file may have been edited."""
    try:
        if not isinstance(record, dict):
            raise KnnperError("it is not an object")
        config = _config(record.get("config"), "config")
        request_fields = record.get("request")
        if not isinstance(request_fields, dict):
            raise KnnperError("request must be an object")
        request = KNNRequest(**request_fields)
        source = record.get("source")
        if source != request.sources():
            raise KnnperError("its sources are not its request's")
        choice = KNNChoice(
            config,
            record["estimator"],
            dict(source),
            record,
            LambdaRule.from_dict(record["lambda_rule"]),
            record["base"]["name"],
            record["base"]["l2"],
        )
        _check_evidence(record, request, config, choice.lambda_estimator)
        _check_base_evidence(record, request, choice.base, choice.lambda_rule.name)
        if choice.base == "linear":
            _check_l2_evidence(record["base"], choice.l2)
    except (KeyError, TypeError, ValueError, OverflowError, KnnperError) as err:
        raise _malformed(path, f"a saved choice is malformed or edited ({err})") from None
    return choice


def _check_l2_evidence(base: dict[str, Any], l2: float) -> None:
    """The linear head's l2 must be the value its saved scores rank first over L2_GRID, as
    choose_l2 ranks them (an in-range edit to another grid value ran and was reported as
    "(validation)")."""
    choice = base.get("l2_choice")
    if (
        not isinstance(choice, dict)
        or not isinstance(choice.get("grid"), list)
        or not isinstance(choice.get("config"), dict)
    ):
        raise KnnperError("the linear base's l2_choice is missing")
    grid = choice["grid"]
    if [
        _typed(g.get("l2"), float, f"l2 grid point {i}") if isinstance(g, dict) else None
        for i, g in enumerate(grid)
    ] != list(L2_GRID):
        raise KnnperError("its l2 grid is not the one the linear base searches")
    best = _best(grid, "l2 grid point")
    if not L2_GRID[best] == choice["config"].get("l2") == l2:
        raise KnnperError(f"its l2 scores choose {L2_GRID[best]:g}, not the saved {l2!r} (edited?)")


def _check_base_evidence(record: dict[str, Any], request: KNNRequest, base: str, rule: str) -> None:
    """The saved base and lambda rule must be the ones asked for, or, where asked for as
    "auto", the pair the saved cross-validated accuracies rank first (a choice made without
    validation data is the paper's global base and per-client rule)."""
    cv = record.get("base_cv")
    if not isinstance(cv, dict):
        raise KnnperError("base_cv is missing")
    for asked, saved, what in (
        (request.base_choice(), base, "base"),
        (request.rule(), rule, "lambda rule"),
    ):
        if asked != "auto" and asked != saved:
            raise KnnperError(f"{what} {saved!r} is not the requested {asked!r} (edited?)")
    if cv:
        scores = {
            b: {r: _typed(v, float, f"base_cv {b}/{r}") for r, v in rules.items()}
            for b, rules in cv.items()
        }
        if pick_base_and_rule(scores) != (base, rule):
            raise KnnperError(f"its base_cv does not choose the saved {base}/{rule} (edited?)")
    elif "auto" in (request.base_choice(), request.rule()) and (base, rule) != ("global", "client"):
        raise KnnperError(f"{base}/{rule} was chosen without cross-validation (edited?)")
