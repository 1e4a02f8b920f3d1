"""Local, FedAvg and kNN-Per on every client of a finished run: what `knnper evaluate` prints,
as a library function (the demo and the experiments call it too)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fed_train.algorithms import build_algorithm
from fed_train.algorithms.base import get_weights
from fed_train.errors import KnnperError
from fed_train.evaluation import client_accuracies, merge_results
from fed_train.journal import ClientRows
from fed_train.knn_choice import load_or_choose
from fed_train.knn_request import KNNRequest
from fed_train.run import LoadedRun, data_fingerprint
from fed_train.run_config import EVAL_METHODS


def _local_cache_key(run: LoadedRun) -> dict[str, Any]:
    """What a client's local model depends on: not the global model, but the training
    settings, the seed and the clients' data (another run's journal with the same flags was
    reused for a different partition)."""
    return {
        "training": run.config.to_dict()["training"],
        "seed": run.config.seed,
        "data_sha256": data_fingerprint(run.dataset, run.partition),
    }


def evaluate_run(
    run: LoadedRun,
    methods: Sequence[str],
    *,
    knn: KNNRequest | None = None,
    capacity: float = 1.0,
    progress: bool = True,
) -> dict[str, Any]:
    """Local, FedAvg and kNN-Per on every client of a finished run. kNN-Per runs the run's
    saved configuration (chosen on validation the first time it is needed: fed_train.knn_choice).
    Local models take as long to train as the run itself, so each client's result is kept in
    RUN/eval/local.jsonl as it finishes: an interrupted or later call reuses them.

    Parameters
    ----------
    run : a finished run (`load_run`).
    methods : among "local", "fedavg" and "knnper".
    knn : which kNN-Per configuration (chosen on validation by default, or the paper's, or
        values pinned); None is the default request.
    capacity : the share of each client's train split kNN-Per's datastore holds.
    progress : a bar on a terminal, a line every 30 s in a log.

    Returns
    -------
    Per method and group (seen, unseen): mean accuracy weighted by test size and bottom
    decile; every client's row under "clients".
    """
    clients = run.clients()
    weights = get_weights(run.model)
    per_method: dict[str, list[dict[str, Any]]] = {}
    choice = None
    for method in methods:
        if method not in EVAL_METHODS:
            raise KnnperError(
                f"unknown method {method!r} for evaluate; known: {', '.join(EVAL_METHODS)}"
            )
        hyper: dict[str, Any] = {}
        if method == "knnper":
            choice = load_or_choose(
                run.run_dir,
                run.model,
                clients,
                knn or KNNRequest(),
                seed=run.config.seed,
                progress=progress,
            )
            hyper = {"choice": choice, "capacity": capacity}
        algorithm = build_algorithm(method, run.model_factory(), run.config.training, **hyper)
        journal = (
            ClientRows(run.run_dir / "eval" / "local.jsonl", _local_cache_key(run))
            if method == "local"
            else None
        )
        per_method[method] = client_accuracies(
            algorithm,
            weights,
            {},
            clients,
            seed=run.config.seed,
            progress=progress,
            journal=journal,
        )
    result = merge_results(per_method)
    if choice is not None:
        result["knn"] = choice.record
    return result
