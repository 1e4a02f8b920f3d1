"""The device lifecycle on Flower (`knnper deploy release`): each SuperNode builds its bundle
from its own data and learns, then upgrades it in place after a second training, and only
counts, accuracies and versions leave it. The fast tests pin the message checks that keep
samples on the nodes; the slow one runs the lifecycle on a real local federation."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from edge_runtime.release import Release, read_release, write_release  # noqa: E402
from edge_runtime.runtime import Runtime  # noqa: E402
from edge_runtime.versions import ModelVersion  # noqa: E402
from fed_train.flower.client_data import node_splits  # noqa: E402
from fed_train.flower.release_push import (  # noqa: E402
    MAX_FILES,
    REPLY_METRICS,
    REPLY_TEXTS,
    PushError,
    node_reply,
    read_reply,
    write_pushed_files,
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


GOOD_REPLY = {"client-id": 3, "built": 1, "upgraded": 0, "stored": 10}


def test_a_release_reply_carries_only_the_listed_scalars(task_identity):
    reply = node_reply(_sent(RecordDict()), GOOD_REPLY, {"version": "v"})
    assert read_reply(_sent(reply.content)) == {**GOOD_REPLY, "version": "v"}
    with pytest.raises(PushError, match="not part of a release reply"):
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
    with pytest.raises(PushError):
        read_reply(_sent(content))


@pytest.mark.parametrize(
    "metrics",
    [
        {**GOOD_REPLY, "test-accuracy": float("nan")},
        {key: v for key, v in GOOD_REPLY.items() if key != "built"},  # a KeyError in the table
        {**GOOD_REPLY, "lambda": -1e300},
        {**GOOD_REPLY, "stored": 2.5},
        {**GOOD_REPLY, "upgraded": 7},
    ],
)
def test_the_server_refuses_a_tampered_reply_in_one_line(task_identity, metrics):
    content = RecordDict({"metrics": MetricRecord(metrics), "versions": ConfigRecord({})})
    with pytest.raises(PushError) as err:
        read_reply(_sent(content))
    assert "\n" not in str(err.value)


def test_a_forged_version_text_stays_in_its_cell(tmp_path):
    from knnper_cli.deploy import format_release_table

    forged = "v1 |\n| 9 | /etc | built | 1 | - | - | - | 100.0 | owned"
    rows = {0: {**GOOD_REPLY, "upgraded": 1, "built": 0, "how": "mapped|x", "version": forged}}
    table = format_release_table(rows, tmp_path).splitlines()
    assert len(table) == 3 and table[2].count(" | ") == table[0].count(" | ")
    assert "v1 \\|\\n\\| 9" in table[2]


@pytest.mark.parametrize(
    "name", ["../encoder.onnx", "client/../x", "client/sub/x", "other/x", ".hidden", "client/"]
)
def test_a_node_refuses_release_files_with_path_tricks(tmp_path, name):
    files = ConfigRecord({name: b"data", "encoder.onnx": b"e", "client/manifest.json": b"{}"})
    with pytest.raises(PushError, match="refused name"):
        write_pushed_files(files, tmp_path)
    assert not (tmp_path.parent / "encoder.onnx").exists()


def test_a_node_refuses_more_files_than_a_release_has(tmp_path):
    files = ConfigRecord({f"upgrades/from-{i}.npz": b"" for i in range(MAX_FILES + 1)})
    with pytest.raises(PushError, match="files, over"):
        write_pushed_files(files, tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "release,run,extra,message",
    [
        ("run", "run", [], "is not a release (no export.json)"),
        ("release", "elsewhere", [], "config.json is not readable JSON"),
        ("partial", "run", [], "holds no bundle for client(s) [1, 2]"),
        ("damaged", "run", [], "export.json: 'run' must be a string"),
        ("release", "run", ["--trusted-key", "run/config.json"], "is not a PEM public key"),
        ("release", "run", ["--out", "run/out-\udcff"], "is not UTF-8"),  # no TOML spelling
    ],
)
def test_a_bad_release_push_fails_in_one_line_before_any_process(
    tmp_path, capsys, release, run, extra, message
):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps({"dataset": "digits", "clients": 3}))
    version = ModelVersion("b" * 64, "run", 1, "a" * 64)
    for name, clients in (("release", 3), ("partial", 1), ("damaged", 3)):
        for cid in range(clients):
            (tmp_path / name / f"client_{cid:04d}").mkdir(parents=True)
        write_release(tmp_path / name, Release("run", version, tuple(range(clients))))
    (tmp_path / "damaged" / "export.json").write_text("{}")  # no release's record
    argv = ["deploy", "release", str(tmp_path / release), "--run", str(tmp_path / run)]
    argv += [str(tmp_path / a) if a.startswith("run/") else a for a in extra]
    out = [] if "--out" in extra else ["--out", str(tmp_path / "out")]
    code = main([*argv, "--bundle-dir", str(tmp_path / "d"), *out])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "d").exists()
    assert not (tmp_path / "run" / "out-\udcff").exists()


# what breaks a quoted value of flwr's --node-config parser, or TOML's strings, or argv
HOSTILE_NAMES = [
    'quote"d',
    'x" trusted-key="/evil',
    "a=b,c",
    "two words",
    "line\nbreak",
    "back\\slash",
    "it's",
    "tab\tand\x7fdel",
    "é ü",
    "\udcff-no-utf8",
    "ends in space ",
    "k.toml",
]


@pytest.mark.parametrize("name", [n for n in HOSTILE_NAMES if "\udcff" not in n])  # a UTF-8 file
def test_the_flwr_connection_file_holds_a_hostile_ca_path_whole(tmp_path, name):
    """The CA certificate lies under TMPDIR: a `"` or a backslash there broke the TOML file
    the `flwr` commands read (or turned into another value)."""
    import tomllib

    from fed_train.deploy import _connection_toml

    ca = tmp_path / name / "ca.pem"
    parsed = tomllib.loads(_connection_toml(9092, ca))
    assert parsed["superlink"]["knnper-local"]["root-certificates"] == str(ca)


def test_hostile_paths_reach_each_node_as_they_are(tmp_path):
    """flwr's own parser, in a process of its own given the argv a SuperNode gets, returns
    every bundle directory and key path whole, with no key added, and the node reads its key
    there."""
    import subprocess
    import sys

    pytest.importorskip("cryptography")
    from edge_runtime.signing import generate_key_pair
    from fed_train.deploy import LocalFederation, node_bundle_dir, node_config
    from fed_train.flower.device_release import node_trusted_keys

    generate_key_pair(tmp_path / "key.pem", tmp_path / "key.pub")
    (tmp_path / "keys").mkdir()
    federations = []
    for name in HOSTILE_NAMES:
        key = tmp_path / "keys" / name.replace("/", "|")  # the key's own name ends as the path
        shutil.copyfile(tmp_path / "key.pub", key)
        federations.append(LocalFederation(clients=2, bundle_dir=tmp_path / name, trusted_key=key))
    parse = (
        "import json, sys; from flwr.common.config import parse_config_args; "
        "print(json.dumps([parse_config_args([a]) for a in sys.argv[1:]]))"
    )
    argv = [sys.executable, "-c", parse, *(node_config(f, 1) for f in federations)]
    parsed = json.loads(subprocess.run(argv, capture_output=True, check=True, timeout=60).stdout)
    for federation, config in zip(federations, parsed, strict=True):
        assert config == {
            "partition-id": 1,
            "num-partitions": 2,
            "device": "cpu",
            "bundle-dir": str(node_bundle_dir(federation.bundle_dir.resolve(), 1)),
            "trusted-key": str(federation.trusted_key.resolve()),
        }
        assert len(node_trusted_keys(config)) == 1


# --- the lifecycle on a real local federation ---------------------------------------------

TRAIN = ["--dataset", "digits", "--clients", "3", "--rounds", "2", "--unseen-fraction", "0"]
EXPORT = ["--budget", "200kB", "--device-extras", "none", "--workers", "1"]


def _knnper(*argv: str) -> None:
    assert main(["--threads", "1", "--no-progress", *argv]) == 0


def _push(root: Path, release: str, run: str, out: str, *extra: str) -> dict:
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
        *extra,
    )
    return json.loads((root / out / "flower.json").read_text())


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    """Release 1 from a training, pushed to the nodes (they build and learn); release 2 from a
    training continued from the first, exported with the map and signed, pushed again to
    nodes that trust its key (they verify it, then upgrade). The trainings run in the
    simulation, which reaches the Flower run's weights."""
    if shutil.which("flower-superlink") is None or shutil.which("flower-supernode") is None:
        pytest.skip("flwr's executables are not on PATH")
    pytest.importorskip("cryptography")
    from edge_runtime.signing import generate_key_pair

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
    generate_key_pair(root / "keys" / "signing.pem", root / "keys" / "signing.pub")
    _knnper(
        "export", str(root / "v2"), "--out", str(root / "rel2"), *EXPORT,
        "--upgrade-from", str(root / "rel1"), "--signing-key", str(root / "keys" / "signing.pem"),
    )  # fmt: skip
    upgraded = _push(root, "rel2", "v2", "push2", "--trusted-key", str(root / "keys/signing.pub"))
    return root, built, upgraded, after_build


