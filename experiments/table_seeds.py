"""`knnper bench table --seeds N`: one table over several seeds, what a reader needs before
calling a method "best" (`knnper experiment --seeds N` combines its seeds in
experiments.experiment_seeds).

Each seed draws its own partition and trains every method from its own initialisation (the same
`--init` weights, when given, for every seed). The summary gives each method's mean and bottom
decile as mean +- standard deviation across seeds, and a paired bootstrap 95% interval over
clients for kNN-Per minus the best baseline: clients are resampled within each seed (a client's
two accuracies stay together), and the statistic is the across-seed average of the per-seed
difference. A method is called ahead only where that interval excludes zero; otherwise the
verdict is "inconclusive".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime._io import csv_text, to_json_types, write_text_atomic
from experiments.margins import INCONCLUSIVE, call, interval, statistic

GROUPS = ("seen", "unseen")
STATS = ("mean", "bottom_decile")
BOOTSTRAP = 2000
# fewer paired clients than this in a seed and resampling them says nothing about the population
MIN_CLIENTS = 5
SEEDS_FILE = "seeds.json"
# Clients hurt: the share of clients a method leaves below a reference model. Every method is set
# against the global model (FedAvg); kNN-Per also against FedAvg+ (FedAvg fine-tuned on each
# client), the usual personalization it has to beat. A tie hurts no one.
HURT_REFERENCES = {"fedavg": "FedAvg", "fedavg+": "FedAvg+"}


def seed_dir(out: Path, seed: int) -> Path:
    return Path(out) / f"seed_{seed}"


def _paired_arrays(
    clients: Sequence[Mapping[str, Any]], group: str, a: str, b: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = [
        r
        for r in clients
        if bool(r["unseen"]) == (group == "unseen")
        and r.get(a) is not None
        and r.get(b) is not None
    ]
    return (
        np.array([float(r[a]) for r in rows]),
        np.array([float(r[b]) for r in rows]),
        np.array([float(r["n_test"]) for r in rows]),
    )


def paired_bootstrap(
    per_seed: Sequence[Sequence[Mapping[str, Any]]],
    group: str,
    a: str,
    b: str,
    stat: str,
    *,
    draws: int = BOOTSTRAP,
    seed: int = 0,
) -> dict[str, float] | None:
    """Method a minus method b: the point estimate (the average over seeds of the per-seed
    difference of `stat`) and its paired bootstrap 95% interval, resampling each seed's clients
    with replacement (margins.interval, every draw at once). None when a seed has fewer than
    MIN_CLIENTS clients with both accuracies."""
    paired = [_paired_arrays(clients, group, a, b) for clients in per_seed]
    if any(len(w) < MIN_CLIENTS for _, _, w in paired):
        return None

    def difference(idx: list[np.ndarray]) -> np.ndarray:
        return np.mean(
            [
                statistic(acc_a[i], w[i], stat) - statistic(acc_b[i], w[i], stat)
                for (acc_a, acc_b, w), i in zip(paired, idx, strict=True)
            ],
            axis=0,
        )

    iv = interval(difference, [len(w) for _, _, w in paired], draws=draws, seed=seed, batched=True)
    return {"diff": iv["effect"], "low": iv["low"], "high": iv["high"]}


def hurt_share(
    per_seed: Sequence[Sequence[Mapping[str, Any]]],
    group: str,
    method: str,
    reference: str,
    *,
    draws: int = BOOTSTRAP,
    seed: int = 0,
) -> dict[str, Any] | None:
    """The share of clients whose accuracy with `method` is below `reference`'s: the average over
    seeds of each seed's share, its standard deviation across seeds, and a bootstrap 95% interval
    (each seed's clients resampled within it, as paired_bootstrap does). None when a seed has
    fewer than MIN_CLIENTS clients with both accuracies.

    Parameters
    ----------
    per_seed : one list of client rows per seed (each row holds both methods' accuracies)
    group : "seen" or "unseen"
    method, reference : the method judged and the model it is set against
    draws, seed : the bootstrap's draws and random seed
    """
    paired = [_paired_arrays(clients, group, method, reference) for clients in per_seed]
    if any(len(w) < MIN_CLIENTS for _, _, w in paired):
        return None

    def share(idx: list[np.ndarray]) -> np.ndarray:
        return np.mean(
            [(acc[i] < ref[i]).mean(-1) for (acc, ref, _), i in zip(paired, idx, strict=True)],
            axis=0,
        )

    iv = interval(share, [len(w) for _, _, w in paired], draws=draws, seed=seed, batched=True)
    shares = [float((acc < ref).mean()) for acc, ref, _ in paired]
    return {
        "share": iv["effect"],
        "std": float(np.std(shares, ddof=1)) if len(shares) > 1 else 0.0,
        "low": iv["low"],
        "high": iv["high"],
        "values": shares,
    }


def clients_hurt(
    per_seed: Sequence[Sequence[Mapping[str, Any]]], methods: Sequence[str]
) -> dict[str, dict[str, dict[str, Any]]]:
    """{group: {method: {reference: hurt_share}}} for every method against FedAvg, and kNN-Per
    against FedAvg+ too (HURT_REFERENCES), where the table has them."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for group in GROUPS:
        out[group] = {}
        for reference in HURT_REFERENCES:
            if reference not in methods:
                continue
            for method in methods:
                if method == reference or (reference != "fedavg" and method != "knnper"):
                    continue
                share = hurt_share(per_seed, group, method, reference)
                if share is not None:
                    out[group].setdefault(method, {})[reference] = share
    return out


def _hurt_cell(h: Mapping[str, Any]) -> str:
    spread = f" ± {100 * h['std']:.1f}" if len(h["values"]) > 1 else ""
    return f"{100 * h['share']:.1f}{spread} [{100 * h['low']:.1f}, {100 * h['high']:.1f}]"


def format_hurt(
    hurt: Mapping[str, Mapping[str, Mapping[str, Any]]], group: str, titles: Mapping[str, str]
) -> list[str]:
    """The clients-hurt table of one group, in markdown lines (none when nothing was measured):
    share below each reference in %, mean over seeds ± std across seeds (several seeds only)
    [95% interval]."""
    rows = hurt.get(group, {})
    if not rows:
        return []
    references = [r for r in HURT_REFERENCES if any(r in by_ref for by_ref in rows.values())]
    lines = [
        "| method | " + " | ".join(f"below {HURT_REFERENCES[r]}, %" for r in references) + " |",
        "|---" * (len(references) + 1) + "|",
    ]
    for method, by_ref in rows.items():
        cells = ["-" if r not in by_ref else _hurt_cell(by_ref[r]) for r in references]
        lines.append(f"| {titles.get(method, method)} | " + " | ".join(cells) + " |")
    return lines + [""]


def across_seeds(
    results: Sequence[Mapping[str, Any]], methods: Sequence[str], oracle: bool = True
) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """{group: {method: {stat: {"mean", "std", "values"}}}} over the seeds' summaries; the
    kNN-Per test-oracle and cross-oracle rows (not methods) are kept as "knnper_oracle" and
    "knnper_cross_oracle" when asked."""
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for group in GROUPS:
        summaries = {m: [r[group].get(m) for r in results] for m in methods}
        for key in ("oracle", "cross_oracle") if oracle else ():
            if all((r.get("knn", {}).get(key) or {}).get(group) for r in results):
                summaries[f"knnper_{key}"] = [r["knn"][key][group] for r in results]
        out[group] = {}
        for method, per_seed in summaries.items():
            if any(s is None for s in per_seed):
                continue
            out[group][method] = {}
            for stat in STATS:
                values = [float(s[stat]) for s in per_seed]
                out[group][method][stat] = {
                    "mean": float(np.mean(values)),
                    "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
                    "values": values,
                }
    return out


def compare_to_each(
    results: Sequence[Mapping[str, Any]], spread: Mapping[str, Any], method: str = "knnper"
) -> dict[str, dict[str, dict[str, Any]]]:
    """kNN-Per minus every baseline, for each group and statistic, with its paired bootstrap
    interval and verdict: what a claim against one named baseline (kNN-Per versus FedAvg, say)
    needs, and what compare_to_best picks from."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    clients = [r["clients"] for r in results]
    for group in GROUPS:
        baselines = [
            m
            for m in spread.get(group, {})
            if m not in (method, "knnper_oracle", "knnper_cross_oracle")
        ]
        if method not in spread.get(group, {}) or not baselines:
            continue
        out[group] = {}
        for stat in STATS:
            out[group][stat] = {}
            for baseline in baselines:
                iv = paired_bootstrap(clients, group, method, baseline, stat)
                out[group][stat][baseline] = {
                    **(iv or {}),
                    "verdict": verdict(iv, method, baseline),
                }
    return out


def compare_to_best(
    spread: Mapping[str, Any], each: Mapping[str, Mapping[str, Mapping[str, Any]]]
) -> dict[str, dict[str, dict[str, Any]]]:
    """For each group and statistic: the baseline with the highest across-seed value and
    kNN-Per minus it, as compare_to_each measured it."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for group, stats in each.items():
        out[group] = {}
        for stat, by_baseline in stats.items():
            best = max(by_baseline, key=lambda m: spread[group][m][stat]["mean"])
            out[group][stat] = {"baseline": best, **by_baseline[best]}
    return out


def verdict(iv: Mapping[str, float] | None, method: str, baseline: str) -> str:
    """Who is ahead, only where the 95% interval of method minus baseline excludes zero."""
    if not iv:
        return f"not measured (fewer than {MIN_CLIENTS} clients in a seed)"
    return call(iv, words=(f"{method} ahead", f"{baseline} ahead", INCONCLUSIVE))


def lambda_ties(results: Sequence[Mapping[str, Any]]) -> list[dict[str, int]]:
    """Per seed: clients whose honest lambda differs from the test oracle's, split into those
    where the two lambdas give the same test accuracy (ties) and real differences."""
    counts = []
    for r in results:
        differs = [
            c
            for c in r["clients"]
            if c.get("knnper_oracle_lambda") is not None
            and c.get("knnper") is not None
            and c["knnper_lambda"] != c["knnper_oracle_lambda"]
        ]
        ties = sum(c["knnper"] == c["knnper_oracle_accuracy"] for c in differs)
        counts.append(
            {"differs": len(differs), "same_accuracy": ties, "lower_accuracy": len(differs) - ties}
        )
    return counts


def summarize_seeds(results: Sequence[Mapping[str, Any]], seeds: Sequence[int]) -> dict[str, Any]:
    methods = list(results[0]["methods"])
    spread = across_seeds(results, methods)
    each = compare_to_each(results, spread) if "knnper" in methods else {}
    return to_json_types(
        {
            "seeds": list(seeds),
            "methods": methods,
            "spread": spread,
            "versus_best": compare_to_best(spread, each),
            "versus_each": each,
            "hurt": clients_hurt([r["clients"] for r in results], methods),
            "lambda_ties": lambda_ties(results) if "knnper" in methods else [],
            "lr": [r["lr"] for r in results],
        }
    )


def _cell(s: Mapping[str, Any] | None, stat: str) -> str:
    if s is None:
        return "-"
    return f"{100 * s[stat]['mean']:.1f} ± {100 * s[stat]['std']:.1f}"


def format_seeds(
    summary: Mapping[str, Any], titles: Mapping[str, str], command: str | None = None
) -> str:
    seeds = summary["seeds"]
    lines = [
        f"# {len(seeds)} seed{'s' if len(seeds) > 1 else ''} "
        f"({', '.join(map(str, seeds))}): mean ± standard deviation across seeds, %",
        "",
        "Each seed draws its own partition and trains every method again; per-seed tables "
        "are in `seed_S/`. kNN-Per minus the best baseline: the average over seeds of the "
        f"per-seed difference, with a paired bootstrap 95% interval ({BOOTSTRAP} draws, "
        "clients resampled within each seed). A method is called ahead only where that "
        "interval excludes zero.",
        "",
    ]
    if command:
        lines += ["Command:", "", "```bash", command, "```", ""]
    for group, title in (("seen", "Clients seen in training"), ("unseen", "Unseen clients")):
        spread = summary["spread"].get(group, {})
        if not spread:
            continue
        lines += [f"## {title}", "", "| method | mean | bottom 10% |", "|---|---|---|"]
        for m in [*summary["methods"], "knnper_oracle", "knnper_cross_oracle"]:
            if m in spread:
                name = {
                    "knnper_oracle": "(kNN-Per, test-oracle lambda: not a method)",
                    "knnper_cross_oracle": "(kNN-Per, split-half cross-oracle lambda on "
                    "test: not a method)",
                }.get(m, titles.get(m, m))
                lines.append(
                    f"| {name} | {_cell(spread[m], 'mean')} | {_cell(spread[m], 'bottom_decile')} |"
                )
        lines.append("")
        for stat, label in (("mean", "mean"), ("bottom_decile", "bottom decile")):
            c = summary["versus_best"].get(group, {}).get(stat)
            if c and "diff" in c:
                lines.append(
                    f"- {label}: kNN-Per minus {titles.get(c['baseline'], c['baseline'])}"
                    f" = {100 * c['diff']:+.2f} pp, 95% interval "
                    f"[{100 * c['low']:+.2f}, {100 * c['high']:+.2f}]: "
                    f"**{c['verdict']}**."
                )
            each = summary.get("versus_each", {}).get(group, {}).get(stat, {})
            shown = [
                f"{titles.get(m, m)} {100 * c['diff']:+.2f} [{100 * c['low']:+.2f}, "
                f"{100 * c['high']:+.2f}] ({c['verdict']})"
                for m, c in each.items()
                if "diff" in c
            ]
            if shown:
                lines.append(
                    f"- {label}, kNN-Per minus each baseline (pp, 95% interval): "
                    + "; ".join(shown)
                    + "."
                )
        lines.append("")
        hurt = format_hurt(summary.get("hurt", {}), group, titles)
        if hurt:
            lines += [
                f"Clients hurt ({title.lower()}): the share of clients below FedAvg (the "
                "global model) or, for kNN-Per, below FedAvg+ (FedAvg fine-tuned), %: "
                "mean over seeds ± std across seeds [bootstrap 95% interval].",
                "",
                *hurt,
            ]
    if summary.get("lambda_ties"):
        per = "; ".join(
            f"seed {s}: {t['differs']} differ, {t['same_accuracy']} of them with "
            f"the same test accuracy"
            for s, t in zip(seeds, summary["lambda_ties"], strict=True)
        )
        lines += [
            f"Honest lambda versus the test oracle's: {per}. The oracle is chosen and "
            "scored on the same test samples, so its gain is optimistic.",
            "",
        ]
    return "\n".join(lines)


def write_seeds(
    summary: Mapping[str, Any], out: Path, titles: Mapping[str, str], command: str | None = None
) -> None:
    out = Path(out)
    write_text_atomic(out / SEEDS_FILE, json.dumps(summary, indent=2))
    write_text_atomic(out / "seeds.md", format_seeds(summary, titles, command))
    rows = []
    for group, methods in summary["spread"].items():
        for method, stats in methods.items():
            rows.append(
                {
                    "group": group,
                    "method": method,
                    **{f"{stat}_{k}": stats[stat][k] for stat in STATS for k in ("mean", "std")},
                    **{
                        f"{stat}_seed{s}": v
                        for stat in STATS
                        for s, v in zip(summary["seeds"], stats[stat]["values"], strict=True)
                    },
                }
            )
    write_text_atomic(out / "seeds.csv", csv_text(rows, list(rows[0])))
