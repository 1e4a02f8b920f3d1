"""kNN-Per's default personalization against the paper's per-client lambda rule, client by
client, on the same protocol and seeds: for each pair of seeds folders (a `bench table --seeds`
run with the default, and the same command with `--methods knnper --lambda-rule client --base
global`), the default minus the paper's rule in seen and unseen mean and bottom decile, with the
paired bootstrap 95% interval over clients that `bench table --seeds` uses.

    python benchmarks/rule_pairs.py          # writes benchmarks/results/seeds/rule_pairs.*
    python benchmarks/rule_pairs.py --check  # recompute from the committed clients.csv
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edge_runtime._io import write_bytes_atomic  # noqa: E402
from experiments.benchmark_support import markdown_table, read_csv  # noqa: E402
from experiments.table_seeds import GROUPS, STATS, paired_bootstrap, verdict  # noqa: E402

SEEDS = REPO / "benchmarks" / "results" / "seeds"
# (table, folder with the default, folder with the paper's rule)
PAIRS = (
    ("Fashion-MNIST alpha 0.3", "fashion-mnist-default", "fashion-mnist-paper-rule"),
    ("CIFAR-10 alpha 0.3", "cifar10-default", "cifar10-paper-rule"),
)


def _paired_rows(default: Path, paper: Path) -> list[list[dict[str, Any]]]:
    """Per seed, one row per client with the default's and the paper rule's accuracy."""
    per_seed = []
    for seed_dir in sorted(default.glob("seed_*")):
        theirs = {r["client_id"]: r for r in read_csv(paper / seed_dir.name / "clients.csv")}
        rows = []
        for r in read_csv(seed_dir / "clients.csv"):
            other = theirs[r["client_id"]]
            if other["n_test"] != r["n_test"] or other["unseen"] != r["unseen"]:
                raise ValueError(
                    f"{seed_dir.name}: client {r['client_id']} differs between "
                    f"{default.name} and {paper.name}: not the same partition"
                )
            rows.append(
                {
                    "unseen": r["unseen"],
                    "n_test": r["n_test"],
                    "default": r["knnper"],
                    "paper_rule": other["knnper"],
                }
            )
        per_seed.append(rows)
    return per_seed


def compute() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for table, default, paper in PAIRS:
        if not (SEEDS / paper).is_dir():
            continue
        per_seed = _paired_rows(SEEDS / default, SEEDS / paper)
        cells = {}
        for group in GROUPS:
            for stat in STATS:
                iv = paired_bootstrap(per_seed, group, "default", "paper_rule", stat)
                cells[f"{group} {stat}"] = (
                    None if iv is None else {**iv, "verdict": verdict(iv, "default", "paper rule")}
                )
        out[table] = {
            "seeds": len(per_seed),
            "default": default,
            "paper_rule": paper,
            "default_minus_paper_rule": cells,
        }
    return out


def render(result: dict[str, Any]) -> str:
    rows = []
    for table, r in result.items():
        for cell, iv in r["default_minus_paper_rule"].items():
            rows.append(
                {
                    "table": table,
                    "cell": cell.replace("_", " "),
                    "diff": None
                    if iv is None
                    else f"{100 * iv['diff']:+.2f} [{100 * iv['low']:+.2f}, "
                    f"{100 * iv['high']:+.2f}]",
                    "verdict": None if iv is None else iv["verdict"],
                }
            )
    columns = [
        ("table", "table", ""),
        ("cell", "clients, statistic", ""),
        ("diff", "default minus paper rule, pp [95% interval]", ""),
        ("verdict", "verdict", ""),
    ]
    return (
        "# kNN-Per's default minus the paper's per-client lambda rule, same seeds\n\n"
        "Paired bootstrap over clients, resampled within each seed (2000 draws).\n\n"
        + markdown_table(rows, columns)
        + "\n"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--check",
        action="store_true",
        help="recompute and compare with the committed files; exit 1 on a mismatch",
    )
    args = p.parse_args()
    result = compute()
    text = json.dumps(result, indent=2, sort_keys=True) + "\n"
    paths = {SEEDS / "rule_pairs.json": text, SEEDS / "rule_pairs.md": render(result)}
    if args.check:
        stale = [
            str(path)
            for path, content in paths.items()
            if not path.exists() or path.read_text() != content
        ]
        print(
            f"{len(paths) - len(stale)} of {len(paths)} files match the recomputation"
            + "".join(f"\nMISMATCH {s}" for s in stale)
        )
        return 1 if stale else 0
    for path, content in paths.items():
        write_bytes_atomic(path, content.encode())
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
