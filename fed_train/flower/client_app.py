"""The ClientApp a SuperNode runs: it answers the server's query (which client am I, how many
samples), trains with the algorithm's `client_update`, and evaluates personalized models on its
own data. Only weights, sample counts, accuracies and the chosen settings leave the node.

Flower starts a fresh process for every message, so this module imports only flwr at the top;
each handler imports what its message needs (training: torch and the algorithm), and the
client's raw splits are kept in the node's Context.state after the first message, so later ones
do not load the data set and draw the partition again. The node config key `device` (cpu, cuda
or auto; cpu when absent) says where this node trains."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

if TYPE_CHECKING:
    import numpy as np

    from fed_train.algorithms.base import ClientData
    from fed_train.flower.records import ModelSpec
    from fed_train.flower.settings import FlowerSettings

log = logging.getLogger(__name__)

app = ClientApp()


def _setup(msg: Message, context: Context) -> tuple[FlowerSettings, ModelSpec, ClientData]:
    from fed_train.accelerator import resolve_device
    from fed_train.flower.client_data import load_node_client
    from fed_train.flower.records import ModelSpec
    from fed_train.flower.settings import FlowerSettings

    settings = FlowerSettings.from_run_config(dict(context.run_config))
    spec = ModelSpec.from_record(msg.content["model"])
    node_config = dict(context.node_config)
    device = resolve_device(str(node_config.get("device", "cpu")))
    client = load_node_client(
        settings.run, node_config, spec.input_spec, spec.num_classes, context.state
    )
    return settings, spec.on(device), client.to(device)


def _received_weights(msg: Message, spec: ModelSpec) -> dict:
    from fed_train.flower.records import check_shapes, to_weights

    weights = to_weights(msg.content["arrays"])
    check_shapes(weights, spec.shapes(), sender="the server")
    return weights


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Which client this node serves: checked here, at the start, so a misconfigured node stops
    the run before any training instead of failing mid-way."""
    _, _, client = _setup(msg, context)
    metrics = MetricRecord(
        {
            "client-id": client.client_id,
            "num-train": client.num_train,
            "num-val": int(client.y_val.shape[0]),
            "num-test": int(client.y_test.shape[0]),
        }
    )
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    from fed_train.algorithms import build_algorithm
    from fed_train.flower.records import load_state, save_state, to_array_record

    settings, spec, client = _setup(msg, context)
    weights = _received_weights(msg, spec)
    config = msg.content["config"]
    algorithm = build_algorithm(settings.algorithm, spec.model_fn(), settings.run.training)
    started = time.perf_counter()
    result = algorithm.client_update(
        weights, client, load_state(context.state), float(config["lr"]), int(config["seed"])
    )
    seconds = time.perf_counter() - started  # the training alone: what the simulation spends
    scalars = save_state(context.state, result.state)
    metrics = MetricRecord(
        {
            "client-id": client.client_id,
            "num-examples": result.num_samples,
            "train-loss": float(result.loss),
            "train-seconds": seconds,
        }
    )
    return Message(
        RecordDict(
            {"arrays": to_array_record(result.weights), "metrics": metrics, "state": scalars}
        ),
        reply_to=msg,
    )


