"""The Flower ClientApp and ServerApp without a network: a Grid that hands each message to the
ClientApp in this process (one Context per node, kept across rounds as a SuperNode keeps it), so
the server's rounds, the clients' handlers and their errors are checked in seconds. The real
SuperLink and SuperNodes are exercised in test_flower_deploy.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict  # noqa: E402,E501
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fed_train.algorithms import build_algorithm  # noqa: E402
from fed_train.algorithms.base import TrainingConfig, get_weights  # noqa: E402
from fed_train.evaluation import client_accuracies  # noqa: E402
from fed_train.flower.client_data import load_node_client  # noqa: E402
from fed_train.flower.records import (  # noqa: E402
    ModelSpec,
    check_shapes,
    counts_record,
    join_state,
    split_state,
    to_array_record,
    to_weights,
)
from fed_train.flower.server_app import train_and_evaluate  # noqa: E402
from fed_train.flower.settings import FlowerConfigError, FlowerSettings  # noqa: E402
from fed_train.flower.strategy import FederationError  # noqa: E402
from fed_train.knn_choice import choose
from fed_train.knn_request import KNNRequest
from fed_train.models import build_model  # noqa: E402
from fed_train.partition import Partition  # noqa: E402
from fed_train.run import (  # noqa: E402
    RunConfig,
    initial_weights,
    load_run,
    load_run_data,
    prepare_clients,
    run_partition,
    train,
)
from fed_train.run_evaluation import evaluate_run  # noqa: E402
from fed_train.simulation import resume_from, simulate  # noqa: E402
from tests.helpers.flower_grid import InProcessGrid  # noqa: E402

CLIENTS = 3
TRAINING = TrainingConfig(
    rounds=2, epochs=1, batch_size=16, lr=0.05, momentum=0.9, milestones=(0.5,)
)


def _config(**changes) -> RunConfig:
    return replace(
        RunConfig(
            dataset="digits",
            clients=CLIENTS,
            unseen_fraction=0.34,
            checkpoint_every=1,
            training=TRAINING,
        ),
        **changes,
    )


@pytest.fixture(autouse=True)
def _task_identity():
    """Messages need a run and node id, which a real Flower process sets."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = None


def _settings(run_dir: Path, **changes) -> FlowerSettings:
    return replace(
        FlowerSettings(run=_config(), run_dir=str(run_dir), round_timeout=5.0, connect_timeout=5.0),
        **changes,
    )


def _nodes(count: int = CLIENTS) -> list[dict]:
    return [{"partition-id": i, "num-partitions": count} for i in range(count)]


@pytest.fixture(scope="module")
def flower_and_simulation(tmp_path_factory):
    root = tmp_path_factory.mktemp("flower")
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    settings = _settings(root / "flower")
    record = train_and_evaluate(InProcessGrid(settings.to_run_config(), _nodes()), settings)
    train(_config(), root / "sim", progress=False)
    return root, record


