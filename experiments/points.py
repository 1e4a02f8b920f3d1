"""Finished points of an experiment, one JSON line each: a rerun after an interruption skips
them, and a point is only ever reused under the exact key (run, grid values, k, sigma, seed) it
was computed with."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_runtime._io import json_default, parse_json, read_regular, to_json_types
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
        raise KnnperError(f"{path} cannot be read ({err}); delete it to compute its points "
                          "again") from None


def _key(key: dict[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, default=str)


class PointStore:
    """`on_point(computed)`: called as each point is ready (computed now, or read back)."""

    def __init__(self, path: Path,
                 on_point: Callable[[bool], None] = lambda computed: None) -> None:
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
                    log.warning("%s: skipping a torn line (the point will be recomputed)",
                                self.path)

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
        with open(self.path, "a") as f:
            f.write(("\n" if self._torn_end else "")
                    + json.dumps({"key": key, "record": record}, default=json_default) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._torn_end = False
        self._done[_key(key)] = to_json_types(record)
        self.on_point(True)
        return self._done[_key(key)]