@app.train("release")
def release(msg: Message, context: Context) -> Message:
    """Bring this node's own bundle (node config `bundle-dir`) to the release the server sent:
    build it from this node's train split and teach it the validation split, or upgrade it in
    place (fed_train.flower.device_release); a node config `trusted-key` refuses a release not
    signed by it. The reply holds counts, accuracies and version ids only
    (fed_train.flower.release_push.node_reply refuses anything else)."""
    from pathlib import Path

    from fed_train.flower.client_data import node_partition_id, node_splits
    from fed_train.flower.device_release import bring_to_release, node_trusted_keys
    from fed_train.flower.records import ModelSpec
    from fed_train.flower.release_push import node_reply
    from fed_train.flower.settings import FlowerConfigError, FlowerSettings

    settings = FlowerSettings.from_run_config(dict(context.run_config))
    spec = ModelSpec.from_record(msg.content["model"])
    node_config = dict(context.node_config)
    if "bundle-dir" not in node_config:
        raise FlowerConfigError(
            "node config has no 'bundle-dir' (where this device keeps its bundle: start the "
            "SuperNode with --node-config 'partition-id=N bundle-dir=\"DIR\"')"
        )
    client_id = node_partition_id(node_config, settings.run.clients)
    splits = node_splits(
        settings.run, node_config, spec.input_spec, spec.num_classes, context.state
    )
    metrics, texts = bring_to_release(
        msg.content["files"],
        Path(str(node_config["bundle-dir"])).expanduser(),
        splits,
        client_id=client_id,
        keep_inputs=settings.keep_inputs,
        force=settings.force_upgrade,
        seed=settings.run.seed,
        trusted_keys=node_trusted_keys(node_config),
    )
    return node_reply(msg, metrics, texts)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Personalize each requested method on this client's own data (kNN-Per: a datastore from
    its train split, lambda from its validation split, the edge runtime's kNN math) and report
    its test accuracy with what was chosen; `knnper evaluate` computes the same rows. It needs
    the final aggregated model, so it cannot ride on the last round's train reply. Before
    that, the server may ask for this client's share of choosing kNN-Per's configuration
    (config "phase"): sums over its validation split, never the samples."""
    from fed_train.algorithms import build_algorithm
    from fed_train.evaluation import client_accuracies
    from fed_train.flower.records import (
        counts_record,
        knn_choice_from,
        load_state,
        to_config_record,
    )

    settings, spec, client = _setup(msg, context)
    weights = _received_weights(msg, spec)
    config = msg.content["config"]
    phase = str(config.get("phase", "evaluate"))
    if phase != "evaluate":
        counts = _knn_choice_counts(phase, msg.content, settings, spec, client, weights)
        return Message(RecordDict({"counts": counts_record(phase, counts)}), reply_to=msg)
    client.unseen = bool(config["unseen"])
    choice = knn_choice_from(config)
    metrics = MetricRecord({"num-examples": int(client.y_test.shape[0])})
    info: dict[str, dict] = {}
    for method in settings.eval_methods:
        hyper = {"choice": choice, "capacity": settings.capacity} if method == "knnper" else {}
        algorithm = build_algorithm(method, spec.model_fn(), settings.run.training, **hyper)
        state = load_state(context.state) if method == settings.algorithm else {}
        row = client_accuracies(
            algorithm, weights, {client.client_id: state}, [client], seed=settings.run.seed
        )[0]
        info[method] = row["info"]
        if row["accuracy"] is not None:
            metrics[f"{method}-accuracy"] = row["accuracy"]
    return Message(RecordDict({"metrics": metrics, "info": to_config_record(info)}), reply_to=msg)


def _knn_choice_counts(
    phase: str,
    content: RecordDict,
    settings: FlowerSettings,
    spec: ModelSpec,
    client: ClientData,
    weights: dict,
) -> np.ndarray:
    """This client's grid_counts ("knn-grid": every point sent), estimator_counts
    ("knn-estimators"), l2_counts ("knn-l2"), rule_fold_counts ("knn-rule-folds") or
    rule_evidence ("knn-rule-evidence"; these four under the one point sent) under the global
    model: the same sums the simulation pools (fed_train.knn_tuning)."""
    from fed_train.algorithms import build_algorithm
    from fed_train.flower.records import points_from_record
    from fed_train.knn_tuning import (
        client_views,
        estimator_counts,
        grid_counts,
        l2_counts,
        linear_base_views,
        normalized_views,
        rule_evidence,
        rule_fold_counts,
    )

    config = content["config"]
    points = points_from_record(content["points"])
    if phase != "knn-grid" and len(points) != 1:
        raise ValueError(f"phase {phase} takes one kNN configuration, got {len(points)}")
    model = build_algorithm("fedavg", spec.model_fn(), settings.run.training).global_model(weights)
    view = client_views(model, [client])[0]
    view.unseen = False  # only seen clients are asked
    if float(config.get("linear-l2", 0.0)) > 0:  # the rule phases under the linear base
        view = linear_base_views([view], float(config["linear-l2"]), points[0].normalize)[0]
    if phase == "knn-grid":
        return grid_counts(view, points)
    if phase == "knn-estimators":
        return estimator_counts(view, points[0], seed=settings.run.seed)
    if phase == "knn-l2":
        return l2_counts(normalized_views([view], points[0].normalize)[0])
    if phase == "knn-rule-folds":
        return rule_fold_counts(view, points[0], str(config["estimator"]), seed=settings.run.seed)
    if phase == "knn-rule-evidence":
        return rule_evidence(view, points[0], str(config["estimator"]))
    raise ValueError(f"unknown evaluation phase {phase!r}")
