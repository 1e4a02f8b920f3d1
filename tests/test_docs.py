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
