"""Append-only journals of finished units (a client evaluated, a bundle written), so that a
command interrupted by Ctrl-C or a kill resumes at the first unit it had not finished. A header
line says what the journal belongs to; each finished unit is one JSON line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from edge_runtime._io import (
    json_default,
    parse_json,
    read_regular,
    to_json_types,
    write_bytes_atomic,
)

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
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


class ClientRows(Journal):
    """Per-client result rows of one evaluation (keyed by `client_id`), written as each client
    finishes: personalizing a client can mean training a model for it. `key`: what the rows
    depend on (settings, model), JSON-ready."""

    def __init__(self, path: Path, key: Any) -> None:
        super().__init__(path)
        self.key = key

    def start(self) -> dict[int, dict[str, Any]]:
        """The rows an earlier, interrupted call with this same key finished; a journal with
        another key (other settings, another model) is started afresh."""
        header = {"key": to_json_types(self.key)}  # as read
        found = self.rows(header)
        if found is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(self.path, (json.dumps(header) + "\n").encode("utf-8"))
            return {}
        return {r["client_id"]: r for r in found if isinstance(r.get("client_id"), int)}

    def remove(self) -> None:
        """Once the complete result is saved elsewhere."""
        self.path.unlink(missing_ok=True)