def _splits(run: Path, cid: int) -> dict:
    """Client `cid`'s raw splits as its node draws them."""
    saved = read_config(run)
    config = RunConfig.from_dict(saved)
    return node_splits(config, {"partition-id": cid}, saved["input_spec"], saved["num_classes"])


def _release_version(release: Path) -> dict:
    return read_release(release).model.to_record()


@pytest.mark.slow
def test_nodes_build_their_bundles_from_their_own_data_and_learn(lifecycle):
    root, built, _, _ = lifecycle
    assert built["status"] == "completed" and built["superlink_run"]["status"].endswith("completed")
    encoder = _release_version(root / "rel1")["embedding"][:12]
    for cid in range(3):
        row = built["nodes"][str(cid)]
        val = _splits(root / "v1", cid)["val"]
        assert row["built"] == 1 and row["added"] == len(val[1]) > 0
        assert row["version"] == f"run v1 round 2 (encoder {encoder})"
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
        assert row["version"] == f"run v2 round 2 (encoder {new['embedding'][:12]})"
        # every sample the node stored before, its validation split that `add` taught it
        # last among them, is still there in the same order
        assert row["carried"] == row["stored"] == len(after_build[cid])
        # the nodes verified the signed release; the bundle stays the node's own: unsigned
        runtime = Runtime.load(root / "devices" / f"node-{cid}")
        assert not (runtime.path / "signature.json").exists()
        assert runtime.manifest.model.to_record() == new
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


