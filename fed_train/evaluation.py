"""Per-client accuracy of personalized models and the paper's summaries (mean weighted by test
size, bottom decile), for clients seen in training and for unseen ones."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from edge_runtime._io import to_json_types
from fed_train.algorithms.base import Algorithm, ClientData, Weights
from fed_train.journal import ClientRows
from fed_train.progress import Progress
from fed_train.simulation import PERSONALIZE_STREAM, client_seed


def _accuracy(personal: Any, x: Any, y: Any) -> float | None:
    n = int(y.shape[0])
    return float(np.mean(personal.predict_proba(x).argmax(1) == y.cpu().numpy())) if n else None


def client_accuracies(
    algorithm: Algorithm,
    weights: Weights,
    states: dict[int, dict[str, Any]],
    clients: list[ClientData],
    *,
    seed: int = 0,
    progress: bool = False,
    validation: bool = False,
    journal: ClientRows | None = None,
) -> list[dict[str, Any]]:
    """One row per client: its test accuracy under `algorithm`'s personalization and what was
    chosen for it; with `validation`, also its validation accuracy ("n_val", "val_accuracy")
    from the same personalization (personalizing can mean training). `journal`: each row is
    appended as its client finishes and rows already there are reused, so an interrupted call
    resumes at the first unfinished client (each client's seed is its own: same rows)."""
    done = journal.start(clients) if journal is not None else {}
    rows = []
    # a client's personalization (local training, its datastore) grows with its train split
    with Progress(
        len(clients),
        desc=f"{algorithm.name} eval",
        unit="client",
        enabled=progress,
        total_work=sum(max(1, c.num_train) for c in clients),
    ) as bar:
        for client in clients:
            row = done.get(client.client_id)
            if row is None:
                personal = algorithm.personalize(
                    weights,
                    client,
                    states.get(client.client_id, {}),
                    client_seed(seed, 0, client.client_id, PERSONALIZE_STREAM),
                )
                row = to_json_types(
                    {
                        "client_id": client.client_id,
                        "unseen": client.unseen,
                        "n_test": int(client.y_test.shape[0]),
                        "accuracy": _accuracy(personal, client.x_test, client.y_test),
                        "info": personal.info,
                    }
                )
                if validation:
                    row.update(
                        n_val=int(client.y_val.shape[0]),
                        val_accuracy=_accuracy(personal, client.x_val, client.y_val),
                    )
                if journal is not None:
                    journal.add(row)
            rows.append(row)
            bar.update(max(1, client.num_train), measured=client.client_id not in done)
    return rows


def bottom_decile(accuracies: list[float]) -> float:
    """The ceil(M/10)-th worst client's accuracy: what the worst-off tenth of clients get."""
    ordered = sorted(accuracies)
    return ordered[math.ceil(len(ordered) / 10) - 1]


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float] | None]:
    """Mean accuracy weighted by test size, and the bottom decile, for seen and unseen clients."""
    out: dict[str, dict[str, float] | None] = {}
    for group, unseen in (("seen", False), ("unseen", True)):
        scored = [r for r in rows if r["unseen"] == unseen and r["accuracy"] is not None]
        if not scored:
            out[group] = None
            continue
        accs = [r["accuracy"] for r in scored]
        out[group] = {
            "mean": float(np.average(accs, weights=[r["n_test"] for r in scored])),
            "bottom_decile": bottom_decile(accs),
            "clients": len(scored),
        }
    return out


def merge_results(per_method: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The evaluate JSON: summaries per method, then one row per client with every method."""
    summary = {m: summarize(rows) for m, rows in per_method.items()}
    clients: dict[int, dict[str, Any]] = {}
    for method, rows in per_method.items():
        for r in rows:
            row = clients.setdefault(
                r["client_id"],
                {"client_id": r["client_id"], "unseen": r["unseen"], "n_test": r["n_test"]},
            )
            row[method] = r["accuracy"]
            for key, value in r["info"].items():
                row[f"{method}_{key}"] = value
    return {
        "seen": {m: s["seen"] for m, s in summary.items() if s["seen"] is not None},
        "unseen": {m: s["unseen"] for m, s in summary.items() if s["unseen"] is not None},
        "clients": [clients[k] for k in sorted(clients)],
    }


def format_table(result: dict[str, Any]) -> str:
    """A markdown table: one row per method, mean / bottom decile for seen and unseen clients."""
    methods = list(dict.fromkeys([*result["seen"], *result["unseen"]]))
    lines = [
        "| method | seen mean | seen bottom 10% | unseen mean | unseen bottom 10% |",
        "|---|---|---|---|---|",
    ]

    def cell(group: str, method: str, key: str) -> str:
        s = result[group].get(method)
        return f"{100 * s[key]:.1f}" if s else "-"

    for m in methods:
        lines.append(
            f"| {m} | {cell('seen', m, 'mean')} | {cell('seen', m, 'bottom_decile')} | "
            f"{cell('unseen', m, 'mean')} | {cell('unseen', m, 'bottom_decile')} |"
        )
    return "\n".join(lines)
