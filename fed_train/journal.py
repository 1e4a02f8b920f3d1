"""Append-only journals of finished units (a client evaluated, a bundle written), so that a
command interrupted by Ctrl-C or a kill resumes at the first unit it had not finished. A header
line says what the journal belongs to; each finished unit is one JSON line."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edge_runtime._io import (
    append_bytes,
    json_default,
    parse_json,
    read_regular,
    to_json_types,
    write_bytes_atomic,
)
from edge_runtime.values import is_integer, is_real

log = logging.getLogger(__name__)

# A row is a few hundred bytes per client; a larger journal is not one these commands wrote.
MAX_JOURNAL_BYTES = 64 << 20


def _parse(line: str) -> Any:
    """One journal line as JSON (bounded nesting, no NaN); ValueError when it is not."""
    return parse_json(line.encode("utf-8"))


class Journal:
    """Each line goes out in one write() to a file opened for appending, so lines from
    parallel processes do not interleave; a torn line (a kill in the middle of a write) is
    skipped when read back."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def _lines(self) -> list[str]:
        """A regular file's lines, read bounded; missing, unreadable or not a regular file (a
        pipe, a device): none, and the journal starts afresh."""
        try:
            raw = read_regular(self.path, MAX_JOURNAL_BYTES)
            return [] if raw is None else raw.decode("utf-8").splitlines()
        except (OSError, ValueError):
            return []

    def rows(self, header: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The rows after `header`, or None when the journal is missing or has another
        header (it belongs to another command or other settings)."""
        lines = self._lines()
        try:
            if not lines or _parse(lines[0]) != header:
                return None
        except ValueError:
            return None
        rows = []
        for line in lines[1:]:
            try:
                row = _parse(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def add(self, row: dict[str, Any]) -> None:
        line = (json.dumps(row, default=json_default) + "\n").encode()
        append_bytes(self.path, line)


def row_fits(row: dict[str, Any], clients: dict[int, Any]) -> bool:
    """Whether a journal row is one `fed_train.evaluation.client_accuracies` wrote for one of
    `clients`: its id (an integer, not a JSON true), its seen/unseen flag and its test (and
    validation) counts are that client's, its accuracies fractions (or None: no samples), its
    info an object."""
    cid = row.get("client_id")
    client = clients.get(cid) if is_integer(cid) else None
    if client is None or row.get("unseen") is not bool(client.unseen):
        return False
    counts = {"n_test": int(client.y_test.shape[0]), "n_val": int(client.y_val.shape[0])}
    for key, value in row.items():
        if key in counts and not (is_integer(value) and value == counts[key]):
            return False
        if (
            key in ("accuracy", "val_accuracy")
            and value is not None
            and not (is_real(value, finite=True) and 0 <= value <= 1)
        ):  # None: no samples to score
            return False
    return (
        "n_test" in row
        and "accuracy" in row
        and isinstance(row.get("info"), dict)
        and ("n_val" in row) == ("val_accuracy" in row)
    )


def rows_fit(rows: list[Any], clients: Sequence[Any]) -> bool:
    """Whether saved per-client rows are one `row_fits` row per client of `clients`, in
    their order (a table cache's: a duplicated, missing or crafted row changed a table)."""
    return len(rows) == len(clients) and all(
        isinstance(r, dict) and r.get("client_id") == c.client_id and row_fits(r, {c.client_id: c})
        for r, c in zip(rows, clients, strict=True)
    )


class ClientRows(Journal):
    """Per-client result rows of one evaluation (keyed by `client_id`), written as each client
    finishes: personalizing a client can mean training a model for it. `key`: what the rows
    depend on (settings, model), JSON-ready."""

    def __init__(self, path: Path, key: Any) -> None:
        super().__init__(path)
        self.key = key

    def start(self, clients: Sequence[Any]) -> dict[int, dict[str, Any]]:
        """The rows an earlier, interrupted call with this same key finished for `clients`
        (ClientData: each row must be a client's own, `row_fits`); a journal with another key
        (other settings, another model or data) is started afresh. A row that is not a
        client's (a crafted or damaged one), and every row of a client written twice, is left
        out with one warning: those clients are computed again."""
        header = {"key": to_json_types(self.key)}  # as read
        found = self.rows(header)
        if found is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(self.path, (json.dumps(header) + "\n").encode("utf-8"))
            return {}
        by_id = {c.client_id: c for c in clients}
        fitting = [r for r in found if row_fits(r, by_id)]
        counts = Counter(r["client_id"] for r in fitting)
        done = {r["client_id"]: r for r in fitting if counts[r["client_id"]] == 1}
        if len(done) < len(found):
            log.warning(
                "%s: %d row(s) are not this run's clients' (edited, duplicated or "
                "from other data); those clients are computed again",
                self.path,
                len(found) - len(done),
            )
        return done

    def remove(self) -> None:
        """Once the complete result is saved elsewhere."""
        self.path.unlink(missing_ok=True)
