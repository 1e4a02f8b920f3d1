"""Recompute every figure of the fair tables from the committed per-client files and compare it
with what the results files, the rendered tables and the benchmark pages print; exit 1 on any
mismatch. CI runs it, so a hand-edited or stale number cannot stay.

    python benchmarks/check_figures.py
    python benchmarks/check_figures.py --render   # after a change to how tables are rendered

`--render` rewrites each folder's rendered files (table.md, seeds.json, seeds.md) from its
per-client files, then checks: the per-client files, results.json and the CSVs are never
written, so a figure can only change where the rendering of the same per-client data did.

What is recomputed, for each table folder (benchmarks/results/fair/NAME and every seed of
benchmarks/results/seeds/NAME): each method's mean (weighted by test size) and bottom decile,
seen and unseen, from clients.csv, against results.json, table1.csv, table2.csv and table.md;
kNN-Per's test-oracle row and its lambda report; the attribution's summaries from
attribution.csv. For the seeds folders: the mean +- std across seeds, the paired bootstrap
intervals and verdicts and the lambda tie counts (seeds.json, seeds.csv, seeds.md). In the
benchmark pages (docs/benchmarks/*.md and BENCHMARKS.md, found by their headings on whichever
page holds them; a heading found on none is a mismatch): the fair section's two tables and the
seeds sections' tables, including their kNN-Per-minus-a-baseline intervals and verdicts, and
the clients-hurt tables (the share of clients below FedAvg, and kNN-Per's below FedAvg+); the
model-update section's accuracy tables (mean +- std across seeds of each seed's mean over
clients, from benchmarks/results/model_update/NAME/clients.csv); the start-up table (each
command's median time to its first line, CPU time and load, and the target's verdict, from
every process in benchmarks/results/cli_start/samples.csv); the export profiles' tables (each
stage's calls, CPU seconds and share, from benchmarks/results/export_profile/); the batch-1
rerun tables (each run's ratios to the encoder alone, from its latency.csv).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edge_runtime._io import write_text_atomic  # noqa: E402
from experiments.benchmark_support import read_csv  # noqa: E402
from experiments.table_seeds import SEEDS_FILE, format_seeds, summarize_seeds  # noqa: E402
from experiments.tables import format_markdown, titles  # noqa: E402
from fed_train.evaluation import summarize  # noqa: E402

PAGES = REPO / "docs" / "benchmarks"
FAIR = REPO / "benchmarks" / "results" / "fair"
SEEDS = REPO / "benchmarks" / "results" / "seeds"
TITLES = titles()  # method -> its title in the tables, from the baselines' registry
BY_TITLE = {v: k for k, v in TITLES.items()}
FAIR_TABLES = {
    "CIFAR-10 alpha 0.3": "cifar10",
    "CIFAR-10 v2": "cifar10-v2",
    "Fashion-MNIST alpha 0.3": "fashion-mnist",
}
SEED_TABLES = {
    **FAIR_TABLES,
    "kNN-Per vs FedAvg, Fashion-MNIST": "vs-fedavg-fashion-mnist",
    "kNN-Per vs FedAvg, CIFAR-10": "vs-fedavg-cifar10",
}
# The same tables rerun with the project's default personalization (base and lambda rule
# cross-validated on validation), in the benchmark pages' section with DEFAULT_HEADING.
DEFAULT_SEED_TABLES = {
    f"{title}, default": f"{name}-default" for title, name in SEED_TABLES.items()
}
# kNN-Per alone with the paper's per-client lambda rule, paired with the default tables by
# benchmarks/rule_pairs.py: their per-client figures are recomputed here too
PAPER_RULE_FOLDERS = ("fashion-mnist-paper-rule", "cifar10-paper-rule")
SEEDS_HEADING = "### Across seeds"
HURT_HEADING = "### Clients hurt: share below the global model (FedAvg)"
DEFAULT_HEADING = "### The default across seeds"
TOLERANCE = 1e-9
MODEL_UPDATE = REPO / "benchmarks" / "results" / "model_update"
MODEL_UPDATE_HEADING = "### After an update: what each path keeps"
# results folder -> its heading in that section; per table heading, the clients.csv column
MODEL_UPDATE_DATA = {"fashion-mnist": "#### Fashion-MNIST", "cifar10": "#### CIFAR-10"}
CLI_START = REPO / "benchmarks" / "results" / "cli_start" / "samples.csv"
CLI_START_HEADING = "### Time to a command's first line"
CLI_START_TARGET_S = 0.5  # issue 49: --help, --version and argument errors, median of 5
# export profiles (benchmarks/export_profile.py): heading -> (its CSV, the scope its table shows)
EXPORT_PROFILES = {
    "### Where a Fashion-MNIST fleet export's time goes, before any cut": (
        REPO / "benchmarks" / "results" / "export_profile" / "before.csv",
        "20 client(s)",
    ),
    "### Where a digits export's time goes, before any cut": (
        REPO / "benchmarks" / "results" / "export_profile" / "digits6" / "try.csv",
        "6 client(s)",
    ),
}
# the fleet export as a user runs it (benchmarks/export_speed.py --caller-threads)
EXPORT_CLI = REPO / "benchmarks" / "results" / "export_profile" / "cli" / "speed.csv"
# batch-1 reruns of runtime_latency.py: the table's opening words -> the folder of its runs
LATENCY_RERUNS = {
    "**The query rounded by one QuantizeLinear": REPO
    / "benchmarks/results/runtime/last_mib/rerun_quantize_linear",
    "**Small int8 stores baked into the session": REPO
    / "benchmarks/results/runtime/last_mib/baked",
}
EXPORT_CLI_HEADING = "### The fleet export as a user runs it, before and after"
MODEL_UPDATE_TABLES = {
    "##### kNN-Per (each bundle's lambda)": "accuracy",
    "##### the datastore alone (lambda 1)": "knn_accuracy",
}


class Checker:
    def __init__(self) -> None:
        self.checked = 0
        self.mismatches: list[str] = []

    def same(self, where: str, expected: Any, found: Any, tol: float = TOLERANCE) -> None:
        self.checked += 1
        if isinstance(expected, float | int) and isinstance(found, float | int):
            ok = math.isclose(float(expected), float(found), rel_tol=0, abs_tol=tol)
        else:
            ok = expected == found
        if ok:
            return
        if isinstance(expected, str) and isinstance(found, str):  # a rendered file: name its
            pairs = zip(expected.splitlines(), found.splitlines(), strict=False)  # first diff
            line, (expected, found) = next(
                ((i, p) for i, p in enumerate(pairs, 1) if p[0] != p[1]),
                (0, (expected[-80:], found[-80:])),
            )
            where = f"{where} line {line}"
        self.mismatches.append(f"{where}: recomputed {expected!r}, file says {found!r}")


def method_rows(clients: Iterable[Mapping[str, Any]], column: str) -> list[dict[str, Any]]:
    return [
        {"unseen": c["unseen"], "n_test": c["n_test"], "accuracy": c.get(column)}
        for c in clients
        if c.get(column) is not None
    ]


def check_table(folder: Path, check: Checker, render: bool = False) -> dict[str, Any]:
    """One table folder; returns its results rebuilt from clients.csv (for the seeds check).
    `render`: rewrite its table.md from them first."""
    name = folder.relative_to(REPO)
    results = json.loads((folder / "results.json").read_text())
    clients = read_csv(folder / "clients.csv")
    rebuilt = {**results, "clients": clients, "seen": {}, "unseen": {}}
    for method in results["methods"]:
        summary = summarize(method_rows(clients, method))
        for group in ("seen", "unseen"):
            if summary[group] is None:
                continue
            rebuilt[group][method] = summary[group]
            for stat in ("mean", "bottom_decile", "clients"):
                check.same(
                    f"{name}/results.json {group} {method} {stat}",
                    summary[group][stat],
                    results[group][method][stat],
                )
    for group, table in (("seen", "table1.csv"), ("unseen", "table2.csv")):
        for row in read_csv(folder / table):
            s = rebuilt[group].get(row["method"])
            for stat in ("mean", "bottom_decile"):
                check.same(
                    f"{name}/{table} {row['method']} {stat}",
                    None if s is None else round(s[stat], 6),
                    row[stat],
                    1e-6,
                )
    if "knn" in results and "oracle" in results["knn"]:
        oracle = summarize(method_rows(clients, "knnper_oracle_accuracy"))
        for group in ("seen", "unseen"):
            if oracle[group] is not None:
                for stat in ("mean", "bottom_decile"):
                    check.same(
                        f"{name} oracle {group} {stat}",
                        oracle[group][stat],
                        results["knn"]["oracle"][group][stat],
                    )
        rebuilt["knn"] = {**results["knn"], "oracle": oracle}
        _check_lambda_report(name, clients, results["knn"].get("lambda_report", {}), check)
    if (folder / "attribution.csv").exists():
        _check_attribution(name, read_csv(folder / "attribution.csv"), results, check)
    # the rendered table, from the recomputed figures (choices and grids as recorded)
    if render:
        write_text_atomic(folder / "table.md", format_markdown(rebuilt))
    check.same(f"{name}/table.md", format_markdown(rebuilt), (folder / "table.md").read_text())
    return rebuilt


def _check_lambda_report(
    name: Path, clients: list[dict], report: Mapping[str, Any], check: Checker
) -> None:
    scored = [
        c
        for c in clients
        if c.get("knnper") is not None and c.get("knnper_oracle_lambda") is not None
    ]
    if not report.get("clients"):
        return
    w = sum(c["n_test"] for c in scored)
    honest = sum(c["knnper"] * c["n_test"] for c in scored) / w
    oracle = sum(c["knnper_oracle_accuracy"] * c["n_test"] for c in scored) / w
    check.same(f"{name} lambda report clients", len(scored), report["clients"])
    check.same(
        f"{name} lambda report differs",
        sum(c["knnper_lambda"] != c["knnper_oracle_lambda"] for c in scored),
        report["differs"],
    )
    check.same(f"{name} lambda report cost_pp", 100 * (oracle - honest), report["cost_pp"], 1e-7)


def _check_attribution(
    name: Path, rows: list[dict], results: Mapping[str, Any], check: Checker
) -> None:
    summary = results["attribution"]["summary"]
    for key in summary:
        body, head = key.split("/")
        got = summarize(
            [
                r
                for r in rows
                if r["body"] == body and r["head"] == head and r["accuracy"] is not None
            ]
        )
        for group in ("seen", "unseen"):
            if got[group] is None:
                continue
            for stat in ("mean", "bottom_decile"):
                check.same(
                    f"{name}/attribution.csv {key} {group} {stat}",
                    got[group][stat],
                    summary[key][group][stat],
                )


def check_seeds(folder: Path, check: Checker, render: bool = False) -> dict[str, Any] | None:
    if not (folder / SEEDS_FILE).exists():
        return None
    name = folder.relative_to(REPO)
    recorded = json.loads((folder / SEEDS_FILE).read_text())
    seeds = recorded["seeds"]
    results = [check_table(folder / f"seed_{s}", check, render) for s in seeds]
    summary = summarize_seeds(results, seeds)
    text = (folder / "seeds.md").read_text()
    found = re.search(r"```bash\n(.*?)\n```", text, re.S)
    if render:
        recorded = summary
        text = format_seeds(summary, TITLES, found and found.group(1))
        write_text_atomic(folder / SEEDS_FILE, json.dumps(summary, indent=2))
        write_text_atomic(folder / "seeds.md", text)
    _compare_tree(f"{name}/seeds.json", summary, recorded, check)
    check.same(f"{name}/seeds.md", format_seeds(summary, TITLES, found and found.group(1)), text)
    for row in read_csv(folder / "seeds.csv"):
        s = summary["spread"][row["group"]][row["method"]]
        for stat in ("mean", "bottom_decile"):
            for k in ("mean", "std"):
                check.same(
                    f"{name}/seeds.csv {row['group']} {row['method']} {stat}_{k}",
                    s[stat][k],
                    row[f"{stat}_{k}"],
                    1e-12,
                )
    return summary


def _compare_tree(where: str, expected: Any, found: Any, check: Checker) -> None:
    if isinstance(expected, dict) and isinstance(found, dict):
        if set(expected) != set(found):
            check.same(f"{where} keys", sorted(expected), sorted(found))
        for k in set(expected) & set(found):
            _compare_tree(f"{where}.{k}", expected[k], found[k], check)
    elif isinstance(expected, list) and isinstance(found, list) and len(expected) == len(found):
        for i, (a, b) in enumerate(zip(expected, found, strict=True)):
            _compare_tree(f"{where}[{i}]", a, b, check)
    else:
        check.same(where, expected, found)


def _markdown_table(text: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the first table after `heading` in a markdown text."""
    start = text.index(heading)
    lines = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            lines.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif lines:
            break
    return lines[0], [r for r in lines[2:]]


