"""Finished points of an experiment, one JSON line each: a rerun after an interruption skips
them, and a point is only ever reused under the exact key (run, grid values, k, sigma, seed) it
was computed with."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_runtime._io import append_bytes, json_default, parse_json, read_regular, to_json_types
from edge_runtime.values import is_real
from fed_train.errors import KnnperError

log = logging.getLogger(__name__)


MAX_POINTS_BYTES = 256 << 20  # a few hundred bytes per computed point


def _read_points(path: Path) -> str:
    """The store's text: a regular file of at most MAX_POINTS_BYTES, UTF-8."""
    try:
        raw = read_regular(path, MAX_POINTS_BYTES)
        if raw is None:
            raise ValueError(f"over {MAX_POINTS_BYTES} bytes")
        return raw.decode("utf-8")
    except (OSError, ValueError) as err:  # a pipe or device, too large, not UTF-8
        raise KnnperError(
            f"{path} cannot be read ({err}); delete it to compute its points again"
        ) from None


def _key(key: dict[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, default=str)


@dataclass(frozen=True)
class GridPoint:
    """One point of a sweep: its grid values as its rows show them, the key the store files it
    under, and how to compute its record (a dict with per-client "rows")."""

    label: dict[str, Any]
    key: dict[str, Any]
    compute: Callable[[], dict[str, Any]]


def client_fields(row: dict[str, Any], *info: str) -> dict[str, Any]:
    """A per-client row of a record flattened for clients.csv: who, how many test samples, the
    accuracy, and the named fields of its info (None where one is absent)."""
    return {
        "client_id": row["client_id"],
        "unseen": row["unseen"],
        "n_test": row["n_test"],
        "accuracy": row["accuracy"],
        **{k: row["info"].get(k) for k in info},
    }


class PointStore:
    """`on_point(computed)`: called as each point is ready (computed now, or read back)."""

    def __init__(
        self, path: Path, on_point: Callable[[bool], None] = lambda computed: None
    ) -> None:
        self.path = Path(path)
        self.on_point = on_point
        self._done: dict[str, dict[str, Any]] = {}
        self._torn_end = False  # a kill mid-append leaves a last line without its newline
        if self.path.exists():
            text = _read_points(self.path)
            self._torn_end = bool(text) and not text.endswith("\n")
            for line in text.splitlines():
                try:
                    entry = parse_json(line.encode("utf-8"))
                    self._done[_key(entry["key"])] = entry["record"]
                except (ValueError, KeyError, TypeError):
                    log.warning(
                        "%s: skipping a torn line (the point will be recomputed)", self.path
                    )

    def __len__(self) -> int:
        return len(self._done)

    def compute(self, key: dict[str, Any], fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The record stored under `key`, or fn()'s, timed and appended (fsync'd) first."""
        found = self._done.get(_key(key))
        if found is not None:
            self.on_point(False)
            return found
        started = time.perf_counter()
        record = fn()
        record["seconds"] = round(time.perf_counter() - started, 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        append_bytes(
            self.path,
            (
                ("\n" if self._torn_end else "")
                + json.dumps({"key": key, "record": record}, default=json_default)
                + "\n"
            ).encode("utf-8"),
            sync=True,
        )
        self._torn_end = False
        self._done[_key(key)] = to_json_types(record)
        self.on_point(True)
        return self._done[_key(key)]

    def collect(
        self,
        grid: Iterable[GridPoint],
        summary: Callable[[dict[str, Any]], dict],
        client: Callable[[dict[str, Any]], dict] = dict,
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Every point of `grid` (computed or read back): its summary row (`summary(record)`
        beside its label and compute time) and its clients' rows (`client(row)` beside its
        label), as an experiment's `measure` returns them."""
        points, clients = [], []
        for point in grid:
            try:
                row, rows = self._rows(point, summary, client)
            except (KeyError, TypeError, ValueError, AttributeError):
                # a stored record these functions cannot read (edited, crafted): recomputed
                # once; a fresh record that fails is the experiment's own bug and raises
                log.warning(
                    "%s: a stored point lacks what its table needs; computing it again", self.path
                )
                self._done.pop(_key(point.key), None)
                row, rows = self._rows(point, summary, client)
            points.append(row)
            clients += rows
        return points, clients

    def _rows(
        self,
        point: GridPoint,
        summary: Callable[[dict[str, Any]], dict],
        client: Callable[[dict[str, Any]], dict],
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        record = self.compute(point.key, point.compute)
        if (
            not isinstance(record, dict)
            or not is_real(record.get("seconds"), finite=True)
            or not isinstance(record.get("rows"), list)
        ):
            raise ValueError("not a point record")
        return (
            {**point.label, **summary(record), "seconds": record["seconds"]},
            [{**point.label, **client(r)} for r in record["rows"]],
        )
