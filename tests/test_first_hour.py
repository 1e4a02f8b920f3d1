"""A user's first hour, outside this machine: both command lines as helpful as each other (help
with defaults, --version, a missing sub-command named), device commands that account for every
sample and say what a signature check did, predict that prints a summary, Ctrl-C on one line."""

from __future__ import annotations

import argparse
import dataclasses
import io
import re
import sys

import numpy as np
import pytest

from edge_runtime.bundle import write_bundle
from edge_runtime.cli import _build_parser as edge_parser
from edge_runtime.cli import main as edge_main
from edge_runtime.datastores import ProtoNNDatastore
from tests.helpers.bundles import (
    FIELDS,
    NUM_CLASSES,
    P,
    build_bundle,
    make_image_encoder,
    make_images,
    rewrite_manifest,
)

cli = pytest.importorskip("knnper_cli.main")  # the server CLI needs the train extra


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _flat_help(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_help().split())


@pytest.mark.parametrize("build", [cli.build_parser, edge_parser], ids=["knnper", "knnper-edge"])
def test_help_shows_each_default_once_and_never_none(build):
    for path, parser in _parsers(build(), (build.__module__,)):
        text = _flat_help(parser)
        assert "(default: None)" not in text, path
        assert "(default: False)" not in text, path
        for action in parser._actions:
            if isinstance(
                action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
            ):
                continue
            assert action.help, (path, action.dest)
            shown_help = parser._get_formatter()._get_help_string(action)
            assert shown_help.lower().count("default:") <= 1, (path, action.dest)
            shown = action.default not in (None, False, argparse.SUPPRESS)
            if shown and action.option_strings and not action.required:
                assert "default" in shown_help, (path, action.dest)


def test_required_options_show_no_default():
    export = next(
        p for path, p in _parsers(cli.build_parser(), ("knnper",)) if path == ("knnper", "export")
    )
    out = next(a for a in export._actions if a.dest == "out")
    assert export._get_formatter()._get_help_string(out) == out.help


def test_data_help_names_where_data_sets_are_looked_for():
    train = next(
        p for path, p in _parsers(cli.build_parser(), ("knnper",)) if path == ("knnper", "train")
    )
    text = _flat_help(train)
    assert "/usr/share/datasets/fashion-mnist for fashion-mnist" in text
    assert "digits" in text


def test_edge_version_prints_and_exits_zero(capsys):
    assert edge_main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("knnper-edge ")