def _numbers(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+\.\d+", cell.replace("**", ""))]


def published_text() -> str:
    """Every benchmark page, one after another: the tables are found by their headings, on
    whichever page they moved to."""
    pages = [*sorted(PAGES.glob("*.md")), REPO / "BENCHMARKS.md"]
    return "\n\n".join(p.read_text() for p in pages if p.is_file())


def _found(text: str, heading: str, check: Checker) -> bool:
    if heading in text:
        return True
    check.same(f"benchmark pages: the heading {heading!r}", "found", "not found")
    return False


def check_benchmarks_md(text: str, fair: Mapping[str, dict], check: Checker) -> None:
    for heading, group in (
        ("### Seen clients (Table 1): mean / bottom 10%", "seen"),
        ("### Unseen clients (Table 2): mean / bottom 10%", "unseen"),
    ):
        if not _found(text, heading, check):
            continue
        header, rows = _markdown_table(text, heading)
        for row in rows:
            label = row[0].replace("**", "")
            column = "knnper_oracle_accuracy" if "test-oracle" in label else BY_TITLE.get(label)
            for title, cell in zip(header[1:], row[1:], strict=True):
                result = fair[FAIR_TABLES[title]]
                s = (
                    result["knn"]["oracle"][group]
                    if column == "knnper_oracle_accuracy"
                    else result[group][column]
                )
                check.same(
                    f"benchmark pages {heading[4:20]} {label} {title}",
                    [round(100 * s["mean"], 1), round(100 * s["bottom_decile"], 1)],
                    _numbers(cell),
                )


def _group_cells(
    text: str, heading: str, seeds: Mapping[str, dict], tables: Mapping[str, str], check: Checker
) -> Iterator[tuple[str, str, str, dict | None, str]]:
    """Every cell of the seen and unseen clients' tables under `heading` (each found by its
    heading, or a mismatch): its group, row label, column (a table's title), that table's
    seeds.json summary (None where it has none) and its text."""
    for group, suffix in (("seen", "seen clients"), ("unseen", "unseen clients")):
        title = f"{heading}, {suffix}"
        if not _found(text, title, check):
            continue
        header, rows = _markdown_table(text, title)
        for row in rows:
            label = row[0].replace("**", "")
            for table, cell in zip(header[1:], row[1:], strict=True):
                yield group, label, table, seeds.get(tables[table]), cell


def check_seeds_md(
    text: str,
    seeds: Mapping[str, dict],
    check: Checker,
    heading: str = SEEDS_HEADING,
    tables: Mapping[str, str] = SEED_TABLES,
) -> None:
    """The across-seed section of the benchmark pages under `heading` against each seeds.json:
    its mean ± std tables, then its comparison table (kNN-Per minus the named baseline, its
    interval and its verdict)."""
    spread = f"{heading}: mean ± std across seeds"
    if _found(text, spread, check):
        for group, label, title, summary, cell in _group_cells(text, spread, seeds, tables, check):
            if summary is None or cell == "-":
                continue
            method = (
                "knnper_oracle"
                if "test-oracle" in label
                else "knnper_cross_oracle"
                if "cross-oracle" in label
                else BY_TITLE.get(label)
            )
            s = summary["spread"][group][method]
            check.same(
                f"benchmark pages seeds {group} {label} {title}",
                [
                    round(100 * s[st][k], 1)
                    for st in ("mean", "bottom_decile")
                    for k in ("mean", "std")
                ],
                _numbers(cell),
            )
    versus = f"{heading}: kNN-Per minus a baseline"
    if not _found(text, versus, check):
        return
    _, rows = _markdown_table(text, versus)
    for table, group, stat, baseline, cell, verdict in rows:
        summary = seeds.get(tables[table])
        if summary is None:
            check.same(f"benchmark pages versus {table}", "a committed seeds.json", "none")
            continue
        stat_key = {"mean": "mean", "bottom decile": "bottom_decile"}[stat]
        c = summary["versus_each"][group][stat_key][BY_TITLE[baseline.replace("**", "")]]
        where = f"benchmark pages versus {table} {group} {stat} {baseline}"
        check.same(where, [round(100 * c[k], 2) for k in ("diff", "low", "high")], _numbers(cell))
        check.same(f"{where} verdict", c["verdict"], verdict.replace("**", ""))


def check_hurt_md(
    text: str,
    seeds: Mapping[str, dict],
    check: Checker,
    heading: str = HURT_HEADING,
    tables: Mapping[str, str] = SEED_TABLES,
) -> None:
    """The benchmark pages' clients-hurt tables under `heading` against each seeds.json: every
    method's share below FedAvg, and kNN-Per's below FedAvg+ (its row "kNN-Per, below
    FedAvg+"), as mean ± std [interval]."""
    for group, label, table, summary, cell in _group_cells(text, heading, seeds, tables, check):
        method, reference = (
            ("knnper", "fedavg+")
            if label == "kNN-Per, below FedAvg+"
            else (BY_TITLE.get(label), "fedavg")
        )
        h = (summary or {}).get("hurt", {}).get(group, {}).get(method, {}).get(reference)
        check.same(
            f"benchmark pages hurt {group} {label} {table}",
            [] if h is None else [round(100 * h[k], 1) for k in ("share", "std", "low", "high")],
            _numbers(cell),
        )


def check_model_update_md(text: str, check: Checker) -> None:
    """Each (gap, path) cell of the model-update tables: the mean and standard deviation
    across seeds of the seed's mean accuracy over its clients, in percent."""
    if not _found(text, MODEL_UPDATE_HEADING, check):
        return
    section = text[text.index(MODEL_UPDATE_HEADING) :]
    for name, data_heading in MODEL_UPDATE_DATA.items():
        if not _found(section, data_heading, check):
            continue
        part = section[section.index(data_heading) :]
        rows = read_csv(MODEL_UPDATE / name / "clients.csv")
        for heading, column in MODEL_UPDATE_TABLES.items():
            if not _found(part, heading, check):
                continue
            header, table = _markdown_table(part, heading)
            for row in table:
                for path, cell in zip(header[1:], row[1:], strict=True):
                    per_seed: dict[int, list[float]] = {}
                    for r in rows:
                        if r["gap"] == row[0] and r["path"] == path:
                            per_seed.setdefault(r["seed"], []).append(float(r[column]))
                    # in experiments.model_update.summarise's order, so the last digit agrees
                    means = [float(np.mean(v)) for v in per_seed.values()]
                    std = float(np.std(means, ddof=1)) if len(means) > 1 else 0.0
                    expected = [100 * float(np.mean(means)), 100 * std] if means else []
                    check.same(
                        f"model update {name} {heading[6:20]} {row[0]} {path}",
                        [float(f"{x:.2f}") for x in expected],
                        _numbers(cell),
                    )


def check_cli_start_md(text: str, check: Checker) -> None:
    """Each row of the start-up table (benchmarks/cli_start.py): the medians of the first line,
    of the CPU time and of the load average over that tree's and command's processes, and the
    target's verdict, from every process in samples.csv."""
    if not _found(text, CLI_START_HEADING, check):
        return
    samples = read_csv(CLI_START, text_columns=("tree", "case"))
    header, rows = _markdown_table(text, CLI_START_HEADING)
    for row in rows:
        cells = dict(zip(header, row, strict=True))
        tree, case = cells["tree"], cells["command"].strip("`")
        mine = [r for r in samples if r["tree"] == tree and r["case"] == case]
        check.same(f"cli start {tree} {case}: processes", len(mine), int(cells["runs"]))
        if not mine:
            continue
        for column, key, digits in (
            ("first line median s", "first_line_s", 3),
            ("CPU median s", "cpu_s", 3),
            ("load average", "load", 2),
        ):
            median = statistics.median(r[key] for r in mine)
            check.same(
                f"cli start {tree} {case}: {column}", round(median, digits), float(cells[column])
            )
        spread = [min(r["first_line_s"] for r in mine), max(r["first_line_s"] for r in mine)]
        check.same(
            f"cli start {tree} {case}: first line min-max",
            [round(x, 3) for x in spread],
            _numbers(cells["first line min-max s"]),
        )
        if cells["target"] != "-":
            first = statistics.median(r["first_line_s"] for r in mine)
            verdict = "met" if first <= CLI_START_TARGET_S else "missed"
            check.same(f"cli start {tree} {case}: target", verdict, cells["target"].strip("*"))


def check_export_cli_md(text: str, check: Checker) -> None:
    """Each row of the fleet export's timing table: its wall and CPU seconds (the command and
    its workers), the load before and after it and the bundles' test accuracy, from speed.csv."""
    if not _found(text, EXPORT_CLI_HEADING, check):
        return
    words = ("label", "search", "threads_env", "machine", "command")
    runs = {r["label"]: r for r in read_csv(EXPORT_CLI, text_columns=words)}
    header, rows = _markdown_table(text, EXPORT_CLI_HEADING)
    for row in rows:
        cells = dict(zip(header, row, strict=True))
        label = cells["run"].strip("`")
        found = runs.get(label)
        check.same(f"export cli {label}", "in the CSV", "in the CSV" if found else "not")
        if found is None:
            continue
        check.same(
            f"export cli {label}: wall, CPU, load",
            [found[k] for k in ("wall_s", "cpu_s", "load_before", "load_after")],
            _numbers(cells["wall s"]) + _numbers(cells["CPU s"]) + _numbers(cells["load"]),
        )
        check.same(
            f"export cli {label}: test accuracy",
            round(100 * found["test_accuracy"], 2),
            float(cells["mean test acc %"]),
        )


def check_export_profile_md(text: str, check: Checker) -> None:
    """Each stage of an export profile's table: its calls, CPU seconds and share of the
    export's CPU time, from the profile's CSV."""
    for heading, (path, scope) in EXPORT_PROFILES.items():
        if not _found(text, heading, check):
            continue
        stages = {r["stage"]: r for r in read_csv(path) if r["scope"] == scope}
        total = next(r["cpu_s"] for name, r in stages.items() if name.startswith("total"))
        header, rows = _markdown_table(text, heading)
        for row in rows:
            cells = dict(zip(header, row, strict=True))
            found = stages.get(cells["stage"])
            check.same(
                f"{heading[4:]}: {cells['stage']}", "in the CSV", "in the CSV" if found else "not"
            )
            if found is None:
                continue
            check.same(
                f"{heading[4:]}: {cells['stage']} calls", found["calls"], int(cells["calls"])
            )
            check.same(
                f"{heading[4:]}: {cells['stage']} CPU",
                [round(found["cpu_s"], 2), round(100 * found["cpu_s"] / total, 1)],
                _numbers(cells["CPU s"]) + _numbers(cells["share of the CPU time"]),
            )


def check_latency_reruns_md(text: str, check: Checker) -> None:
    """Each run of a batch-1 rerun table: the runtime over the encoder alone with int8 and
    float32 keys, and the encoder alone's p50 in the int8 loop, from the run's latency.csv."""
    for heading, folder in LATENCY_RERUNS.items():
        if not _found(text, heading, check):
            continue
        header, rows = _markdown_table(text, heading)
        for row in rows:
            run = row[0]
            found = {r["recipe"]: r for r in read_csv(folder / run / "latency.csv")}
            int8, fp32 = found["flat:int8"], found["flat:fp32"]
            check.same(
                f"{heading[2:]}: {run}",
                [round(int8["b1_over_encoder"], 4), round(fp32["b1_over_encoder"], 4)]
                + [round(int8["b1_p50_ms_encoder"], 3)],
                [n for cell in row[1:] for n in _numbers(cell)],
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--render",
        action="store_true",
        help="rewrite table.md, seeds.json and seeds.md from the per-client files first",
    )
    render = p.parse_args().render
    check = Checker()
    fair = {name: check_table(FAIR / name, check, render) for name in FAIR_TABLES.values()}
    seeds = {}
    for name in (*SEED_TABLES.values(), *DEFAULT_SEED_TABLES.values(), *PAPER_RULE_FOLDERS):
        if (SEEDS / name).is_dir():
            seeds[name] = check_seeds(SEEDS / name, check, render)
    text = published_text()
    found = {k: v for k, v in seeds.items() if v}
    check_benchmarks_md(text, fair, check)
    for heading, tables in ((SEEDS_HEADING, SEED_TABLES), (DEFAULT_HEADING, DEFAULT_SEED_TABLES)):
        check_seeds_md(text, found, check, heading, tables)
    check_hurt_md(text, found, check)
    check_model_update_md(text, check)
    check_cli_start_md(text, check)
    check_export_profile_md(text, check)
    check_export_cli_md(text, check)
    check_latency_reruns_md(text, check)
    for line in check.mismatches:
        print(f"MISMATCH {line}")
    print(f"{check.checked} figures recomputed, {len(check.mismatches)} mismatches")
    return 1 if check.mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
