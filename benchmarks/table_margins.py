"""Margins for the one-seed tables of BENCHMARKS.md that predate `bench table --seeds`: the
kNN-Per-versus-FedAvg runs ("kNN-Per versus FedAvg and local training") and the from-scratch
baseline tables ("Personalized-FL baselines: the paper's Tables 1 and 2 at CPU scale"). For
every group (seen, unseen) and statistic (mean, bottom decile) it gives the best method minus the
runner-up, and kNN-Per minus every other method, each with the paired bootstrap 95% interval
over clients that `bench table --seeds` uses (experiments.table_seeds.paired_bootstrap), so a
method is bolded as best only where its interval excludes zero.

    python benchmarks/table_margins.py            # writes benchmarks/results/margins/
    python benchmarks/table_margins.py --check    # recompute and compare (CI, via check_figures)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.benchmark_support import markdown_table, read_csv, write_csv  # noqa: E402
from experiments.table_seeds import GROUPS, STATS, paired_bootstrap, verdict  # noqa: E402
from experiments.tables import titles  # noqa: E402
from fed_train.evaluation import summarize  # noqa: E402

TITLES = titles()  # method -> its title in the tables, from the baselines' registry

RESULTS = REPO / "benchmarks" / "results"
OUT = RESULTS / "margins"
# title in BENCHMARKS.md -> the committed per-client file it was computed from
TABLES = {
    "kNN-Per vs FedAvg, Fashion-MNIST": "fmnist_dirichlet0.3_evaluation.json",
    "kNN-Per vs FedAvg, CIFAR-10": "cifar10_dirichlet0.3_evaluation.json",
    "from scratch, Fashion-MNIST": "tables/fashion-mnist/clients.csv",
    "from scratch, CIFAR-10": "tables/cifar10/clients.csv",
    "from scratch, CIFAR-10 v2": "tables/cifar10-v2/clients.csv",
}
COLUMNS = ("table", "group", "stat", "method", "versus", "diff", "low", "high", "verdict")


def client_rows(path: Path) -> list[dict[str, Any]]:
    """One row per client with one accuracy column per method (the evaluation JSON's own
    client rows, or bench table's clients.csv)."""
    if path.suffix == ".json":
        return json.loads(path.read_text())["clients"]
    return read_csv(path)


def methods_of(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The accuracy columns: a method's name is a column of TITLES' keys."""
    return [m for m in TITLES if m in rows[0]]


def margins(title: str, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    methods = methods_of(rows)
    out = []
    summary = {
        m: summarize(
            [{"unseen": bool(r["unseen"]), "n_test": r["n_test"], "accuracy": r[m]} for r in rows]
        )
        for m in methods
    }
    for group in GROUPS:
        if any(summary[m][group] is None for m in methods):
            continue
        for stat in STATS:
            value = {m: summary[m][group][stat] for m in methods}
            ranked = sorted(methods, key=lambda m: value[m], reverse=True)
            pairs = [(ranked[0], ranked[1])]
            pairs += [
                ("knnper", m)
                for m in methods
                if m != "knnper" and "knnper" in methods and ("knnper", m) not in pairs
            ]
            for a, b in pairs:
                iv = paired_bootstrap([rows], group, a, b, stat)
                out.append(
                    {
                        "table": title,
                        "group": group,
                        "stat": stat,
                        "method": a,
                        "versus": b,
                        **(iv or {}),
                        "verdict": verdict(iv, a, b),
                    }
                )
    return out


def all_margins() -> list[dict[str, Any]]:
    return [
        row for title, file in TABLES.items() for row in margins(title, client_rows(RESULTS / file))
    ]


def write(rows: Sequence[Mapping[str, Any]], out: Path) -> None:
    write_csv(out / "margins.csv", rows, COLUMNS)
    shown = [
        {
            **r,
            "method": TITLES[r["method"]],
            "versus": TITLES[r["versus"]],
            **{k: 100 * r[k] for k in ("diff", "low", "high") if r.get(k) is not None},
        }
        for r in rows
    ]
    lines = [
        "# One-seed margins of the older tables",
        "",
        "Method minus versus, pp, with the paired bootstrap 95% interval over clients "
        "(2000 draws). The first row of each group and statistic is the best method "
        "against the runner-up. Command: `python benchmarks/table_margins.py`.",
        "",
    ]
    for title in TABLES:
        lines += [
            f"## {title}",
            "",
            markdown_table(
                [r for r in shown if r["table"] == title],
                [
                    ("group", "clients", ""),
                    ("stat", "statistic", ""),
                    ("method", "method", ""),
                    ("versus", "minus", ""),
                    ("diff", "difference", "+.2f"),
                    ("low", "2.5%", "+.2f"),
                    ("high", "97.5%", "+.2f"),
                    ("verdict", "verdict", ""),
                ],
            ),
            "",
        ]
    (out / "margins.md").write_text("\n".join(lines))


def same_row(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    """The CSV keeps 6 significant digits (benchmark_support.write_csv)."""
    for key in COLUMNS:
        a, b = new.get(key), old.get(key)
        if isinstance(a, float) and isinstance(b, float | int):
            if not math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-9):
                return False
        elif a != b:
            return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--check",
        action="store_true",
        help="recompute and compare with the committed margins.csv; exit 1 on a difference",
    )
    args = p.parse_args(argv)
    rows = all_margins()
    if not args.check:
        write(rows, OUT)
        print(f"wrote {OUT / 'margins.csv'} and margins.md ({len(rows)} rows)")
        return 0
    committed = read_csv(OUT / "margins.csv")
    bad = [
        f"{r['table']} {r['group']} {r['stat']} {r['method']} - {r['versus']}"
        for r, c in zip(rows, committed, strict=False)
        if not same_row(r, c)
    ]
    if len(rows) != len(committed):
        bad.append(f"{len(rows)} rows recomputed, {len(committed)} committed")
    for line in bad:
        print(f"MISMATCH {line}")
    print(f"{len(rows)} margins recomputed, {len(bad)} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
