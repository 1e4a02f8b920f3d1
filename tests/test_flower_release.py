"""The device lifecycle on Flower (`knnper deploy release`): each SuperNode builds its bundle
from its own data and learns, then upgrades it in place after a second training, and only
counts, accuracies and versions leave it. The fast tests pin the message checks that keep
samples on the nodes; the slow one runs the lifecycle on a real local federation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from edge_runtime.runtime import Runtime  # noqa: E402
from fed_train.flower.client_data import node_splits  # noqa: E402
from fed_train.flower.release import (  # noqa: E402
    MAX_FILES,
    REPLY_METRICS,
    REPLY_TEXTS,
    ReleaseError,
    node_reply,
    read_reply,
    write_release,
)
from fed_train.flower.server_app import push_release  # noqa: E402
from fed_train.flower.settings import FlowerSettings  # noqa: E402
from fed_train.flower.strategy import FederationError  # noqa: E402
from fed_train.run import RunConfig, read_config  # noqa: E402
from knnper_cli.main import main  # noqa: E402
from tests.helpers.flower_grid import InProcessGrid  # noqa: E402


@pytest.fixture
def task_identity():
    """Messages need a run and node id, which a real Flower process sets."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = None


def _sent(content: RecordDict) -> Message:
    """A node's reply as the server receives it."""
    request = Message(RecordDict(), dst_node_id=1, message_type="train.release")
    return Message(content, reply_to=request)


def test_a_release_reply_carries_only_the_listed_scalars(task_identity):
    reply = node_reply(_sent(RecordDict()), {"client-id": 3, "stored": 10}, {"version": "v"})
    assert read_reply(_sent(reply.content)) == {"client-id": 3, "stored": 10, "version": "v"}
    with pytest.raises(ReleaseError, match="not part of a release reply"):
        node_reply(_sent(RecordDict()), {"x-train": 1.0}, {})


@pytest.mark.parametrize(
    "content",
    [
        # an array record beside the expected ones: where samples would travel
        RecordDict(
            {
                "metrics": MetricRecord({"stored": 1}),
                "versions": ConfigRecord({}),
                "samples": ArrayRecord({"x": Array(np.zeros((4, 64), np.uint8))}),
            }
        ),
        # a list of numbers under a listed name, or an unlisted metric
        RecordDict({"metrics": MetricRecord({"stored": [1, 2, 3]}), "versions": ConfigRecord({})}),
        RecordDict({"metrics": MetricRecord({"pixel-0": 3}), "versions": ConfigRecord({})}),
        # bytes, or a long text, among the versions
        RecordDict({"metrics": MetricRecord({}), "versions": ConfigRecord({"version": b"x"})}),
        RecordDict({"metrics": MetricRecord({}), "versions": ConfigRecord({"how": "x" * 999})}),
    ],
)
def test_the_server_refuses_a_reply_that_could_carry_samples(task_identity, content):
    with pytest.raises(ReleaseError):
        read_reply(_sent(content))


@pytest.mark.parametrize(
    "name", ["../encoder.onnx", "client/../x", "client/sub/x", "other/x", ".hidden", "client/"]
)
def test_a_node_refuses_release_files_with_path_tricks(tmp_path, name):
    files = ConfigRecord({name: b"data", "encoder.onnx": b"e", "client/manifest.json": b"{}"})
    with pytest.raises(ReleaseError, match="refused name"):
        write_release(files, tmp_path)
    assert not (tmp_path.parent / "encoder.onnx").exists()