def test_flower_rounds_equal_the_simulation_bit_for_bit(flower_and_simulation):
    root, _ = flower_and_simulation
    flower, sim = load_run(root / "flower"), load_run(root / "sim")
    for name, w in get_weights(sim.model).items():
        np.testing.assert_array_equal(get_weights(flower.model)[name], w)
    assert (root / "flower" / "config.json").read_text() == (
        root / "sim" / "config.json"
    ).read_text()
    rows = [
        json.loads(line) for line in (root / "flower" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["round"] for r in rows] == [1, 2] and rows[0]["bytes_up"] > 0


def test_federated_knnper_evaluation_equals_server_side_evaluate(flower_and_simulation):
    root, record = flower_and_simulation
    server = evaluate_run(load_run(root / "flower"), ["fedavg", "knnper"], progress=False)
    federated = record["evaluation"]
    assert [c["client_id"] for c in federated["clients"]] == list(range(CLIENTS))
    assert any(c["unseen"] for c in federated["clients"])
    for mine, theirs in zip(federated["clients"], server["clients"], strict=True):
        assert mine["knnper_lambda"] == theirs["knnper_lambda"]
        for method in ("fedavg", "knnper"):
            assert abs(mine[method] - theirs[method]) <= 1e-6
    assert record["status"] == "completed"
    assert json.loads((root / "flower" / "flower.json").read_text())["evaluation"] == federated


def test_federated_knn_choice_equals_the_central_one(flower_and_simulation):
    """The configuration chosen from the clients' own sums is the one `knnper evaluate` would
    choose on the pooled validation splits: same point, same estimator, same scores."""
    root, record = flower_and_simulation
    run = load_run(root / "flower")
    central = choose(run.model, run.clients(), KNNRequest(), seed=run.config.seed)
    federated = record["knn"]
    assert federated["config"] == central.record["config"]
    assert federated["estimator"] == central.record["estimator"]
    assert federated["chosen_on"] == central.record["chosen_on"]
    assert federated["lambda_cv"] == pytest.approx(central.record["lambda_cv"])
    for mine, theirs in zip(federated["grid"], central.record["grid"], strict=True):
        assert mine == pytest.approx(theirs)


def test_a_client_lost_mid_run_counts_as_unsampled_when_the_minimum_allows(tmp_path):
    settings = _settings(tmp_path / "run", min_train_clients=1)
    # node 0 answers the query and round 1, then disappears
    grid = InProcessGrid(settings.to_run_config(), _nodes(), dead_after={0: 2})
    record = train_and_evaluate(grid, settings)
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["clients"] for r in rows] == [2, 1]
    assert record["evaluation"]["missing_clients"] == [0]


def test_a_client_lost_mid_run_stops_the_run_when_every_reply_is_needed(tmp_path):
    settings = _settings(tmp_path / "run")
    grid = InProcessGrid(settings.to_run_config(), _nodes(), dead_after={0: 2})
    with pytest.raises(
        FederationError,
        match=r"round 2: 1 of 2 sampled clients answered, 2 "
        r"needed \(client 0: no reply within 5 s\)",
    ):
        train_and_evaluate(grid, settings)


def test_a_partition_id_out_of_range_stops_the_run_before_training(tmp_path):
    settings = _settings(tmp_path / "run")
    nodes = _nodes()
    nodes[2] = {"partition-id": 7, "num-partitions": CLIENTS}
    with pytest.raises(
        FederationError, match="'partition-id' 7 is out of range: the run has clients 0 to 2"
    ):
        train_and_evaluate(InProcessGrid(settings.to_run_config(), nodes), settings)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_missing_supernode_is_reported_after_the_connect_timeout(tmp_path):
    settings = _settings(tmp_path / "run", connect_timeout=1.0)
    with pytest.raises(FederationError, match=r"no SuperNode serves client\(s\) \[2\]"):
        train_and_evaluate(InProcessGrid(settings.to_run_config(), _nodes()[:2]), settings)


def test_a_missing_data_dir_is_a_clear_error_on_the_node(tmp_path):
    node = {"partition-id": 0, "num-partitions": CLIENTS, "data-dir": str(tmp_path / "nope")}
    with pytest.raises(FlowerConfigError, match="'data-dir' .*nope is not a directory"):
        load_node_client(_config(), node, {}, 10)


def test_a_data_dir_client_equals_the_partition_client(tmp_path):
    config = _config()
    dataset, _ = load_run_data(config)
    partition = run_partition(config, dataset)
    split = partition.clients[1]
    for name, (x, y) in {
        "train": (dataset.x_train, dataset.y_train),
        "val": (dataset.x_train, dataset.y_train),
        "test": (dataset.x_test, dataset.y_test),
    }.items():
        idx = getattr(split, name)
        np.savez(tmp_path / f"{name}.npz", x=x[idx], y=y[idx])
    spec = json.loads(json.dumps(dataset.input_spec))
    from_files = load_node_client(
        config, {"partition-id": 1, "data-dir": str(tmp_path)}, spec, dataset.num_classes
    )
    expected = prepare_clients(dataset, partition)[1]
    for field in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
        assert np.array_equal(getattr(from_files, field).numpy(), getattr(expected, field).numpy())