def _nodes(root: Path, **config: str) -> list[dict]:
    """The node configs of the federation's three nodes."""
    return [
        {
            "partition-id": cid,
            "num-partitions": 3,
            "bundle-dir": str(root / "devices" / f"node-{cid}"),
            **config,
        }
        for cid in range(3)
    ]


def _push_in_process(root: Path, run_dir: Path, nodes: list[dict]) -> dict:
    """Release 2 pushed again as a federation of one's own runs it: the run config `knnper
    deploy config --release` writes, through a Grid in this process (tests.helpers.flower_grid)."""
    import tomllib

    toml = run_dir.parent / f"{run_dir.name}.toml"
    _knnper(
        "deploy", "config", "--release", str(root / "rel2"), "--run", str(root / "v2"),
        "--keep-inputs", "--round-timeout", "60", "--connect-timeout", "5",
        "--out", str(run_dir), "--write", str(toml),
    )  # fmt: skip
    values = tomllib.loads(toml.read_text())
    settings = FlowerSettings.from_run_config(values)
    assert (settings.release, settings.keep_inputs) == (str(root / "rel2"), True)
    run_dir.mkdir()
    return push_release(InProcessGrid(values, nodes), settings)


@pytest.mark.slow
def test_a_node_already_on_the_release_keeps_its_bundle_as_it_is(
    lifecycle, task_identity, tmp_path
):
    root, _, upgraded, _ = lifecycle
    devices = root / "devices"
    before = {cid: (devices / f"node-{cid}" / "manifest.json").read_bytes() for cid in range(3)}
    record = _push_in_process(root, tmp_path / "again", _nodes(root))
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


@pytest.mark.slow
def test_nodes_that_trust_another_key_refuse_the_signed_release(lifecycle, task_identity, tmp_path):
    from edge_runtime.signing import generate_key_pair

    root = lifecycle[0]
    generate_key_pair(tmp_path / "other.pem", tmp_path / "other.pub")
    devices = root / "devices"
    before = {cid: (devices / f"node-{cid}" / "manifest.json").read_bytes() for cid in range(3)}
    nodes = _nodes(root, **{"trusted-key": str(tmp_path / "other.pub")})
    with pytest.raises(FederationError, match="refused the release: .*which is not trusted") as e:
        _push_in_process(root, tmp_path / "push", nodes)
    assert str(e.value).count("client ") == 3 and "\n" not in str(e.value)
    assert ".release-" not in str(e.value)  # the release's files, not the node's scratch
    for cid in range(3):
        assert (devices / f"node-{cid}" / "manifest.json").read_bytes() == before[cid]


