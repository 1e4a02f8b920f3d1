"""The export journal: which clients of an export are finished, so that an interrupted export
resumes without redoing them. Written by whichever process finishes a client (the exporter's or
a worker), one line per client, so a client finished while the exporter is being interrupted is
still recorded."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime._io import parse_json, read_regular, write_bytes_atomic

# A row is a few hundred bytes per client; a larger journal is not one this exporter wrote.
MAX_JOURNAL_BYTES = 64 << 20


def _parse(line: str) -> Any:
    """One journal line as JSON (bounded nesting, no NaN); ValueError when it is not."""
    return parse_json(line.encode("utf-8"))


def json_default(value: Any) -> Any:
    """numpy scalars and paths, as JSON."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


class ExportJournal:
    """A header line with the export's fingerprint, then one JSON line per finished client,
    appended once its bundle is in place. Each line goes out in one write() to a file opened
    for appending, so lines from parallel workers do not interleave; a torn line (a kill in
    the middle of a write) is skipped."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def finished(self, fingerprint: dict[str, Any], budgets: dict[int, int],
                 keep: Callable[[int, dict[str, Any]], bool]) -> dict[int, dict[str, Any]]:
        """Rows of clients finished by an earlier call of this same export, for the same
        budget, that `keep(client_id, row)` accepts (it re-verifies the bundle); starts a new
        journal when there is none or it belongs to a different export."""
        rows: dict[int, dict[str, Any]] = {}
        lines = self._lines()
        try:
            same = bool(lines) and _parse(lines[0]) == {"fingerprint": fingerprint}
        except ValueError:
            same = False
        for line in lines[1:] if same else []:
            try:
                row = _parse(line)
            except ValueError:
                continue
            cid = row.get("client_id") if isinstance(row, dict) else None
            if (isinstance(cid, int) and not isinstance(cid, bool)
                    and budgets.get(cid) == row.get("budget") and keep(cid, row)):
                rows[cid] = row
        text = "".join(json.dumps(x, default=json_default) + "\n"
                       for x in [{"fingerprint": fingerprint}, *rows.values()])
        write_bytes_atomic(self.path, text.encode("utf-8"))
        return rows

    def _lines(self) -> list[str]:
        try:
            raw = read_regular(self.path, MAX_JOURNAL_BYTES)
            return [] if raw is None else raw.decode("utf-8").splitlines()
        except (OSError, UnicodeDecodeError):  # missing, unreadable, a pipe: start afresh
            return []

    def add(self, row: dict[str, Any]) -> None:
        line = (json.dumps(row, default=json_default) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