def test_data_whose_shape_does_not_fit_the_model_is_refused(tmp_path):
    for name in ("train", "val", "test"):
        np.savez(
            tmp_path / f"{name}.npz", x=np.zeros((4, 28, 28, 1), np.uint8), y=np.zeros(4, np.int64)
        )
    dataset, _ = load_run_data(_config())
    with pytest.raises(FlowerConfigError, match="train inputs do not fit the model"):
        load_node_client(
            _config(),
            {"partition-id": 0, "data-dir": str(tmp_path)},
            json.loads(json.dumps(dataset.input_spec)),
            dataset.num_classes,
        )


def test_weights_of_another_model_are_refused_with_both_shapes():
    spec = ModelSpec(
        "small-cnn",
        10,
        {"kind": "image", "shape": [8, 8, 1], "dtype": "uint8", "mean": [0.0], "std": [1.0]},
    )
    other = ModelSpec("small-cnn", 5, spec.input_spec).shapes()
    with pytest.raises(
        ValueError,
        match=r"the server sent .* with shape \(5, \d+\), but this "
        r"side's model has \(10, \d+\)",
    ):
        check_shapes(other, spec.shapes(), sender="the server")


def test_a_client_answers_a_mismatched_model_with_an_error_reply(tmp_path):
    settings = _settings(tmp_path / "run")
    grid = InProcessGrid(settings.to_run_config(), _nodes())
    dataset, _ = load_run_data(_config())
    spec = ModelSpec("small-cnn", dataset.num_classes, json.loads(json.dumps(dataset.input_spec)))
    wrong = ModelSpec("small-cnn", 3, spec.input_spec).shapes()
    msg = Message(
        RecordDict(
            {
                "arrays": to_array_record(wrong),
                "model": spec.to_record(),
                "config": ConfigRecord({"lr": 0.1, "seed": 1, "round": 1}),
            }
        ),
        dst_node_id=100,
        message_type=MessageType.TRAIN,
    )
    [reply] = grid.send_and_receive([msg])
    assert reply.has_error() and "but this side's model has" in reply.error.reason


@pytest.mark.parametrize(
    "values, message",
    [
        ({"algorithm": "fedsgd"}, "unknown algorithm 'fedsgd'"),
        ({"algorithm": "local"}, "does not train federatedly"),
        ({"run": "{not json"}, "not a knnper run configuration"),
        ({"run": json.dumps({"clients": 3, "colour": 1})}, "unknown keys: colour"),
        ({"run-dir": ""}, "'run-dir'"),
        ({"round-timeout": -1.0}, "round-timeout must be a positive number"),
        ({"eval-methods": "fedavg,magic"}, "unknown evaluation method"),
        ({"k": -3}, "kNN settings: k must be an integer from 1"),
        ({"sigma": 1e40}, "kNN settings: sigma must be a number"),
        ({"lambda-rule": "median"}, "kNN settings: unknown lambda rule 'median'"),
        ({"knn-config": "best"}, "kNN settings: unknown kNN configuration 'best'"),
        ({"capacity": 1.5}, "capacity must be in \\(0, 1\\], got 1.5"),
    ],
)
def test_bad_run_config_is_a_clear_error(tmp_path, values, message):
    good = _settings(tmp_path).to_run_config()
    with pytest.raises(FlowerConfigError, match=message):
        FlowerSettings.from_run_config({**good, **values})


def test_settings_survive_the_run_config():
    settings = _settings(Path("/x"), algorithm="ditto", eval_methods=("ditto", "knnper"))
    assert FlowerSettings.from_run_config(settings.to_run_config()) == settings
    pinned = _settings(
        Path("/x"),
        knn=KNNRequest(
            "paper", k=7, sigma=0.5, normalize="l2", lambda_rule="pooled", base="linear"
        ),
    )
    back = FlowerSettings.from_run_config(pinned.to_run_config())
    assert back.knn == pinned.knn and back.knn.lambda_estimator is None


