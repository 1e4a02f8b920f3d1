"""kNN-Per's personalization rules side by side on the same trained models: each client's own
lambda (the paper's rule), one pooled lambda, the shrunk rule and the cross-validated choice
among them, all with the global model as the base; the kNN interpolated with each client's linear
head instead (rule cross-validated); FedAvg's body with the linear head alone; and the project's
default (base and rule both cross-validated). The test-oracle and split-half cross-oracle rows
(global base, per-client rule) are for scale. Everything but the oracle rows is chosen on
validation; per-client rows are kept so the summary can be recomputed.

    python benchmarks/lambda_rules.py --dataset fashion-mnist \
        --data /usr/share/datasets/fashion-mnist --clients 30 --max-train 6000 --rounds 10 \
        --seeds 3 --out benchmarks/results/lambda_rules/fashion-mnist

Resumes: each seed's run and rows are kept under OUT/seed_S/."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_runtime._io import csv_text, write_json_atomic, write_text_atomic
from edge_runtime.knn import LAMBDA_RULES
from experiments.benchmark_support import machine_info, machine_line
from experiments.table_seeds import paired_bootstrap
from fed_train.algorithms.base import TrainingConfig
from fed_train.knn_request import KNNRequest
from fed_train.knn_tuning import (
    choose_knn,
    choose_l2,
    client_views,
    linear_base_views,
    normalized_views,
)
from fed_train.run import RunConfig, load_run, train

RULES = (*LAMBDA_RULES, "auto")
# column: (lambda rule, base) given to choose_knn
SETTINGS = {
    **{rule: (rule, "global") for rule in RULES},
    "knn+linear": ("auto", "linear"),
    "default": ("auto", "auto"),
}
COLUMNS = (*SETTINGS, "linear_alone", "oracle", "cross_oracle")


def choose(run: Any, rule: str, base: str, seed: int) -> tuple[Any, Any, dict]:
    """choose_knn on the run's clients over KNNRequest's default grids."""
    ks, sigmas, norms = KNNRequest().grids()
    return choose_knn(
        run.model,
        run.clients(),
        ks=ks,
        sigmas=sigmas,
        normalizations=norms,
        rule=rule,
        base=base,
        seed=seed,
    )


def seed_rows(args: argparse.Namespace, seed: int) -> list[dict]:
    """One row per client of this seed: its test accuracy under every rule and the oracles."""
    out = Path(args.out) / f"seed_{seed}"
    cached = out / "rows.json"
    if cached.exists():
        saved = json.loads(cached.read_text())
        if saved.get("columns") == list(COLUMNS):
            return saved["rows"]
    config = RunConfig(
        dataset=args.dataset,
        data=args.data,
        max_train=args.max_train,
        partition="dirichlet",
        alpha=args.alpha,
        clients=args.clients,
        seed=seed,
        training=TrainingConfig(rounds=args.rounds),
    )
    train(config, out / "run", progress=False)
    run = load_run(out / "run")
    rows: dict[int, dict] = {}
    for column, (rule, base) in SETTINGS.items():
        _, _, record = choose(run, rule, base, seed)
        for r in record["oracle_rows"]:
            row = rows.setdefault(
                r["client_id"],
                {
                    "seed": seed,
                    "client_id": r["client_id"],
                    "unseen": r["unseen"],
                    "n_test": r["n_test"],
                },
            )
            row[column] = r["accuracy"]
            row[f"{column}_rule"] = f"{record['base']['name']}/{record['lambda_rule']['name']}"
            if column == "client":
                row["oracle"] = r["info"].get("oracle_accuracy")
                row["cross_oracle"] = r["info"].get("cross_oracle_accuracy")
    views = client_views(run.model, run.clients())
    l2, _ = choose_l2(views)
    for v in linear_base_views(views, l2):
        if len(v.y_test):
            rows[v.client_id]["linear_alone"] = float(np.mean(v.p_test.argmax(1) == v.y_test))
    result = [rows[c] for c in sorted(rows) if rows[c]["n_test"]]
    write_json_atomic(cached, {"columns": list(COLUMNS), "rows": result})
    return result


def explain(args: argparse.Namespace, seed: int) -> dict:
    """Where the default stands against the linear head alone, from this seed's saved run: the
    kNN configuration and base the default chose, the linear head alone on raw and on
    normalised embeddings, and how many seen clients' lambdas left 0 (seen mean, %)."""
    run = load_run(Path(args.out) / f"seed_{seed}" / "run")
    views = client_views(run.model, run.clients())
    config, _, record = choose(run, "auto", "auto", seed)

    def seen_accuracy(vs: list) -> float:
        seen = [v for v in vs if not v.unseen and len(v.y_test)]
        right = sum(int(np.sum(v.p_test.argmax(1) == v.y_test)) for v in seen)
        return 100 * right / sum(len(v.y_test) for v in seen)

    raw_l2, _ = choose_l2(views)
    norm_l2, _ = choose_l2(normalized_views(views, config.normalize))
    lambdas = [r["info"]["lambda"] for r in record["oracle_rows"] if not r["unseen"]]
    return {
        "seed": seed,
        "config": config.to_dict(),
        "base": record["base"]["name"],
        "rule": record["lambda_rule"]["name"],
        "linear_raw": seen_accuracy(linear_base_views(views, raw_l2)),
        "linear_normalized": seen_accuracy(linear_base_views(views, norm_l2, config.normalize)),
        "seen_clients": len(lambdas),
        "lambda_not_zero": sum(lam > 0 for lam in lambdas),
    }


