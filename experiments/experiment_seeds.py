"""`knnper experiment NAME --seeds N`: the seeds' measurements combined into one, so every
experiment's own summary (claims, plot) judges all seeds together (`knnper bench table
--seeds N` summarises its seeds in experiments.table_seeds).

Points: per point (its key columns), every numeric column's across-seed mean under its own name,
its standard deviation beside it (`COLUMN_std`) and the number of seeds that measured it;
"seconds" is summed (compute time). Client rows: every seed's, with a `seed` column; the margins
(experiments.margins) then take a client as (seed, client id) and resample within each seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from edge_runtime.values import is_real
from experiments.spec import Measured, Result

STD = "_std"
SEEDS = "seeds"  # points.csv: how many seeds measured the point


def _combine_column(values: list[Any]) -> dict[str, Any]:
    numbers = [float(v) for v in values if is_real(v)]
    if numbers and len(numbers) == len([v for v in values if v is not None]):
        return {
            "mean": float(np.mean(numbers)),
            "std": float(np.std(numbers, ddof=1)) if len(numbers) > 1 else None,
        }
    text = list(dict.fromkeys(str(v) for v in values if v is not None))
    return {"text": " / ".join(text) if text else None}  # labels that differ between seeds


def combine_points(
    per_seed: Sequence[list[dict[str, Any]]], keys: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per point (in first-seen order) with the across-seed mean and std of each
    numeric column; a point missing from some seed is averaged over the seeds that have it."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for points in per_seed:
        for p in points:
            groups.setdefault(tuple(str(p.get(k)) for k in keys), []).append(p)
    out = []
    for rows in groups.values():
        point: dict[str, Any] = {k: rows[0].get(k) for k in keys}
        for column in dict.fromkeys(c for r in rows for c in r if c not in keys):
            values = [r.get(column) for r in rows]
            if column == "seconds":
                point[column] = sum(float(v or 0) for v in values)
                continue
            combined = _combine_column(values)
            if "text" in combined:
                point[column] = combined["text"]
            else:
                point[column], point[column + STD] = combined["mean"], combined["std"]
        point[SEEDS] = len(rows)
        out.append(point)
    return out


def combine(measured: Sequence[Measured]) -> Measured:
    """Every seed's measurement as one: mean points, all client rows tagged with their seed."""
    seeds = tuple(s for m in measured for s in m.seeds)
    clients = [{"seed": s, **r} for m in measured for s in m.seeds for r in m.clients]
    seconds = [m.compute_seconds for m in measured]
    return Measured(
        combine_points([m.points for m in measured], measured[0].keys),
        clients,
        measured[0].keys,
        seeds,
        [f for m in measured for f in m.facts],
        None if None in seconds else float(sum(seconds)),
    )


def combined_result(result: Result, seeds: Sequence[int]) -> Result:
    """The summary of combined rows, its files given the std, seed-count and seed columns and
    a note on how the seeds were pooled."""
    columns = []
    for c in result.point_columns:
        columns += [c, c + STD] if any(c + STD in p for p in result.points) else [c]
    note = (
        f"{len(seeds)} seeds ({', '.join(map(str, seeds))}), each its own partition and "
        "global models; each seed's report is in seed_S/. Points: the across-seed mean "
        f"(points.csv also has each column's standard deviation, `COLUMN{STD}`, and the "
        "number of seeds). Claims: the percentages of points are across-seed means; effects "
        "and their 95% intervals pool the clients of every seed (weighted as in one seed), "
        "resampled within their own seed."
    )
    return replace(
        result,
        point_columns=(*columns, SEEDS),
        client_columns=("seed", *result.client_columns) if result.clients else (),
        notes=[note, *result.notes],
    )