def test_a_node_refuses_more_files_than_a_release_has(tmp_path):
    files = ConfigRecord({f"upgrades/from-{i}.npz": b"" for i in range(MAX_FILES + 1)})
    with pytest.raises(ReleaseError, match="files, over"):
        write_release(files, tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "release,run,message",
    [
        ("run", "run", "is not a release (no export.json)"),
        ("release", "elsewhere", "config.json is not readable JSON"),
        ("partial", "run", "holds no bundle for client(s) [1, 2]"),
    ],
)
def test_a_bad_release_push_fails_in_one_line_before_any_process(
    tmp_path, capsys, release, run, message
):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps({"dataset": "digits", "clients": 3}))
    for name, clients in (("release", 3), ("partial", 1)):
        for cid in range(clients):
            (tmp_path / name / f"client_{cid:04d}").mkdir(parents=True)
        (tmp_path / name / "export.json").write_text("{}")
    argv = ["deploy", "release", str(tmp_path / release), "--run", str(tmp_path / run)]
    code = main([*argv, "--bundle-dir", str(tmp_path / "d"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "d").exists()


# --- the lifecycle on a real local federation ---------------------------------------------

TRAIN = ["--dataset", "digits", "--clients", "3", "--rounds", "2", "--unseen-fraction", "0"]
EXPORT = ["--budget", "200kB", "--device-extras", "none", "--workers", "1"]


def _knnper(*argv: str) -> None:
    assert main(["--threads", "1", "--no-progress", *argv]) == 0


def _push(root: Path, release: str, run: str, out: str) -> dict:
    _knnper(
        "deploy",
        "release",
        str(root / release),
        "--run",
        str(root / run),
        "--bundle-dir",
        str(root / "devices"),
        "--keep-inputs",
        "--round-timeout",
        "120",
        "--out",
        str(root / out),
    )
    return json.loads((root / out / "flower.json").read_text())


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    """Release 1 from a training, pushed to the nodes (they build and learn); release 2 from a
    training continued from the first, exported with the map, pushed again (they upgrade).
    The trainings run in the simulation, which reaches the Flower run's weights."""
    if shutil.which("flower-superlink") is None or shutil.which("flower-supernode") is None:
        pytest.skip("flwr's executables are not on PATH")
    root = tmp_path_factory.mktemp("lifecycle")
    _knnper(
        "pretrain", "--dataset", "digits", "--server-fraction", "0.2", "--epochs", "2",
        "--out", str(root / "pre"),
    )  # fmt: skip
    _knnper("train", *TRAIN, "--init", str(root / "pre"), "--out", str(root / "v1"))
    _knnper("export", str(root / "v1"), "--out", str(root / "rel1"), *EXPORT)
    built = _push(root, "rel1", "v1", "push1")
    after_build = {
        cid: Runtime.load(root / "devices" / f"node-{cid}").datastore.labels_.copy()
        for cid in range(3)
    }
    _knnper("train", *TRAIN, "--continue-from", str(root / "v1"), "--out", str(root / "v2"))
    _knnper(
        "export", str(root / "v2"), "--out", str(root / "rel2"), *EXPORT,
        "--upgrade-from", str(root / "rel1"),
    )  # fmt: skip
    upgraded = _push(root, "rel2", "v2", "push2")
    return root, built, upgraded, after_build


def _splits(run: Path, cid: int) -> dict:
    """Client `cid`'s raw splits as its node draws them."""
    saved = read_config(run)
    config = RunConfig.from_dict(saved)
    return node_splits(config, {"partition-id": cid}, saved["input_spec"], saved["num_classes"])


def _release_version(release: Path) -> dict:
    return json.loads((release / "export.json").read_text())["model"]


@pytest.mark.slow
def test_nodes_build_their_bundles_from_their_own_data_and_learn(lifecycle):
    root, built, _, _ = lifecycle
    assert built["status"] == "completed" and built["superlink_run"]["status"].endswith("completed")
    encoder = _release_version(root / "rel1")["embedding"][:12]
    for cid in range(3):
        row = built["nodes"][str(cid)]
        val = _splits(root / "v1", cid)["val"]
        assert row["built"] == 1 and row["added"] == len(val[1]) > 0
        assert row["version"] == f"run v1 round 2 encoder {encoder}"
        assert 0.5 < row["test-accuracy"] <= 1.0


@pytest.mark.slow
def test_nodes_upgrade_in_place_and_keep_every_sample_they_learned(lifecycle):
    root, built, upgraded, after_build = lifecycle
    assert upgraded["status"] == "completed"
    new = _release_version(root / "rel2")
    for cid in range(3):
        row = upgraded["nodes"][str(cid)]
        assert row["upgraded"] == 1 and row["how"] == "re-embedded"
        assert row["version-before"] == built["nodes"][str(cid)]["version"]
        assert row["version"] == f"run v2 round 2 encoder {new['embedding'][:12]}"
        # every sample the node stored before, its validation split that `add` taught it
        # last among them, is still there in the same order
        assert row["carried"] == row["stored"] == len(after_build[cid])
        runtime = Runtime.load(root / "devices" / f"node-{cid}")
        assert runtime.manifest["model"] == new
        labels = runtime.datastore.labels_
        np.testing.assert_array_equal(labels, after_build[cid])
        val_y = _splits(root / "v2", cid)["val"][1]
        np.testing.assert_array_equal(labels[-len(val_y) :], val_y)


@pytest.mark.slow
def test_no_sample_leaves_a_node(lifecycle):
    """Every reply the server kept holds listed scalars only, and all that the nodes sent
    the SuperLink in a push (their query and release replies) is smaller than one node's
    training inputs."""
    root, built, upgraded, _ = lifecycle
    smallest = min(_splits(root / "v1", cid)["train"][0].nbytes for cid in range(3))
    for push in (built, upgraded):
        for row in push["nodes"].values():
            assert set(row) <= set(REPLY_METRICS) | set(REPLY_TEXTS)
            assert all(isinstance(v, int | float | str) for v in row.values())
        assert push["superlink_run"]["network-traffic"]["inbound-bytes"] < smallest


def _push_in_process(root: Path, run_dir: Path, nodes: list[dict]) -> dict:
    """Release 2 pushed again, through a Grid in this process (tests.helpers.flower_grid)."""
    settings = FlowerSettings(
        run=RunConfig.from_dict(read_config(root / "v2")),
        run_dir=str(run_dir),
        release=str(root / "rel2"),
        keep_inputs=True,
        round_timeout=60.0,
        connect_timeout=5.0,
    )
    run_dir.mkdir()
    return push_release(InProcessGrid(settings.to_run_config(), nodes), settings)


@pytest.mark.slow
def test_a_node_already_on_the_release_keeps_its_bundle_as_it_is(
    lifecycle, task_identity, tmp_path
):
    root, _, upgraded, _ = lifecycle
    devices = root / "devices"
    before = {cid: (devices / f"node-{cid}" / "manifest.json").read_bytes() for cid in range(3)}
    nodes = [
        {"partition-id": cid, "num-partitions": 3, "bundle-dir": str(devices / f"node-{cid}")}
        for cid in range(3)
    ]
    record = _push_in_process(root, tmp_path / "again", nodes)
    for cid in range(3):
        row, last = record["nodes"][cid], upgraded["nodes"][str(cid)]
        assert (row["built"], row["upgraded"], row["how"]) == (0, 0, "already this version")
        assert (row["version"], row["stored"]) == (last["version"], last["stored"])
        assert (devices / f"node-{cid}" / "manifest.json").read_bytes() == before[cid]


@pytest.mark.slow
def test_a_node_without_a_bundle_dir_stops_the_push_with_one_line(
    lifecycle, task_identity, tmp_path
):
    root = lifecycle[0]
    nodes = [{"partition-id": cid, "num-partitions": 3} for cid in range(3)]
    with pytest.raises(FederationError, match="node config has no 'bundle-dir'"):
        _push_in_process(root, tmp_path / "nowhere", nodes)