# --- a node verifies a signed release before it builds or upgrades (no Flower process) ----


def _tiny_release(root: Path, name: str, encoder: Path, key: Path | None) -> Path:
    """An export's layout (encoder.onnx, client_0003/) of the tests' tiny image encoder,
    recording its model version; signed with the private key `key` where given."""
    from edge_runtime.bundle import write_bundle
    from edge_runtime.datastores import make_datastore
    from edge_runtime.signing import load_private_key, sign_file
    from edge_runtime.versions import ModelVersion
    from tests.helpers.bundles import FIELDS, NUM_CLASSES, make_images, raw_outputs

    x, y = make_images(60, seed=5)
    ds = make_datastore("flat:fp32", NUM_CLASSES, k=5).fit(raw_outputs(encoder, x)[0], y)
    model = {"run": name, "round": 1, "weights_sha256": "0" * 64}
    model["embedding"] = ModelVersion.of_encoder(encoder.read_bytes()).embedding
    signing_key = None if key is None else load_private_key(key)
    release = root / name
    release.mkdir()
    write_bundle(
        release / "client_0003",
        dataclasses.replace(FIELDS, model=ModelVersion.from_record(model)),
        encoder,
        ds,
        signing_key=signing_key,
    )
    shutil.copyfile(encoder, release / "encoder.onnx")
    if signing_key is not None:  # as `knnper export --signing-key` signs its shared encoder
        sign_file(release / "encoder.onnx", signing_key)
    return release


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two versions of a tiny release (v1 signed by `a`, v2 by `a` and, apart, by `b`, and
    unsigned) and a node's own splits."""
    pytest.importorskip("cryptography")
    from edge_runtime.signing import generate_key_pair
    from tests.helpers.bundles import make_image_encoder, make_images

    root = tmp_path_factory.mktemp("tiny")
    for key in ("a", "b"):
        generate_key_pair(root / f"{key}.pem", root / f"{key}.pub")
    old = make_image_encoder(root / "old.onnx", seed=0)
    new = make_image_encoder(root / "new.onnx", seed=1)
    for name, encoder, key in (
        ("v1", old, "a"),
        ("v2", new, "a"),
        ("v2-by-b", new, "b"),
        ("v2-unsigned", new, None),
    ):
        _tiny_release(root, name, encoder, None if key is None else root / f"{key}.pem")
    splits = {"train": make_images(60, 1), "val": make_images(10, 2), "test": make_images(20, 3)}
    return root, splits


def _bring(tiny, release: str, bundle: Path, key: str | None, edit=None) -> tuple[dict, dict]:
    """bring_to_release on the node of client 3 that trusts `key` (None: no key), with the
    release's files as the server sends them, changed by `edit` on the way."""
    from fed_train.flower.device_release import bring_to_release, node_trusted_keys
    from fed_train.flower.release_push import release_files

    root, splits = tiny
    files = release_files(root / release, 3)
    if edit is not None:
        edit(files)
    config = {} if key is None else {"trusted-key": str(root / f"{key}.pub")}
    return bring_to_release(
        files,
        bundle,
        splits,
        client_id=3,
        keep_inputs=True,
        force=False,
        seed=0,
        trusted_keys=node_trusted_keys(config),
    )


def _flip_last_byte(name: str):
    def edit(files: ConfigRecord) -> None:
        data = files[name]
        files[name] = data[:-1] + bytes([data[-1] ^ 1])

    return edit


def _drop(name: str):
    def edit(files: ConfigRecord) -> None:
        del files[name]

    return edit


def _flip_the_shared_encoder_only(files: ConfigRecord) -> None:
    """The client's encoder sent apart (as the linear base's own is), the release's altered:
    its own signature, not the client bundle's, catches it."""
    files["client/encoder.onnx"] = files["encoder.onnx"]
    _flip_last_byte("encoder.onnx")(files)


