"""The ServerApp: finds which SuperNode serves which client, runs the rounds of the strategy
with the simulation's checkpoints and metrics log, saves the final model and asks every client
for its personalized accuracies. It writes the same run directory as `knnper train` (so
`knnper evaluate` and `knnper export` work on it) plus flower.json (the deployment's settings,
outcome and federated evaluation)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from edge_runtime._io import write_json_atomic
from edge_runtime.errors import one_line
from edge_runtime.knn import LAMBDA_ESTIMATORS, LAMBDA_GRID, LAMBDA_RULES
from edge_runtime.linear_head import L2_GRID
from edge_runtime.manifest import read_manifest
from edge_runtime.release import ReleaseError, read_release
from fed_train.algorithms import build_algorithm
from fed_train.algorithms.base import set_weights
from fed_train.evaluation import format_table
from fed_train.flower.records import (
    ModelSpec,
    knn_choice_record,
    points_record,
    to_array_record,
    to_weights,
)
from fed_train.flower.release_push import RELEASE_ACTION, read_reply, release_files
from fed_train.flower.settings import FlowerSettings
from fed_train.flower.strategy import FederationError, KnnperStrategy, read_replies
from fed_train.knn_choice import (
    KNN_CONFIG_FILE,
    choice_from_record,
    make_record,
    model_sha256,
    save_choice,
    saved_choice,
)
from fed_train.knn_request import KNNRequest
from fed_train.knn_setting import KNNChoice, KNNConfig
from fed_train.knn_tuning import (
    BASES,
    LinearConfig,
    fit_rule,
    grid_points,
    pick_base_and_rule,
    pick_config,
    pick_estimator,
    pool_estimators,
    pool_rules,
)
from fed_train.run import open_run, save_model
from fed_train.simulation import is_checkpoint_round, log_round, open_run_log

log = logging.getLogger(__name__)

FLOWER_FILE = "flower.json"
POLL_SECONDS = 1.0

app = ServerApp()


def find_clients(
    grid: Grid, settings: FlowerSettings, spec: ModelSpec, num_train: dict[int, int]
) -> dict[int, int]:
    """client id -> node id, from a query every SuperNode answers. Waits (at most
    connect-timeout) until every client of the run is served; a node whose configuration is
    wrong, two nodes claiming one client, or a client count that disagrees stop the run here."""
    clients = settings.run.clients
    deadline = time.monotonic() + settings.connect_timeout
    node_of: dict[int, int] = {}
    asked: set[int] = set()
    while len(node_of) < clients:
        new = [n for n in grid.get_node_ids() if n not in asked]
        if not new or len(asked) + len(new) < clients:  # wait until every client can be there
            if time.monotonic() < deadline:
                time.sleep(POLL_SECONDS)
                continue
            if not new:
                missing = sorted(set(range(clients)) - set(node_of))
                raise FederationError(
                    f"after {settings.connect_timeout:g} s no SuperNode "
                    f"serves client(s) {missing} (start them with "
                    "--node-config 'partition-id=N num-partitions=M')"
                )
            # past the deadline: ask the nodes that are there, so the error names who is missing
        asked.update(new)
        queries = [
            Message(
                RecordDict({"model": spec.to_record()}),
                dst_node_id=n,
                message_type=MessageType.QUERY,
            )
            for n in new
        ]
        remaining = max(1.0, deadline - time.monotonic())
        got = read_replies(
            grid.send_and_receive(queries, timeout=remaining),
            {n: n for n in new},
            lambda node, reply: _served_client(reply, clients),
        )
        if got.failed:
            node, why = next(iter(got.failed.items()))
            raise FederationError(f"SuperNode {node} cannot serve a client: {why}")
        for node, (cid, reported) in got.read.items():
            if cid in node_of:
                raise FederationError(
                    f"SuperNodes {node_of[cid]} and {node} both serve client {cid}"
                )
            if cid in num_train and reported != num_train[cid]:
                raise FederationError(
                    f"client {cid} holds {reported} training samples, the "
                    f"server's partition gives it {num_train[cid]}"
                )
            node_of[cid] = node
    return node_of


def _served_client(reply: Message, clients: int) -> tuple[int, int]:
    """The client a node serves and its training samples, as its query reply says."""
    metrics = reply.content.metric_records["metrics"]
    cid, reported = metrics["client-id"], metrics["num-train"]
    if not (isinstance(cid, int) and 0 <= cid < clients and isinstance(reported, int)):
        raise ValueError(
            f"client {cid!r:.40} with {reported!r:.40} training samples is not "
            f"one of the run's clients 0 to {clients - 1}"
        )
    return cid, reported


def _ask_phase(
    grid: Grid,
    strategy: KnnperStrategy,
    arrays,
    settings: FlowerSettings,
    server_round: int,
    phase: str,
    points: list[KNNConfig],
    shape: tuple[int, int],
    config: dict[str, Any] | None = None,
) -> dict[int, np.ndarray]:
    """Each answering seen client's sums for `phase`, refused unless of `shape`: the phase's
    function in fed_train.knn_tuning says its shape."""
    replies = grid.send_and_receive(
        strategy.configure_knn_phase(
            server_round,
            arrays,
            ConfigRecord({"phase": phase, **(config or {})}),
            points_record(points),
        ),
        timeout=settings.round_timeout,
    )
    counts = strategy.collect_knn_counts(replies, phase, shape)
    if not counts:
        raise FederationError("no seen client answered for kNN-Per's configuration")
    return counts


def _base_and_rule(
    ask: Callable[..., dict[int, np.ndarray]],
    request: KNNRequest,
    config: KNNConfig,
    estimator: str,
) -> tuple[str, str, dict[str, dict[str, Any]], dict[str, dict[str, float]], dict[str, Any]]:
    """The base (global, or each client's linear head with the l2 the clients' sums pick) and
    the lambda rule, by the clients' 2-fold cross-validation where more than one pair is asked.

    Returns
    -------
    base, rule : the pair chosen.
    under : per base, the settings its clients' phases run under.
    base_cv : per base, each rule's pooled cross-validation ({} when nothing was compared).
    l2_choice : the linear head's l2 and its grid ({} without the linear base).
    """
    bases = BASES if request.base_choice() == "auto" else (request.base_choice(),)
    rules = LAMBDA_RULES if request.rule() == "auto" else (request.rule(),)
    l2_choice: dict[str, Any] = {}
    if "linear" in bases:
        l2_grid = [LinearConfig(float(v)) for v in L2_GRID]
        best, l2_scores = pick_config(
            l2_grid, list(ask("knn-l2", [config], (len(L2_GRID), 3)).values())
        )
        l2_choice = {"config": best.to_dict(), "grid": l2_scores}
    under = {
        b: {
            "estimator": estimator,
            "linear-l2": l2_choice["config"]["l2"] if b == "linear" else 0.0,
        }
        for b in bases
    }
    if len(bases) * len(rules) == 1:
        return bases[0], rules[0], under, {}, l2_choice
    base_cv = {
        b: pool_rules(
            list(ask("knn-rule-folds", [config], (2 * len(LAMBDA_GRID), 5), under[b]).values()),
            rules,
        )
        for b in bases
    }
    return *pick_base_and_rule(base_cv), under, base_cv, l2_choice


def federated_knn_choice(
    grid: Grid,
    strategy: KnnperStrategy,
    arrays,
    settings: FlowerSettings,
    run_dir: Path,
    model: Any,
    server_round: int,
) -> KNNChoice:
    """kNN-Per's configuration chosen as `knnper evaluate` chooses it, from sums the seen
    clients compute on their own validation splits (the grid's scores, then the estimators'
    cross-validation), and saved in the run directory so that evaluate and export reuse it."""
    request = settings.knn
    path = run_dir / KNN_CONFIG_FILE
    sha = model_sha256(model)
    saved = saved_choice(path, sha, request)
    if saved is not None:
        return choice_from_record(saved, path)
    ask = partial(_ask_phase, grid, strategy, arrays, settings, server_round)
    points = grid_points(*request.grids())
    grid_counts = ask("knn-grid", points, (len(points), 3))
    config, scores = pick_config(points, [c for c in grid_counts.values() if c[0, 2] > 0])
    estimator = request.estimator()
    cv: dict[str, float] = {}
    if estimator == "auto":
        cv = pool_estimators(
            list(ask("knn-estimators", [config], (len(LAMBDA_ESTIMATORS), 2)).values())
        )
        estimator = pick_estimator(cv)
    chosen_on = [cid for cid, c in grid_counts.items() if c[0, 2] > 0]
    base, rule, under, base_cv, l2_choice = _base_and_rule(ask, request, config, estimator)
    evidence = (
        ask("knn-rule-evidence", [config], (len(LAMBDA_GRID), 3), under[base])
        if rule != "client"
        else {}
    )
    fitted = fit_rule(rule, [evidence[cid] for cid in chosen_on if cid in evidence])
    record = make_record(
        request,
        config,
        estimator,
        sha,
        grid=scores,
        lambda_cv=cv,
        lambda_rule=fitted.to_dict(),
        lambda_rule_cv=base_cv.get(base, {}),
        base={"name": base, "l2": under[base]["linear-l2"] or None, "l2_choice": l2_choice},
        base_cv=base_cv,
        clients=chosen_on,
        samples=sum(grid_counts[cid][0, 2] for cid in chosen_on),
        made_by="Flower: sums from each seen client's own validation split",
    )
    save_choice(path, record)
    choice = choice_from_record(record, path)
    log.info("%s", choice.describe())
    return choice


def _write_flower_file(run_dir: Path, record: dict[str, Any]) -> None:
    write_json_atomic(run_dir / FLOWER_FILE, record)


def train_and_evaluate(grid: Grid, settings: FlowerSettings) -> dict[str, Any]:
    run_dir = Path(settings.run_dir)
    config, training = settings.run, settings.run.training
    run = open_run(config, run_dir)
    spec = ModelSpec(
        run.model_name, run.dataset.num_classes, json.loads(json.dumps(run.dataset.input_spec))
    )
    algorithm = build_algorithm(settings.algorithm, run.model_fn, training)
    unseen = {cid: bool(u) for cid, u in enumerate(run.partition.unseen)}
    num_train = {
        cid: len(split.train) for cid, split in enumerate(run.partition.clients) if not unseen[cid]
    }
    if not num_train:
        raise FederationError("no training clients: every client is held out as unseen")
    record: dict[str, Any] = {
        "algorithm": settings.algorithm,
        "status": "running",
        "settings": settings.to_run_config(),
    }
    _write_flower_file(run_dir, record)
    node_of = find_clients(grid, settings, spec, num_train)
    num_test = {cid: len(split.test) for cid, split in enumerate(run.partition.clients)}
    strategy = KnnperStrategy(algorithm, settings, spec, node_of, num_train, unseen, num_test)
    strategy.summary()
    state = open_run_log(run_dir, run.start)
    arrays = to_array_record(state.weights)
    for server_round in range(state.rounds_done + 1, training.rounds + 1):
        start = time.perf_counter()
        replies = grid.send_and_receive(
            strategy.configure_train(server_round, arrays, ConfigRecord(), grid),
            timeout=settings.round_timeout,
        )
        arrays, _ = strategy.aggregate_train(server_round, replies)
        state.weights, state.rounds_done = to_weights(arrays), server_round
        info = strategy.round_info
        row = {
            "round": server_round,
            "lr": info["lr"],
            "clients": info["clients"],
            "train_loss": info["train_loss"],
            "seconds": round(time.perf_counter() - start, 3),
            "bytes_down": info["bytes_down"],
            "bytes_up": info["bytes_up"],
            "train_seconds": info["train_seconds"],
            "train_seconds_max": info["train_seconds_max"],
        }
        log_round(
            run_dir,
            row,
            state,
            is_checkpoint_round(server_round, training.rounds, config.checkpoint_every),
        )
        log.info("round %d/%d: %s", server_round, training.rounds, row)
    if set(state.weights) == set(strategy.model_weights):
        save_model(run_dir, run.model_fn(), state.weights)
    else:  # ClusteredFL's global state is one model per cluster: its checkpoints hold them
        log.info("%s keeps no single global model; model.pt is not written", algorithm.name)
    evaluate_config = ConfigRecord()
    if "knnper" in settings.eval_methods:
        if set(state.weights) != set(strategy.model_weights):
            raise FederationError(
                f"{algorithm.name} keeps no single global model for kNN-Per "
                "to personalize: leave knnper out of --eval-methods"
            )
        model = run.model_fn()
        set_weights(model, state.weights)
        choice = federated_knn_choice(
            grid, strategy, arrays, settings, run_dir, model, training.rounds + 1
        )
        record["knn"] = choice.record
        evaluate_config = knn_choice_record(choice)
    replies = grid.send_and_receive(
        strategy.configure_evaluate(training.rounds + 1, arrays, evaluate_config, grid),
        timeout=settings.round_timeout,
    )
    strategy.aggregate_evaluate(training.rounds + 1, replies)
    record.update(status="completed", evaluation=strategy.evaluation)
    _write_flower_file(run_dir, record)
    log.info("federated evaluation:\n%s", format_table(strategy.evaluation))
    return record


def push_release(grid: Grid, settings: FlowerSettings) -> dict[str, Any]:
    """`knnper deploy release`: send every client's node its files of the export
    `settings.release` (fed_train.flower.release_push), wait for each node to build or upgrade
    its own bundle, and keep their replies (counts, accuracies, versions) in flower.json."""
    release = Path(settings.release)
    try:
        record = read_release(release)
    except ReleaseError as err:
        raise FederationError(str(err)) from None
    if record is None or not record.clients:
        raise FederationError(f"{release} holds no client bundles (is it a `knnper export`?)")
    like = read_manifest(record.bundle_dir(release, record.clients[0]))
    spec = ModelSpec(settings.run.model or "", like.num_classes, like.input.to_json())
    record: dict[str, Any] = {
        "status": "running",
        "release": str(release),
        "settings": settings.to_run_config(),
    }
    _write_flower_file(Path(settings.run_dir), record)
    node_of = find_clients(grid, settings, spec, {})
    messages = [
        Message(
            RecordDict({"model": spec.to_record(), "files": release_files(release, cid)}),
            dst_node_id=node,
            message_type=f"{MessageType.TRAIN}.{RELEASE_ACTION}",
        )
        for cid, node in node_of.items()
    ]
    got = read_replies(
        grid.send_and_receive(messages, timeout=settings.round_timeout),
        {node: cid for cid, node in node_of.items()},
        lambda cid, reply: read_reply(reply),
    )
    record.update(nodes=got.read, failed=got.failed, silent=got.silent)
    if got.failed or got.silent:
        why = "; ".join(f"client {c}: {r}" for c, r in got.failed.items())
        silent = (
            f"no reply from client(s) {got.silent} within the round timeout" if got.silent else ""
        )
        raise FederationError("; ".join(x for x in (why, silent) if x))
    record["status"] = "completed"
    _write_flower_file(Path(settings.run_dir), record)
    return record


@app.main()
def main(grid: Grid, context: Context) -> None:
    settings = FlowerSettings.from_run_config(dict(context.run_config))
    try:
        if settings.release:
            push_release(grid, settings)
        else:
            train_and_evaluate(grid, settings)
    except Exception as err:
        # the launcher only sees "failed"; the run directory says why, in one line
        reason = one_line(err, first_line=True)
        run_dir = Path(settings.run_dir)
        if run_dir.is_dir():
            _write_flower_file(
                run_dir,
                {
                    "algorithm": settings.algorithm,
                    "status": "failed",
                    "error": reason,
                    "settings": settings.to_run_config(),
                },
            )
        raise