def mean(rows: list[dict], group: str, column: str) -> float:
    scored = [r for r in rows if r["unseen"] == (group == "unseen")]
    return 100 * sum(r[column] * r["n_test"] for r in scored) / sum(r["n_test"] for r in scored)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--dataset", default="digits")
    p.add_argument("--data", default=None, help="data folder for the data set")
    p.add_argument("--max-train", type=int, default=None, help="training samples drawn")
    p.add_argument("--alpha", type=float, default=0.3, help="Dirichlet concentration")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", required=True, help="results folder (resumes)")
    p.add_argument(
        "--explain",
        action="store_true",
        help="also write explain.json: the default against the linear head alone, "
        "per seed, from the saved runs",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    per_seed = [seed_rows(args, s) for s in range(args.seeds)]
    out = Path(args.out)
    rows = [r for seed in per_seed for r in seed]
    write_text_atomic(out / "clients.csv", csv_text(rows, list(rows[0])))
    lines = [
        f"# Lambda rules: {args.dataset}, {args.clients} clients, {args.rounds} rounds, "
        f"{args.seeds} seeds",
        "",
        f"Machine: {machine_line(machine_info())}; torch {torch.__version__}."
        " Test accuracy in % (mean weighted by test size; per seed, then averaged). "
        "The oracle rows choose lambda on test data: for scale only.",
        "",
        "| rule | " + " | ".join(f"{g} mean" for g in ("seen", "unseen")) + " |",
        "|---|---|---|",
    ]
    for column in COLUMNS:
        cells = [
            sum(mean(rows, g, column) for rows in per_seed) / len(per_seed)
            for g in ("seen", "unseen")
        ]
        lines.append(f"| {column} | {cells[0]:.2f} | {cells[1]:.2f} |")
    for column in ("auto", "default"):
        chosen = sorted({r[f"{column}_rule"] for rows in per_seed for r in rows})
        lines.append(f"`{column}` chose (base/rule): {', '.join(chosen)}.")
    lines.append("")
    summary: dict = {}
    for reference, compared in (
        ("client", ("pooled", "shrunk", "auto", "knn+linear", "default", "linear_alone")),
        ("linear_alone", ("knn+linear", "default")),
    ):
        lines += [
            f"Minus `{reference}` (paired bootstrap 95% interval over clients, within seeds):",
            "",
            "| setting | group | mean (pp) | bottom decile (pp) |",
            "|---|---|---|---|",
        ]
        for rule in compared:
            for group in ("seen", "unseen"):
                cells = []
                for stat in ("mean", "bottom_decile"):
                    iv = paired_bootstrap(per_seed, group, rule, reference, stat)
                    summary[f"{rule}-minus-{reference}-{group}-{stat}"] = iv
                    cells.append(
                        "-"
                        if iv is None
                        else f"{100 * iv['diff']:+.2f} [{100 * iv['low']:+.2f}, "
                        f"{100 * iv['high']:+.2f}]"
                    )
                lines.append(f"| {rule} | {group} | {cells[0]} | {cells[1]} |")
        lines.append("")
    if args.explain:
        write_json_atomic(
            out / "explain.json", {"seeds": [explain(args, s) for s in range(args.seeds)]}
        )
    write_json_atomic(out / "summary.json", {"args": vars(args), "intervals": summary})
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