def test_client_state_keeps_arrays_on_the_node_and_sends_scalars():
    state = {
        "personal": {"10.0": {"w": np.ones((2, 3), np.float32)}, "0.1": {"w": np.zeros(2)}},
        "cluster": 2,
        "client_id": 5,
    }
    arrays, scalars = split_state(state)
    assert set(arrays) == {"personal/10.0/w", "personal/0.1/w"}
    assert dict(scalars) == {"cluster": 2, "client_id": 5}
    back = join_state(arrays, scalars)
    np.testing.assert_array_equal(back["personal"]["10.0"]["w"], state["personal"]["10.0"]["w"])
    assert back["cluster"] == 2


@pytest.mark.parametrize("algorithm", ["ditto", "fedrep", "clustered", "apfl", "pfedgp"])
def test_stateful_algorithms_run_on_flower_like_the_simulation(tmp_path, algorithm):
    """Personal state stays on the node between rounds (ClusteredFL's cluster index also goes
    to the server); the global state and the personalized accuracies equal the simulation's."""
    config = _config(clients=2, unseen_fraction=0.0)
    settings = _settings(
        tmp_path / "run", run=config, algorithm=algorithm, eval_methods=(algorithm,)
    )
    record = train_and_evaluate(InProcessGrid(settings.to_run_config(), _nodes(2)), settings)
    dataset, _ = load_run_data(config)
    clients = prepare_clients(dataset, Partition.load(tmp_path / "run" / "partition.npz"))
    algo = build_algorithm(
        algorithm,
        lambda: build_model("small-cnn", dataset.num_classes, dataset.input_spec),
        config.training,
    )
    sim = simulate(
        algo,
        clients,
        config.training,
        initial_weights(algo.model_fn, config.seed),
        seed=config.seed,
        progress=False,
    )
    flower = resume_from(tmp_path / "run")
    assert flower.rounds_done == config.training.rounds
    for name, w in sim.weights.items():
        np.testing.assert_array_equal(flower.weights[name], w)
    rows = client_accuracies(algo, sim.weights, sim.states, clients, seed=config.seed)
    assert [c[algorithm] for c in record["evaluation"]["clients"]] == [r["accuracy"] for r in rows]


def test_deploy_config_writes_the_run_config_flwr_run_takes(tmp_path, capsys):
    import tomllib

    from knnper_cli.main import main

    target = tmp_path / "run.toml"
    assert (
        main(
            [
                "deploy",
                "config",
                "--clients",
                "4",
                "--rounds",
                "3",
                "--algorithm",
                "ditto",
                "--out",
                str(tmp_path / "run"),
                "--write",
                str(target),
            ]
        )
        == 0
    )
    settings = FlowerSettings.from_run_config(tomllib.loads(target.read_text()))
    assert (settings.algorithm, settings.run.clients, settings.run.training.rounds) == (
        "ditto",
        4,
        3,
    )
    assert settings.run_dir == str(tmp_path / "run")