@pytest.mark.parametrize(
    "argv,commands",
    [
        (["deploy"], "local, config, release, certs"),
        (["bench"], "table"),
    ],
)
def test_a_missing_sub_command_lists_the_commands(argv, commands, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"a command is needed: {commands}" in err and "where" not in err
    assert err.count("\n") == 1


def test_edge_without_a_command_lists_the_commands(capsys):
    assert edge_main([]) == 2
    err = capsys.readouterr().err
    assert "a command is needed: predict, evaluate, add" in err and err.count("\n") == 1


def test_edge_ctrl_c_is_one_line_and_code_130(monkeypatch, capsys, tmp_path):
    import edge_runtime.cli as edge_cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(
        edge_cli.COMMANDS, "info", dataclasses.replace(edge_cli.COMMANDS["info"], run=interrupted)
    )
    assert edge_main(["info", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert err == "knnper-edge: interrupted\n"


def _buffered_protonn(tmp_path, buffer: int):
    enc = make_image_encoder(tmp_path / "encoder.onnx")
    rng = np.random.default_rng(0)
    ds = ProtoNNDatastore.from_matrices(
        rng.normal(size=(3, P)),
        rng.normal(size=(3, 5)),
        rng.random((NUM_CLASSES, 5)),
        0.5,
        k=5,
        m=0.3,
        buffer=buffer,
    )
    write_bundle(tmp_path / "b", dataclasses.replace(FIELDS, update_strategy="fifo"), enc, ds)
    return tmp_path / "b"


def test_add_accounts_for_every_received_sample(tmp_path, capsys):
    bundle = _buffered_protonn(tmp_path, buffer=30)
    x, y = make_images(76, 1)
    np.savez(tmp_path / "new.npz", x=x, y=y)
    assert edge_main(["add", str(bundle), "--data", str(tmp_path / "new.npz")]) == 0
    out = capsys.readouterr().out
    assert "received 76: added 30, dropped the oldest 46 of them" in out
    assert "evicted 0" in out
    assert (
        edge_main(["add", str(bundle), "--data", str(tmp_path / "new.npz"), "--strategy", "fixed"])
        == 0
    )
    assert "added 0, dropped 76 (the fixed strategy" in capsys.readouterr().out


def test_predict_prints_a_summary_unless_labels_are_asked_for(tmp_path, capsys):
    bundle = build_bundle(tmp_path)
    x, _ = make_images(40, 2)
    np.save(tmp_path / "x.npy", x)
    assert (
        edge_main(
            [
                "predict",
                str(bundle),
                "--input",
                str(tmp_path / "x.npy"),
                "--output",
                str(tmp_path / "p.npy"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("predicted 40 input(s)")
    labels = np.load(tmp_path / "p.npy").argmax(1)
    counts = dict(zip(*np.unique(labels, return_counts=True), strict=True))
    assert "{" + ", ".join(f"{c}: {n}" for c, n in counts.items()) + "}" in out
    assert edge_main(["predict", str(bundle), "--input", str(tmp_path / "x.npy"), "--labels"]) == 0
    assert [int(v) for v in capsys.readouterr().out.split()] == list(labels)


def test_info_says_whether_the_signature_was_checked(tmp_path, capsys):
    pytest.importorskip("cryptography")
    from edge_runtime.signing import generate_key_pair
    from tests.helpers.signing import signed_bundle

    generate_key_pair(tmp_path / "key.pem", tmp_path / "key.pub")
    unsigned = build_bundle(tmp_path)
    assert edge_main(["info", str(unsigned)]) == 0
    assert re.search(r"^signature +unsigned$", capsys.readouterr().out, re.M)
    signed = signed_bundle(tmp_path, tmp_path.parent / tmp_path.name)
    trusted = ["--trusted-key", str(tmp_path / "key.pub")]
    assert edge_main([*trusted, "info", str(signed)]) == 0
    assert "signed and verified against a --trusted-key" in capsys.readouterr().out
    rewrite_manifest(signed, **{"lambda": 1.0})  # an edit only the signature can catch
    assert edge_main(["info", str(signed)]) == 0
    out = capsys.readouterr().out
    assert "not checked" in out and "verified" not in out.replace("to verify", "")
    assert edge_main([*trusted, "info", str(signed)]) == 2
    assert "'lambda' differs from the signed manifest" in capsys.readouterr().err


def test_export_onnx_without_onnx_names_the_portable_extra(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else real(name, *a)
    )
    bundle = build_bundle(tmp_path)
    assert edge_main(["export-onnx", str(bundle), "--out", str(tmp_path / "p.onnx")]) == 2
    err = capsys.readouterr().err
    assert "pip install '.[portable]' in a knnper clone" in err and err.count("\n") == 1


def test_portable_extra_gives_export_onnx_what_it_imports():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    portable = project["project"]["optional-dependencies"]["portable"]
    assert any(dep.startswith("onnx") and not dep.startswith("onnxruntime") for dep in portable)


def test_deploy_expects_the_nearest_measured_size_with_the_same_settings(tmp_path):
    import json
    from dataclasses import replace

    from fed_train import defaults
    from fed_train.flower.expected import expectation_line
    from fed_train.run import RunConfig

    def config(clients: int, rounds: int, **changes) -> RunConfig:
        return RunConfig(
            dataset="digits",
            clients=clients,
            training=replace(defaults.TRAINING, rounds=rounds),
            **changes,
        )

    measured = [
        {
            "config": config(c, r).to_dict(),
            "fedavg_seen": 10.0 * c + r,
            "fedavg_unseen": 1.0,
            "knnper_seen": 90.0,
            "knnper_unseen": 80.0,
            "source": "bench",
        }
        for c in (5, 20)
        for r in (5, 20)
    ]
    path = tmp_path / "expected.json"
    path.write_text(json.dumps({"runs": measured}))
    line = expectation_line(config(5, 5), path)
    assert line.startswith("expected (this size: digits, 5 clients, 5 rounds)")
    assert "FedAvg 55.0% seen / 1.0% unseen, kNN-Per 90.0% seen / 80.0% unseen" in line
    assert "nearest measured size: digits, 20 clients, 20 rounds" in expectation_line(
        config(16, 30), path
    )
    assert "no run with these settings" in expectation_line(config(5, 5, alpha=1.0), path)


def test_train_writes_progress_lines_to_a_log(tmp_path, capsys):
    from fed_train.algorithms.base import TrainingConfig
    from fed_train.run import RunConfig, train

    config = RunConfig(
        dataset="digits",
        clients=4,
        seed=0,
        training=TrainingConfig(rounds=2, epochs=1, batch_size=16, lr=0.05),
    )
    train(config, tmp_path / "run", progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert "fedavg: 2/2 rounds done in" in err


@pytest.mark.parametrize("build", [cli.build_parser, edge_parser], ids=["knnper", "knnper-edge"])
def test_every_command_has_an_example_to_paste(build):
    for path, parser in _parsers(build(), (build.__module__,)):
        help_text = parser.format_help()
        assert "example" in help_text.split("\n\n", 2)[-1], path
        prog = "knnper-edge" if build is edge_parser else "knnper"
        assert re.search(rf"^  {prog} ", help_text, re.M), path  # indented, as pasted


def test_edge_help_gives_the_order_of_use_and_add_says_it_rewrites_in_place():
    top = _flat_help(edge_parser())
    assert "Order of use:" in top
    assert top.index("info bundles") < top.index("predict bundles") < top.index("add bundles")
    add = next(p for path, p in _parsers(edge_parser(), ()) if path == ("add",))
    assert "the bundle is rewritten in place" in _flat_help(add)
    init = next(p for path, p in _parsers(edge_parser(), ()) if path == ("init",))
    assert '"kind": "image", "shape": [H, W, C]' in _flat_help(init)  # the --input-spec format


def test_init_refuses_an_existing_bundle_without_force(tmp_path, capsys):
    bundle = build_bundle(tmp_path)
    before = {p.name: p.read_bytes() for p in bundle.iterdir()}
    x, y = make_images(40, 3)
    np.savez(tmp_path / "own.npz", x=x, y=y)
    argv = [
        "init",
        "--encoder",
        str(bundle / "encoder.onnx"),
        "--data",
        str(tmp_path / "own.npz"),
        "--budget",
        "1MB",
        "--like",
        str(bundle),
        "--out",
        str(bundle),
    ]
    assert edge_main(argv) == 2
    err = capsys.readouterr().err
    assert "already holds a bundle" in err and "--force" in err and err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in bundle.iterdir()} == before
    fresh = tmp_path / "fresh"
    assert edge_main([*argv[:-1], str(fresh)]) == 0
    assert edge_main([*argv[:-1], str(fresh), "--force"]) == 0


def test_info_and_evaluate_say_what_they_show_in_words(tmp_path, capsys):
    bundle = build_bundle(tmp_path)
    x, y = make_images(12, 4)
    np.savez(tmp_path / "test.npz", x=x, y=y)
    assert edge_main(["info", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^client +\S+ \((a device's own|the federated client)", out, re.M)
    assert re.search(r"^ +\(flat keys \(exact search\); keys stored as", out, re.M)
    assert edge_main(["evaluate", str(bundle), "--data", str(tmp_path / "test.npz")]) == 0
    out = capsys.readouterr().out
    assert re.match(
        r"accuracy \d+\.\d% on 12 samples \(\d+ right; lambda .*global model "
        r"\d+\.\d%, datastore alone \d+\.\d%\)$",
        out.strip(),
    )


def test_a_recipe_in_words_names_every_part():
    from edge_runtime.datastores.recipes import describe_recipe

    # n is what a flat datastore may hold, not what it holds ("n1742: built from 1742 of the
    # client's samples" sat beside "137 stored" in `info`)
    assert describe_recipe("flat:int8:n1944") == (
        "flat keys (exact search); keys stored as int8; n1944: holds at most 1944 samples"
    )
    assert "n50: built from 50 of the client's samples" in describe_recipe("protonn:d8:n50")
    assert describe_recipe("hnsw:M16:ef64").count(";") == 2
    assert "b40: room for 40 samples added on the device" in describe_recipe("protonn:d8:b40")


def test_an_experiment_report_made_with_other_flags_is_kept(tmp_path, capsys, monkeypatch):
    import json

    from experiments import context as experiment_context

    def trained(*args, **kwargs):
        raise AssertionError("trained")

    monkeypatch.setattr(experiment_context, "train", trained)
    folder = tmp_path / "capacity"
    folder.mkdir()
    (folder / "report.json").write_text(
        json.dumps({"command": "knnper experiment capacity --out elsewhere", "settings": {"a": 1}})
    )
    (folder / "summary.md").write_text("kept")
    argv = ["--no-progress", "experiment", "capacity", "--quick", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "holds a report made with other flags" in err and "--force" in err
    assert err.count("\n") == 1 and (folder / "summary.md").read_text() == "kept"
    with pytest.raises(AssertionError, match="trained"):  # --force goes on to train
        cli.main([*argv, "--force"])


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    from fed_train.algorithms.base import TrainingConfig
    from fed_train.run import RunConfig, load_run, train

    path = tmp_path_factory.mktemp("first-hour") / "run"
    train(
        RunConfig(
            dataset="digits",
            clients=4,
            seed=0,
            training=TrainingConfig(rounds=1, epochs=1, batch_size=16, lr=0.05),
        ),
        path,
        progress=False,
    )
    return load_run(path)


@pytest.mark.parametrize("extras", ["any", "none"])
def test_export_says_before_writing_that_hnsw_bundles_need_an_extra(
    small_run, tmp_path, monkeypatch, caplog, extras
):
    import logging

    from export import exporter

    seen = {}

    def before_any_bundle(run, out_dir, budgets, settings, space, *rest):
        seen["space"] = space.backends
        seen["warned"] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        raise KeyboardInterrupt  # stop here: nothing more to check

    monkeypatch.setattr(exporter, "_export_locked", before_any_bundle)
    settings = exporter.ExportSettings(device_extras=extras)
    with caplog.at_level(logging.WARNING), pytest.raises(KeyboardInterrupt):
        exporter.export_run(
            small_run, tmp_path / "b", dict.fromkeys(range(4), 2_000_000), settings, progress=False
        )
    hnsw_warning = [m for m in seen["warned"] if "hnsw extra" in m]
    if extras == "any":
        assert "hnsw" in seen["space"] and len(hnsw_warning) == 1
        assert "export-onnx" in hnsw_warning[0] and "--device-extras none" in hnsw_warning[0]
    else:
        assert "hnsw" not in seen["space"] and not hnsw_warning
    assert not any((tmp_path / "b").glob("client_*"))


def test_device_extras_none_refuses_the_hnsw_backend():
    from export.errors import ExportError
    from export.exporter import ExportSettings

    with pytest.raises(ExportError, match="--device-extras none rules it out"):
        ExportSettings(backend="hnsw", device_extras="none").check()


def test_the_export_names_the_clients_whose_bundles_need_an_extra():
    from export.exporter import needing_extras

    rows = [
        {"client_id": 0, "backend": "flat"},
        {"client_id": 3, "backend": "hnsw"},
        {"client_id": 7, "backend": "hnsw"},
        {"client_id": 8, "backend": "protonn"},
    ]
    assert needing_extras(rows) == {"hnsw": [3, 7]}


class _Terminal(io.StringIO):
    """stderr as a terminal: progress shows tqdm's bar."""

    def isatty(self) -> bool:
        return True


def test_after_ctrl_c_the_message_is_the_last_line_and_logs_stay_off_the_bars(monkeypatch):
    import logging

    import knnper_cli.train as train_cli
    from fed_train.progress import track

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)

    def interrupted_mid_bar(args):
        for i in track(range(10), total=10, desc="fedavg", unit="round"):
            logging.getLogger("knnper.test").warning("a line the bar must not swallow")
            if i == 2:
                raise KeyboardInterrupt  # the generator, and its bar, are still open here

    monkeypatch.setattr(train_cli, "_cmd_train", interrupted_mid_bar)
    root = logging.getLogger()
    handlers = list(root.handlers)
    try:
        root.handlers = [logging.StreamHandler(terminal)]  # as basicConfig would make it
        assert cli.run(["train", "--out", "unused"]) == 130
    finally:
        root.handlers = handlers
    # \r and erase-line (\x1b[K) start a fresh line on a terminal, as \n does
    lines = [line for line in re.split(r"\r|\n|\x1b\[K", terminal.getvalue()) if line.strip()]
    assert lines[-1] == "knnper: interrupted; run the same command again to resume train"
    warned = [line for line in lines if "a line the bar must not swallow" in line]
    assert len(warned) == 3 and all(
        line.startswith("WARNING") or line.startswith("a line") for line in warned
    )


def test_experiments_that_know_their_point_count_give_the_progress_a_total():
    from experiments.registry import EXPERIMENTS

    counted = {name for name, e in EXPERIMENTS.items() if e.count is not None}
    assert counted == set(EXPERIMENTS) - {"base-model"}  # its checkpoints decide its points
    quick = {g.name: g.quick for g in EXPERIMENTS["capacity"].grids}
    assert EXPERIMENTS["capacity"].count(quick) == len(quick["alphas"]) * (
        1 + len(quick["capacities"])
    )  # FedAvg's capacity 0 is a point too
