"""The extension points of docs/extending.md, each exercised from one file plus one registration:
a datastore backend (tests/helpers/projection_store.py) through export and every device command,
and the rule that no module outside edge_runtime/datastores/ names a backend."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import numpy as np
import pytest

from edge_runtime import cli as edge_cli
from edge_runtime.datastores import BACKENDS, register_backend
from fed_train.algorithms.base import TrainingConfig
from fed_train.run import RunConfig, train
from knnper_cli import main as knnper
from tests.helpers.projection_store import ProjectionDatastore

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("edge_runtime", "export", "fed_train", "experiments", "knnper_cli")


def backend_literals() -> list[str]:
    """Every string literal that is a registered backend's name or a recipe of one ("flat",
    "flat:fp32") outside edge_runtime/datastores/."""
    names = tuple(BACKENDS)
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "datastores" in path.relative_to(ROOT).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                    continue
                if node.value in names or node.value.startswith(tuple(f"{n}:" for n in names)):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    return found


def test_no_module_outside_the_datastores_names_a_backend_or_a_recipe():
    """The four recipe strings device_init and upgrade_map held, and the eight experiments/
    held (a default recipe per backend, a search space, recipes cut apart by hand), were found
    by no check."""
    assert backend_literals() == []


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run") / "digits"
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
    return path


@pytest.fixture
def toy_backend():
    register_backend(ProjectionDatastore)  # the one registration line
    yield
    del BACKENDS[ProjectionDatastore.backend]


def _edge(capsys, *argv: str) -> tuple[int, str, str]:
    code = edge_cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_backend_defined_in_one_file_exports_loads_predicts_and_learns(
    run_dir, tmp_path, capsys, toy_backend
):
    out = tmp_path / "bundles"
    assert (
        knnper.main(
            [
                "--no-progress",
                "export",
                str(run_dir),
                "--out",
                str(out),
                "--backend",
                "randproj",
                "--budget",
                "1MB",
                "--clients",
                "0",
                "--knn-config",
                "paper",
            ]
        )
        == 0
    )
    report = json.loads((out / "export.json").read_text())
    assert report["clients"][0]["recipe"].startswith("randproj:d8")
    bundle = next(p for p in out.iterdir() if p.is_dir() and p.name.startswith("client_"))

    shape = json.loads((bundle / "manifest.json").read_text())["input"]["shape"]
    x = np.random.default_rng(0).integers(0, 256, size=(5, *shape), dtype=np.uint8)
    np.save(tmp_path / "x.npy", x)
    code, printed, err = _edge(capsys, "predict", str(bundle), "--input", str(tmp_path / "x.npy"))
    assert code == 0, err
    assert len(printed.split()) >= 5

    np.savez(tmp_path / "new.npz", x=x, y=np.arange(5) % 3)
    code, printed, err = _edge(capsys, "info", str(bundle))
    assert code == 0, err
    before = int(re.search(r"(\d+) stored", printed).group(1))
    code, _, err = _edge(capsys, "add", str(bundle), "--data", str(tmp_path / "new.npz"))
    assert code == 0, err

    code, printed, err = _edge(capsys, "info", str(bundle))
    assert code == 0, err
    assert "randomly projected keys (exact search)" in printed
    assert f"{before + 5} stored" in printed

    code, _, err = _edge(capsys, "export-onnx", str(bundle), "--out", str(tmp_path / "p.onnx"))
    assert code == 2 and "has no ONNX form" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p.onnx").exists()


def test_a_device_command_defined_in_one_file_runs_through_knnper_edge(tmp_path, capsys):
    import tests.helpers.class_counts_command  # noqa: F401  (its one registration)
    from tests.helpers.bundles import build_bundle

    bundle = build_bundle(tmp_path, n=60)
    try:
        code, printed, err = _edge(capsys, "classes", str(bundle))
        assert code == 0, err
        counts = dict(pair.split(":") for pair in printed.split())
        assert sum(map(int, counts.values())) == 60

        code, _, err = _edge(capsys, "classes", str(tmp_path / "missing"))
        assert code == 2 and err.startswith("knnper-edge: error: ") and err.count("\n") == 1

        code, _, err = _edge(capsys, "classes")
        assert code == 2 and "(see knnper-edge classes --help)" in err

        code, printed, _ = _edge(capsys, "--help")
        assert "classes" in printed and "how many samples of each class" in printed
    finally:
        del edge_cli.COMMANDS["classes"]


def test_the_edge_docstring_lists_every_command():
    listed = re.findall(r"^- ([a-z-]+): ", edge_cli.__doc__, re.M)
    assert listed == list(edge_cli.COMMANDS)


def test_the_knnper_docstring_lists_every_command():
    listed = [
        name
        for line in re.findall(r"^- ([a-z, -]+): ", knnper.__doc__, re.M)
        for name in line.split(", ")
    ]
    sub = next(a for a in knnper.build_parser()._actions if a.dest == "command")
    assert sorted(listed) == sorted(sub.choices)