def test_deploy_certs_writes_private_keys_for_their_owner_only_and_never_overwrites(
    tmp_path, capsys
):
    from cryptography import x509

    from knnper_cli.main import main

    out = tmp_path / "pki"
    assert (
        main(
            [
                "deploy",
                "certs",
                "--host",
                "fl.example.org",
                "--supernode-keys",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    cert = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["fl.example.org"]
    for private in (out / "server.key", out / "supernodes" / "supernode-0"):
        assert private.stat().st_mode & 0o077 == 0
    before = (out / "server.key").read_bytes()
    assert main(["deploy", "certs", "--host", "other", "--out", str(out)]) == 2
    assert "never overwritten" in capsys.readouterr().err
    assert (out / "server.key").read_bytes() == before


class TamperingGrid(InProcessGrid):
    """Each reply passes through `tamper(message, reply)` on its way back, as a broken or
    hostile client would send it."""

    def __init__(
        self, run_config: dict, node_configs: list[dict], tamper: Callable[[Message, Message], None]
    ) -> None:
        super().__init__(run_config, node_configs)
        self.tamper = tamper

    def send_and_receive(self, messages, *, timeout=None):
        asked = {msg.metadata.dst_node_id: msg for msg in messages}
        replies = super().send_and_receive(messages, timeout=timeout)
        for reply in replies:
            self.tamper(asked[reply.metadata.src_node_id], reply)
        return replies


def test_a_client_sending_another_models_weights_is_refused_by_the_server(tmp_path):
    settings = _settings(tmp_path / "run")

    def other_model(msg: Message, reply: Message) -> None:
        if reply.metadata.src_node_id == 101 and reply.metadata.message_type == "train":
            spec = ModelSpec.from_record(msg.content["model"])
            reply.content["arrays"] = to_array_record(
                ModelSpec(spec.name, 3, spec.input_spec).shapes()
            )

    grid = TamperingGrid(settings.to_run_config(), _nodes(), other_model)
    with pytest.raises(
        FederationError,
        match=r"client 1: unusable reply: client 1 sent "
        r"classifier\.\w+ with shape \(3",
    ):
        train_and_evaluate(grid, settings)


def test_a_clustered_client_claiming_a_cluster_that_does_not_exist_is_refused(tmp_path):
    """ClusteredFL's server reads a client's id and cluster from its reply: a crafted one is an
    unusable reply (one line), never a crash of the server or a membership it did not give."""
    settings = _settings(tmp_path / "run", algorithm="clustered")

    def crafted(msg: Message, reply: Message) -> None:
        if reply.metadata.src_node_id == 101 and reply.metadata.message_type == "train":
            reply.content["state"] = ConfigRecord({"client_id": 1, "cluster": "x"})

    grid = TamperingGrid(settings.to_run_config(), _nodes(), crafted)
    with pytest.raises(
        FederationError,
        match=r"client 1: unusable reply: its state's cluster "
        r"'x' is not one of the 1 clusters",
    ):
        train_and_evaluate(grid, settings)


def _scaled_weights(value: float):
    def tamper(msg: Message, reply: Message) -> None:
        weights = to_weights(reply.content["arrays"])
        name = next(iter(weights))
        weights[name] = np.full_like(np.asarray(weights[name]), value)
        reply.content["arrays"] = to_array_record(weights)

    return tamper


def _train_loss(value: float):
    def tamper(msg: Message, reply: Message) -> None:
        reply.content["metrics"]["train-loss"] = value

    return tamper


@pytest.mark.parametrize(
    ("tamper", "needle"),
    [
        (_scaled_weights(float("nan")), "are not finite or past"),
        (_scaled_weights(3e38), "are not finite or past"),  # finite, but the mean overflows
        (_train_loss(float("nan")), "training loss of nan"),  # metrics.jsonl could not resume
    ],
)
def test_a_client_sending_weights_or_a_loss_no_mean_can_take_is_refused(tmp_path, tamper, needle):
    """They were aggregated, and the next round failed every client with "lower the learning
    rate"."""
    settings = _settings(tmp_path / "run")

    def hostile(msg: Message, reply: Message) -> None:
        if reply.metadata.src_node_id == 101 and reply.metadata.message_type == "train":
            tamper(msg, reply)

    grid = TamperingGrid(settings.to_run_config(), _nodes(), hostile)
    with pytest.raises(FederationError, match=f"client 1: unusable reply: .*{needle}"):
        train_and_evaluate(grid, settings)


def test_an_evaluation_reply_claiming_other_test_counts_is_left_out(tmp_path):
    """num-examples 10^15 weighted the federated mean (52.6% -> 73.0%)."""
    settings = _settings(tmp_path / "run")

    def inflated(msg: Message, reply: Message) -> None:
        if (
            reply.metadata.message_type == "evaluate"
            and reply.metadata.src_node_id == 102
            and msg.content["config"].get("phase") is None
        ):
            reply.content["metrics"]["num-examples"] = 10**15

    record = train_and_evaluate(
        TamperingGrid(settings.to_run_config(), _nodes(), inflated), settings
    )
    assert record["evaluation"]["missing_clients"] == [2]


def test_unusable_sums_or_rows_leave_their_client_out_and_the_run_goes_on(tmp_path):
    """Sums of another shape keep a client out of the kNN-Per choice; a row whose choices JSON
    cannot hold keeps a client out of the evaluation; neither stops the run."""
    settings = _settings(tmp_path / "run")
    tampered: dict[str, int] = {}

    def hostile(msg: Message, reply: Message) -> None:
        if reply.metadata.message_type != "evaluate":
            return
        node, phase = reply.metadata.src_node_id, msg.content["config"].get("phase")
        if phase == "knn-grid" and "sums" not in tampered:
            tampered["sums"] = node - 100
            reply.content["counts"] = counts_record("knn-grid", np.ones((1, 3)))
        elif phase is None and node == 102:
            reply.content["info"] = ConfigRecord({"knnper/lambda": b"0.5"})

    record = train_and_evaluate(
        TamperingGrid(settings.to_run_config(), _nodes(), hostile), settings
    )
    assert record["status"] == "completed"
    chosen_on = record["knn"]["chosen_on"]["clients"]
    assert chosen_on and tampered["sums"] not in chosen_on
    assert record["evaluation"]["missing_clients"] == [2]


def test_a_node_claiming_a_client_outside_the_run_is_refused(tmp_path):
    settings = _settings(tmp_path / "run")

    def impostor(msg: Message, reply: Message) -> None:
        if reply.metadata.src_node_id == 102:
            reply.content["metrics"]["client-id"] = 99

    with pytest.raises(
        FederationError,
        match=r"SuperNode 102 cannot serve a client: unusable "
        r"reply: client 99 with \d+ training samples is "
        r"not one of the run's clients 0 to 2",
    ):
        train_and_evaluate(TamperingGrid(settings.to_run_config(), _nodes(), impostor), settings)


def test_a_failed_flower_run_resumes_from_its_checkpoint_to_the_simulations_result(
    flower_and_simulation, tmp_path
):
    settings = _settings(tmp_path / "run")
    with pytest.raises(FederationError):  # client 0 vanishes after round 1: round 2 fails
        train_and_evaluate(
            InProcessGrid(settings.to_run_config(), _nodes(), dead_after={0: 2}), settings
        )
    train_and_evaluate(InProcessGrid(settings.to_run_config(), _nodes()), settings)
    root, _ = flower_and_simulation
    resumed, sim = (
        get_weights(load_run(tmp_path / "run").model),
        get_weights(load_run(root / "sim").model),
    )
    for name, w in sim.items():
        np.testing.assert_array_equal(resumed[name], w)
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["round"] for r in rows] == [1, 2]


def test_a_failed_run_says_why_in_flower_json(tmp_path):
    """`flwr run` only reports "failed": the run directory keeps the reason, in one line."""
    from fed_train.flower.server_app import main as server_main

    settings = _settings(tmp_path / "run", connect_timeout=1.0)
    run_config = settings.to_run_config()
    grid = InProcessGrid(run_config, _nodes()[:1])
    context = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config
    )
    with pytest.raises(FederationError):
        server_main(grid, context)
    record = json.loads((tmp_path / "run" / "flower.json").read_text())
    assert record["status"] == "failed"
    assert record["error"].startswith("after 1 s no SuperNode serves client(s) [1, 2]")


def test_each_round_logs_the_clients_training_time_and_deploy_splits_it(flower_and_simulation):
    from fed_train.deploy import rounds_logged
    from knnper_cli.deploy import round_split

    root, _ = flower_and_simulation
    rows = rounds_logged(root / "flower")
    for row in rows:
        assert 0 < row["train_seconds_max"] <= row["train_seconds"] <= row["seconds"]
    wall = sum(r["seconds"] for r in rows) / len(rows)
    slowest = sum(r["train_seconds_max"] for r in rows) / len(rows)
    summed = sum(r["train_seconds"] for r in rows) / len(rows)
    line = round_split(rows)
    assert f"mean of {len(rows)}): {wall:.1f} s on Flower = {slowest:.2f} s of training" in line
    assert f"({summed:.2f} s summed over the clients" in line
    assert f"+ {max(0.0, wall - slowest):.1f} s Flower's floor" in line
