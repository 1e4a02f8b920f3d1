"""kNN-Per with the paper's fixed setting against the configuration chosen on validation (the
default), on the server (`knnper evaluate`) and on the device (the default export, every bundle
run through the edge runtime on its client's test split), for one finished run.

    python benchmarks/knn_config_device.py --run runs/fmnist --budget 2MB \
        --out benchmarks/results/knn_config/fmnist

Writes clients.csv (one row per client and setting: server and device accuracy and lambda),
summary.json and summary.md. Resumable: each setting's server rows and device rows are kept in
OUT as they finish; the bundles go to --bundles (not committed).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from edge_runtime.arg_types import byte_count
from experiments import benchmark_support as C
from experiments.table_seeds import paired_bootstrap, verdict
from export.evaluation import evaluate_export
from export.exporter import ExportSettings, apply_knn_choice, export_run
from export.profiles import uniform_budgets
from fed_train.evaluation import summarize
from fed_train.knn_choice import load_or_choose
from fed_train.knn_request import KNN_MODES, KNNRequest
from fed_train.run import load_run
from fed_train.run_evaluation import evaluate_run


def _cached(path: Path, make) -> Any:
    if path.exists():
        return json.loads(path.read_text())
    value = make()
    C.write_json(path, value)
    return value


def setting_rows(run, setting: str, budget: int, out: Path, bundles: Path) -> list[dict]:
    request = KNNRequest(setting)

    def server() -> dict:
        start = time.perf_counter()
        result = evaluate_run(run, ["knnper"], knn=request, progress=False)
        return {
            "rows": result["clients"],
            "knn": result["knn"],
            "seconds": round(time.perf_counter() - start, 1),
        }

    def device() -> dict:
        start = time.perf_counter()
        choice = load_or_choose(
            run.run_dir, run.model, run.clients(), request, seed=run.config.seed
        )
        ids = list(range(len(run.partition.clients)))
        target = bundles / setting
        export_run(
            run,
            target,
            uniform_budgets(ids, budget),
            apply_knn_choice(ExportSettings(), choice),
            progress=False,
            workers=1,
        )
        return {
            "rows": evaluate_export(run, target),
            "seconds": round(time.perf_counter() - start, 1),
        }

    on_server = _cached(out / f"{setting}_server.json", server)
    on_device = _cached(out / f"{setting}_device.json", device)
    by_id = {r["client_id"]: r for r in on_device["rows"]}
    rows = []
    for r in on_server["rows"]:
        d = by_id[r["client_id"]]
        rows.append(
            {
                "setting": setting,
                "client_id": r["client_id"],
                "unseen": r["unseen"],
                "n_test": r["n_test"],
                "server_accuracy": r["knnper"],
                "device_accuracy": d["test_accuracy"],
                "server_lambda": r["knnper_lambda"],
                "device_lambda": d["lambda"],
                "device_recipe": d["recipe"],
            }
        )
    return rows


def summary(rows: list[dict], knn: dict[str, dict]) -> list[dict]:
    out = []
    for setting in KNN_MODES:
        mine = [r for r in rows if r["setting"] == setting]
        line: dict[str, Any] = {"setting": setting, **knn[setting]}
        for where in ("server", "device"):
            groups = summarize(
                [
                    {
                        "unseen": r["unseen"],
                        "n_test": r["n_test"],
                        "accuracy": r[f"{where}_accuracy"],
                    }
                    for r in mine
                ]
            )
            for group, s in groups.items():
                line[f"{where}_{group}_mean"] = None if s is None else 100 * s["mean"]
                line[f"{where}_{group}_bottom_decile"] = (
                    None if s is None else 100 * s["bottom_decile"]
                )
        line["clients_off_by_more_than_one_sample"] = sum(
            abs(
                round(r["server_accuracy"] * r["n_test"])
                - round(r["device_accuracy"] * r["n_test"])
            )
            > 1
            for r in mine
        )
        out.append(line)
    return out


def tuned_minus_paper(rows: list[dict]) -> list[dict]:
    """Tuned minus paper per group and place: the difference of means (pp) with a paired
    bootstrap 95% interval over clients (experiments.table_seeds); 'inconclusive' where it holds
    0."""
    out = []
    for where in ("server", "device"):
        by_client: dict[int, dict] = {}
        for r in rows:
            row = by_client.setdefault(
                r["client_id"], {"unseen": r["unseen"], "n_test": r["n_test"]}
            )
            row[r["setting"]] = r[f"{where}_accuracy"]
        for group in ("seen", "unseen"):
            iv = paired_bootstrap([list(by_client.values())], group, "tuned", "paper", "mean")
            if iv is None:
                continue
            out.append(
                {
                    "where": where,
                    "group": group,
                    "diff_pp": 100 * iv["diff"],
                    "low_pp": 100 * iv["low"],
                    "high_pp": 100 * iv["high"],
                    "verdict": verdict(iv, "tuned", "paper"),
                }
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a finished `knnper train` run directory")
    p.add_argument("--budget", type=byte_count, required=True, help="every device's budget")
    p.add_argument("--out", required=True, help="results folder (committed)")
    p.add_argument("--bundles", default=None, help="bundle folder (default RUN/knn_config_bundles)")
    args = p.parse_args()
    C.setup_logging()
    start_info = C.machine_info()
    run = load_run(args.run)
    out = Path(args.out)
    bundles = Path(args.bundles or Path(args.run) / "knn_config_bundles")
    rows, knn = [], {}
    for setting in KNN_MODES:
        rows += setting_rows(run, setting, args.budget, out, bundles)
        record = json.loads((out / f"{setting}_server.json").read_text())["knn"]
        knn[setting] = {k: record["config"][k] for k in ("k", "sigma", "normalize")}
        knn[setting]["estimator"] = record["estimator"]
    C.write_csv(out / "clients.csv", rows)
    lines = summary(rows, knn)
    differences = tuned_minus_paper(rows)
    C.write_json(out / "summary.json", {"settings": lines, "tuned_minus_paper": differences})
    table = C.markdown_table(
        lines,
        [
            ("setting", "setting", ""),
            ("k", "k", ""),
            ("sigma", "sigma", "g"),
            ("normalize", "norm", ""),
            ("estimator", "lambda by", ""),
            ("server_seen_mean", "server seen mean", ".2f"),
            ("server_seen_bottom_decile", "server seen bottom 10%", ".2f"),
            ("device_seen_mean", "device seen mean", ".2f"),
            ("device_seen_bottom_decile", "device seen bottom 10%", ".2f"),
            ("server_unseen_mean", "server unseen mean", ".2f"),
            ("device_unseen_mean", "device unseen mean", ".2f"),
            ("clients_off_by_more_than_one_sample", "clients off by >1 sample", ""),
        ],
    )
    head = C.report_head(
        "kNN-Per: paper setting vs chosen on validation, server and device",
        start_info,
        C.machine_info(),
        f"Run {args.run}; every device's budget {args.budget} bytes.",
    )
    gaps = C.markdown_table(
        differences,
        [
            ("where", "where", ""),
            ("group", "clients", ""),
            ("diff_pp", "tuned - paper (pp)", "+.2f"),
            ("low_pp", "95% low", "+.2f"),
            ("high_pp", "95% high", "+.2f"),
            ("verdict", "verdict", ""),
        ],
    )
    (out / "summary.md").write_text("\n".join([*head, "", table, "", gaps, ""]))
    print(table)
    print(gaps)


if __name__ == "__main__":
    main()