def _edit_lambda(files: ConfigRecord) -> None:
    manifest = json.loads(files["client/manifest.json"])
    manifest["lambda"] = 1.0
    files["client/manifest.json"] = json.dumps(manifest).encode()


@pytest.mark.parametrize(
    "release,key,edit,message",
    [
        ("v1", "b", None, "signed by key .*, which is not trusted"),
        ("v2-unsigned", "a", None, "unsigned .*signature.json is missing"),
        # sent once, the encoder altered is the client's too: its bundle's sha256s catch it
        ("v1", "a", _flip_last_byte("encoder.onnx"), "encoder.onnx does not match its sha256"),
        ("v1", "a", _flip_the_shared_encoder_only, "not the one that was signed"),
        ("v1", "a", _drop("encoder.onnx.sig.json"), "encoder.onnx: unsigned"),
        ("v1", "a", _flip_last_byte("client/datastore.npz"), "datastore.npz"),
        ("v1", "a", _edit_lambda, "'lambda' differs from the signed manifest"),
    ],
    ids=[
        "wrong-key",
        "unsigned",
        "encoder",
        "shared-encoder",
        "encoder-unsigned",
        "datastore",
        "manifest",
    ],
)
def test_a_node_that_trusts_a_key_builds_from_no_other_release(
    tiny, tmp_path, release, key, edit, message
):
    from edge_runtime.errors import SignatureError

    with pytest.raises(SignatureError, match=f"refused the release: .*{message}") as e:
        _bring(tiny, release, tmp_path / "node" / "bundle", key, edit)
    assert "\n" not in str(e.value) and ".release-" not in str(e.value)
    assert list((tmp_path / "node").iterdir()) == []  # no bundle, no scratch left


def test_the_release_encoder_travels_once_where_it_is_the_clients_too(tiny, tmp_path):
    """The server sent each node the release's encoder and the client bundle's copy of it, the
    same bytes twice; the node writes the one it got in both places, and the client bundle
    verifies against its signature as exported. A client's own encoder (the linear base's) is
    still sent beside the release's."""
    from edge_runtime.bundle import read_bundle
    from edge_runtime.signing import load_public_key
    from fed_train.flower.release_push import release_files

    root, _ = tiny
    release = root / "v1"
    exported = {"encoder.onnx", "encoder.onnx.sig.json"}
    exported |= {f"client/{p.name}" for p in (release / "client_0003").iterdir()}
    files = release_files(release, 3)
    assert set(files) == exported - {"client/encoder.onnx"}
    assert (
        sum(map(len, files.values()))
        == sum(
            (release / name.replace("client/", "client_0003/")).stat().st_size for name in exported
        )
        - (release / "encoder.onnx").stat().st_size
    )
    (tmp_path / "node").mkdir()
    client = write_pushed_files(files, tmp_path / "node")
    assert (client / "encoder.onnx").read_bytes() == (release / "encoder.onnx").read_bytes()
    read_bundle(client, intra_op_threads=1, trusted_keys=[load_public_key(root / "a.pub")])
    own = tmp_path / "own-encoder"
    shutil.copytree(release, own)
    (own / "encoder.onnx").write_bytes(b"the release's encoder, another than the client's")
    assert set(release_files(own, 3)) == exported
    assert release_files(own, 3)["client/encoder.onnx"] == files["encoder.onnx"]


def test_a_node_that_trusts_a_key_upgrades_only_to_a_release_it_signed(tiny, tmp_path):
    from edge_runtime.errors import SignatureError

    bundle = tmp_path / "bundle"
    metrics, _ = _bring(tiny, "v1", bundle, "a")
    assert metrics["built"] == 1
    before = {p.name: p.read_bytes() for p in bundle.iterdir()}
    for release, message in (("v2-by-b", "not trusted"), ("v2-unsigned", "unsigned")):
        with pytest.raises(SignatureError, match=f"refused the release: .*{message}"):
            _bring(tiny, release, bundle, "a")
        assert {p.name: p.read_bytes() for p in bundle.iterdir()} == before
    metrics, texts = _bring(tiny, "v2", bundle, "a")
    assert metrics["upgraded"] == 1 and texts["how"] == "re-embedded"
    assert metrics["carried"] == metrics["stored"] == 70  # train and the added val split
    # the node's bundle is its own (its recipe, its lambda): unsigned, as when it was built
    assert not (bundle / "signature.json").exists()


