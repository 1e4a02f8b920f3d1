"""benchmarks/check_figures.py: the committed fair tables recompute exactly, and an edited
per-client figure or a printed number that disagrees is reported."""

from __future__ import annotations

import csv
import importlib.util
import shutil
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "check_figures.py"


@pytest.fixture(scope="module")
def cf():
    spec = importlib.util.spec_from_file_location("check_figures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_fair_tables_recompute_exactly(cf):
    check = cf.Checker()
    fair = {n: cf.check_table(cf.FAIR / n, check) for n in cf.FAIR_TABLES.values()}
    cf.check_benchmarks_md(cf.published_text(), fair, check)
    assert check.checked > 300 and check.mismatches == []


def test_an_edited_client_accuracy_is_a_mismatch(cf, tmp_path, monkeypatch):
    folder = tmp_path / "cifar10"
    shutil.copytree(cf.FAIR / "cifar10", folder)
    rows = list(csv.DictReader((folder / "clients.csv").open()))
    rows[1]["knnper"] = str(float(rows[1]["knnper"]) - 0.5)
    with open(folder / "clients.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    check = cf.Checker()
    monkeypatch.setattr(cf, "REPO", tmp_path)  # names in messages are relative to it
    cf.check_table(folder, check)
    assert any("knnper" in m for m in check.mismatches)


def test_a_printed_cell_that_disagrees_is_a_mismatch(cf):
    check = cf.Checker()
    fair = {n: cf.check_table(cf.FAIR / n, check) for n in cf.FAIR_TABLES.values()}
    text = cf.published_text()
    cell = "| FedRep | 72.3 / 57.7 |"
    assert cell in text
    cf.check_benchmarks_md(text.replace(cell, "| FedRep | 72.4 / 57.7 |"), fair, check)
    assert len(check.mismatches) == 1 and "FedRep" in check.mismatches[0]


def test_the_default_tables_are_checked_and_a_wrong_verdict_is_a_mismatch(cf):
    seeds = {n: cf.check_seeds(cf.SEEDS / n, cf.Checker()) for n in cf.DEFAULT_SEED_TABLES.values()}
    text = cf.published_text()
    check = cf.Checker()
    cf.check_seeds_md(text, seeds, check, cf.DEFAULT_HEADING, cf.DEFAULT_SEED_TABLES)
    assert check.checked > 100 and check.mismatches == []
    row = "| mean | FedRep | -0.65 [-0.93, -0.38] | **fedrep ahead** |"
    assert row in text
    check = cf.Checker()
    cf.check_seeds_md(
        text.replace(row, row.replace("**fedrep ahead**", "inconclusive")),
        seeds,
        check,
        cf.DEFAULT_HEADING,
        cf.DEFAULT_SEED_TABLES,
    )
    assert len(check.mismatches) == 1 and "verdict" in check.mismatches[0]


def test_a_table_whose_heading_is_on_no_page_is_a_mismatch(cf):
    seeds = {n: cf.check_seeds(cf.SEEDS / n, cf.Checker()) for n in cf.DEFAULT_SEED_TABLES.values()}
    text = cf.published_text().replace(cf.DEFAULT_HEADING, "### Renamed")
    check = cf.Checker()
    cf.check_seeds_md(text, seeds, check, cf.DEFAULT_HEADING, cf.DEFAULT_SEED_TABLES)
    assert len(check.mismatches) == 2 and all("not found" in m for m in check.mismatches)


def test_the_clients_hurt_tables_are_checked_and_a_wrong_cell_is_a_mismatch(cf):
    seeds = {n: cf.check_seeds(cf.SEEDS / n, cf.Checker()) for n in cf.SEED_TABLES.values()}
    text = cf.published_text()
    check = cf.Checker()
    cf.check_hurt_md(text, seeds, check)
    assert check.checked >= 80 and check.mismatches == []
    row = "| kNN-Per, below FedAvg+ | 43.1 ± 6.4 [31.9, 54.2] |"
    assert row in text
    check = cf.Checker()
    cf.check_hurt_md(text.replace(row, row.replace("43.1", "41.3")), seeds, check)
    assert len(check.mismatches) == 1 and "below FedAvg+" in check.mismatches[0]
