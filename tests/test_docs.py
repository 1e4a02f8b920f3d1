"""The documentation's shape: the README is a map (small, the set-up commands first), and the API
reference names every name of each public face (`__all__`), so a name added to a face without a
page, or a page left for a removed name, fails here before `mkdocs build --strict` would."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FACES = ("edge_runtime", "fed_train", "export", "experiments")


def test_the_readme_is_a_map_that_starts_with_its_set_up_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) <= 12 * 1024
    first_block = text[text.index("```bash") : text.index("```", text.index("```bash") + 7)]
    assert "knnper demo" in first_block and "python -m pytest -q" in first_block
    assert "## " not in text[: text.index("```bash")]  # nothing before the commands but the intro


@pytest.mark.parametrize("package", FACES)
def test_the_api_reference_documents_each_name_of_the_public_face(package):
    page = (REPO / "docs" / "api" / f"{package}.md").read_text()
    documented = re.findall(rf"^::: {package}\.([\w.]+)$", page, flags=re.M)
    names = [d.rsplit(".", 1)[-1] for d in documented]
    face = importlib.import_module(package)
    assert sorted(names) == sorted(face.__all__)
    for dotted in documented:  # each where it is defined, so the reference finds its docstring
        module, name = dotted.rsplit(".", 1)
        assert hasattr(importlib.import_module(f"{package}.{module}"), name), dotted


def test_every_docs_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    listed = set(re.findall(r"([\w./-]+\.md)", nav))
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert pages == listed


def _demo_rows(text: str) -> dict[tuple[str, str], list[str]]:
    """The demo table's rows (method, where) -> the other cells, from the first such table."""
    start = text.index("| method | where |")
    lines = text[start : text.index("\n\n", start)].splitlines()[2:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return {(c[0], c[1]): c[2:] for c in cells}


def test_the_demo_figures_have_one_source_the_readme():
    """The README, the accuracy page and the results at a glance printed three tables' worth
    of demo figures; the README's is the one .ci/readme.py checks against the demo."""
    readme = _demo_rows((REPO / "README.md").read_text())
    accuracy = (REPO / "docs" / "benchmarks" / "accuracy.md").read_text()
    assert _demo_rows(accuracy[accuracy.index("## `knnper demo`") :]) == readme
    seen = {key: float(cells[2]) for key, cells in readme.items()}
    over_fedavg = seen[("kNN-Per", "server")] - seen[("FedAvg", "server")]
    weak = seen[("kNN-Per", "server")] - seen[("kNN-Per", "weak device (runtime)")]
    glance = (REPO / "docs" / "benchmarks" / "index.md").read_text()
    assert f"kNN-Per **+{over_fedavg:.1f} pp** over FedAvg" in glance
    assert f"the weak device's bundles give up {weak:.1f} pp" in glance
    assert f"kNN-Per is {over_fedavg:.1f} pp above FedAvg" in accuracy
    assert f"lose {weak:.1f} pp against kNN-Per" in accuracy