def test_a_node_without_a_trusted_key_takes_unsigned_and_signed_releases(tiny, tmp_path):
    metrics, _ = _bring(tiny, "v1", tmp_path / "bundle", None)
    assert metrics["built"] == 1
    metrics, _ = _bring(tiny, "v2-unsigned", tmp_path / "bundle", None)
    assert metrics["upgraded"] == 1


def test_a_node_with_an_unreadable_trusted_key_says_so_in_one_line(tmp_path):
    from edge_runtime.errors import SignatureError
    from fed_train.flower.device_release import node_trusted_keys

    pytest.importorskip("cryptography")
    (tmp_path / "k.pub").write_text("not a key")
    with pytest.raises(SignatureError, match="is not a PEM public key"):
        node_trusted_keys({"trusted-key": str(tmp_path / "k.pub")})
    assert node_trusted_keys({"trusted-key": ""}) is None


def _fake_release(tmp_path: Path, signed: bool, run_clients: int = 2) -> tuple[Path, Path]:
    """A run and a release directory with 2 clients' folders and its record (all that
    `deploy config` reads of a release)."""
    (tmp_path / "run").mkdir()
    config = {"dataset": "digits", "clients": run_clients}
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    for cid in range(2):
        (tmp_path / "rel" / f"client_{cid:04d}").mkdir(parents=True)
    write_release(tmp_path / "rel", Release("run", ModelVersion("b" * 64, "run", 1), (0, 1)))
    if signed:
        (tmp_path / "rel" / "client_0000" / "signature.json").write_text("{}")
    return tmp_path / "rel", tmp_path / "run"


@pytest.mark.parametrize("signed", [False, True])
def test_deploy_config_writes_the_push_deploy_release_runs(tmp_path, capsys, signed):
    import tomllib

    release, run = _fake_release(tmp_path, signed)
    argv = ["deploy", "config", "--release", str(release), "--run", str(run), "--force"]
    assert main([*argv, "--out", str(tmp_path / "push")]) == 0
    captured = capsys.readouterr()
    settings = FlowerSettings.from_run_config(tomllib.loads(captured.out))
    assert (settings.release, settings.run_dir) == (str(release), str(tmp_path / "push"))
    assert (settings.force_upgrade, settings.keep_inputs, settings.run.clients) == (True, False, 2)
    assert ('trusted-key="' in captured.err) == signed  # the node's key: its own config


@pytest.mark.parametrize("name", ["rel-\U0001f680", *HOSTILE_NAMES])
def test_deploy_config_quotes_hostile_release_and_out_paths_as_toml(tmp_path, capsys, name):
    """JSON's escapes of a character beyond U+FFFF are surrogates, which TOML refuses: `flwr
    run` failed after the SuperLink and the nodes had started. A path that is no UTF-8 has
    no TOML spelling at all: one line, exit 2."""
    import tomllib

    release, run = _fake_release(tmp_path, signed=False)
    hostile = release.rename(tmp_path / f"rel-{name.replace('/', '|')}")
    out = tmp_path / f"out-{name}"
    argv = ["deploy", "config", "--release", str(hostile), "--run", str(run), "--out", str(out)]
    code = main([*argv, "--write", str(tmp_path / "push.toml")])
    err = capsys.readouterr().err
    if "\udcff" in name:
        assert code == 2 and "is not UTF-8" in err and err.count("\n") == 1
        assert not (tmp_path / "push.toml").exists()
        return
    assert code == 0
    settings = FlowerSettings.from_run_config(tomllib.loads((tmp_path / "push.toml").read_text()))
    assert (settings.release, settings.run_dir) == (str(hostile), str(out))


@pytest.mark.parametrize(
    "argv,run_clients,message",
    [
        (["--release", "REL"], 2, "--release and --run go together"),
        (["--keep-inputs"], 2, "--keep-inputs and --force are for a push"),
        (["--release", "REL", "--run", "RUN"], 3, "holds no bundle for client(s) [2]"),
    ],
)
def test_deploy_config_refuses_a_push_it_cannot_write_in_one_line(
    tmp_path, capsys, argv, run_clients, message
):
    release, run = _fake_release(tmp_path, signed=False, run_clients=run_clients)
    argv = [{"REL": str(release), "RUN": str(run)}.get(a, a) for a in argv]
    assert main(["deploy", "config", *argv, "--out", str(tmp_path / "push")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
