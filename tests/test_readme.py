"""The documented commands can be pasted: every `knnper` and `knnper-edge` command of the README
and of the guide pages parses with the real command lines (as written and at the digits scale
.ci/readme.py runs them), what they write lies in folders .gitignore covers, and the README's
test command is .ci/run's. (.ci/readme.py runs them all in a fresh clone; .ci/run calls it.)"""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edge_runtime.cli import _build_parser as edge_parser
from edge_runtime.commands import UsageError

cli = pytest.importorskip("knnper_cli.main")  # the server CLI needs the train extra

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_runner", REPO / ".ci" / "readme.py")
readme = importlib.util.module_from_spec(_spec)
sys.modules["readme_runner"] = readme  # dataclasses look their module up there
_spec.loader.exec_module(readme)


def _steps(command: str) -> list[list[str]]:
    return [shlex.split(step) for step in command.split(" && ") if step.strip()]


def _parse(argv: list[str]) -> None:
    if "--help" in argv:
        return
    if argv[0] == "knnper":
        try:
            cli.build_parser().parse_args(argv[1:])
        except (SystemExit, UsageError) as err:
            raise AssertionError(f"`{shlex.join(argv)}` does not parse") from err
    elif argv[0] == "knnper-edge":
        edge_parser().parse_args(argv[1:])


def test_the_readme_and_the_guides_have_their_commands_in_order():
    commands = readme.all_commands()
    runs = [c.run for c in commands]
    assert len(commands) >= 25
    assert runs[0] == "knnper demo" and commands[0].source == "README.md"
    first = {
        name: next(i for i, r in enumerate(runs) if name in r)
        for name in (
            "knnper pretrain",
            "--init runs/pretrain-fmnist",
            "knnper-edge keygen",
            "--signing-key keys/signing.pem",
            "knnper client-data runs/fmnist --client 3",
            "data/client_3/test_x.npy",
        )
    }
    assert first["knnper pretrain"] < first["--init runs/pretrain-fmnist"]
    assert first["knnper-edge keygen"] < first["--signing-key keys/signing.pem"]
    assert first["knnper client-data runs/fmnist --client 3"] < first["data/client_3/test_x.npy"]


def test_the_guide_pages_run_in_nav_order_after_the_readme():
    pages = [p.relative_to(REPO / "docs").as_posix() for p in readme.guide_pages()]
    assert pages[:4] == ["index.md", "getting-started.md", "concepts.md", "server.md"]
    assert pages.index("server.md") < pages.index("export.md") < pages.index("device.md")
    assert not any(p.startswith(("benchmarks/", "api/")) for p in pages)
    sources = [c.source for c in readme.all_commands()]
    assert sources == sorted(sources, key=["README.md", *(f"docs/{p}" for p in pages)].index)


def test_the_nav_reader_takes_titled_and_bare_entries(tmp_path):
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: x\nnav:\n  - Home: index.md\n  - guide.md\n  - Benchmarks:\n"
        "      - Glance: benchmarks/index.md\n  - API:\n      - a: api/a.md\n  - Home: index.md\n"
    )
    pages = readme.guide_pages(tmp_path / "mkdocs.yml")
    assert [p.name for p in pages] == ["index.md", "guide.md"]


def test_every_documented_command_parses_as_written_and_at_digits_scale():
    for c in readme.all_commands():
        if c.kind != "bash":
            continue
        for text in (readme._runnable_part(c.text.split(" #")[0]), c.run):
            for argv in _steps(text):
                assert "[" not in " ".join(argv), f"{c.source}:{c.line}: {text}"
                _parse(argv)


def test_digits_scale_changes_sizes_only():
    run = readme.at_digits_scale(
        "knnper train --dataset fashion-mnist --data /usr/share/datasets/fashion-mnist "
        "--max-train 8000 --clients 100 --out runs/x"
    )
    assert run == "knnper train --dataset digits --clients 10 --out runs/x --rounds 2"
    assert readme.at_digits_scale("knnper experiment --help") == "knnper experiment --help"
    assert all("fashion-mnist" not in c.run for c in readme.all_commands())


def test_pip_venv_and_pytest_steps_are_left_to_ci():
    runs = [c.run for c in readme.all_commands()]
    assert not any("pip install" in r or "pytest" in r or "venv" in r for r in runs)
    assert (
        readme._runnable_part(
            "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && knnper demo"
        )
        == "knnper demo"
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.parametrize(
    "path",
    [
        "keys/signing.pem",
        "bundles/predictor.onnx",
        "data/client_3/p.npy",
        "runs/fmnist/model.pt",
        "bundles/my-device/manifest.json",
        "keys/pki/ca.crt",
    ],
)
def test_what_the_readme_writes_is_ignored_by_git(path):
    ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", path])
    assert ignored.returncode == 0, f"{path} is not covered by .gitignore"


def test_the_readme_test_command_is_what_ci_runs():
    text = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "&& python -m pytest -q\n" in text
    assert "\npython -m pytest -q\n" in ci
    assert "python .ci/readme.py" in ci


def _printed_demo(**changes: str) -> str:
    """The README's demo table as `knnper demo` prints it, with some cells changed
    ("method/where/column": new value)."""
    text = (REPO / "README.md").read_text()
    rows = readme.markdown_rows(text, "| method | where |")
    lines = [
        "| method | where | budget | bundle (mean) | seen acc % | unseen acc % |",
        "|---|---|---|---|---|---|",
    ]
    for (method, where), row in rows.items():
        cells = [changes.get(f"{method}/{where}/{c}", row[c]) for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "kNN-Per configuration ...\n" + "\n".join(lines) + "\nrun, evaluation and bundles in x\n"


def test_the_demo_table_is_checked_against_the_readme_within_its_tolerance():
    text = (REPO / "README.md").read_text()
    assert readme.demo_differences(text, _printed_demo()) == []
    # a bundle one kB larger on average: inside the tolerance
    larger = _printed_demo(**{"kNN-Per/strong device (runtime)/bundle (mean)": "42 kB"})
    assert readme.demo_differences(text, larger) == []
    worse = readme.demo_differences(
        text, _printed_demo(**{"kNN-Per/weak device (runtime)/seen acc %": "96.0"})
    )
    assert len(worse) == 1 and "weak device (runtime), seen acc %" in worse[0]
    # what an AMD EPYC with AVX2 prints: FedAvg one test sample higher, inside the tolerance
    fedavg = "FedAvg/server/seen acc %"
    assert readme.demo_differences(text, _printed_demo(**{fedavg: "92.2"})) == []
    assert len(readme.demo_differences(text, _printed_demo(**{fedavg: "91.0"}))) == 1


def test_the_readme_says_which_demo_figures_depend_on_the_cpu():
    text = " ".join((REPO / "README.md").read_text().split())
    pp, kb = readme.DEMO_TOLERANCE
    assert f"within {pp:g} pp" in text and f"{kb:g} kB" in text and "float32" in text
    assert "same integers on every CPU" in text
