"""Local, FedAvg and kNN-Per on every client of a finished run: what `knnper evaluate` prints,
as a library function (the demo and the experiments call it too)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from edge_runtime._io import read_json_cache, write_json_atomic
from fed_train.algorithms import build_algorithm
from fed_train.algorithms.base import get_weights
from fed_train.errors import KnnperError
from fed_train.evaluation import client_accuracies, merge_results
from fed_train.knn_choice import load_or_choose
from fed_train.knn_request import KNNRequest
from fed_train.run import LoadedRun

EVAL_METHODS = ("local", "fedavg", "knnper")


def _local_cache_key(run: LoadedRun) -> dict[str, Any]:
    """As it reads back from JSON (tuples become lists), so a saved key equals a fresh one."""
    return json.loads(json.dumps({"training": run.config.to_dict()["training"],
                                  "seed": run.config.seed}))


def evaluate_run(run: LoadedRun, methods: Sequence[str], *, knn: KNNRequest | None = None,
                 capacity: float = 1.0, progress: bool = True) -> dict[str, Any]:
    """Local, FedAvg and kNN-Per on every client of a finished run. kNN-Per runs the run's
    saved configuration (chosen on validation the first time it is needed: fed_train.knn_choice).
    Local models take as long to train as the run itself, so their per-client results are
    cached in RUN/eval/local.json."""
    clients = run.clients()
    weights = get_weights(run.model)
    per_method: dict[str, list[dict[str, Any]]] = {}
    choice = None
    for method in methods:
        if method not in EVAL_METHODS:
            raise KnnperError(f"unknown method {method!r} for evaluate; known: "
                              f"{', '.join(EVAL_METHODS)}")
        cache = run.run_dir / "eval" / "local.json"
        cached = read_json_cache(cache) if method == "local" else None
        if cached is not None:
            if cached.get("key") == _local_cache_key(run) and isinstance(cached.get("rows"),
                                                                        list):
                per_method[method] = cached["rows"]
                continue
        hyper: dict[str, Any] = {}
        if method == "knnper":
            choice = load_or_choose(run.run_dir, run.model, clients, knn or KNNRequest(),
                                    seed=run.config.seed)
            hyper = {**choice.hyper(), "capacity": capacity}
        algorithm = build_algorithm(method, run.model_factory(), run.config.training, **hyper)
        rows = client_accuracies(algorithm, weights, {}, clients, seed=run.config.seed,
                                 progress=progress)
        per_method[method] = rows
        if method == "local":
            cache.parent.mkdir(exist_ok=True)
            write_json_atomic(cache, {"key": _local_cache_key(run), "rows": rows})
    result = merge_results(per_method)
    if choice is not None:
        result["knn"] = choice.record
    return result


