"""The export journal: which clients of an export are finished, so that an interrupted export
resumes without redoing them. Written by whichever process finishes a client (the exporter's or
a worker), one line per client, so a client finished while the exporter is being interrupted is
still recorded."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from edge_runtime._io import json_default, write_bytes_atomic
from edge_runtime.budget import Budget
from edge_runtime.values import is_integer
from fed_train.journal import Journal


class ExportJournal(Journal):
    """A header line with the export's fingerprint, then one JSON line per finished client,
    appended once its bundle is in place."""

    def finished(
        self,
        fingerprint: dict[str, Any],
        budgets: dict[int, Budget],
        keep: Callable[[int, dict[str, Any]], bool],
    ) -> dict[int, dict[str, Any]]:
        """Rows of clients finished by an earlier call of this same export, for the same
        budget, that `keep(client_id, row)` accepts (it re-verifies the bundle); starts a new
        journal when there is none or it belongs to a different export."""
        rows: dict[int, dict[str, Any]] = {}
        for row in self.rows({"fingerprint": fingerprint}) or []:
            cid = row.get("client_id")
            if (
                is_integer(cid)
                and cid in budgets
                and budgets[cid].total == row.get("budget")
                and keep(cid, row)
            ):
                rows[cid] = row
        text = "".join(
            json.dumps(x, default=json_default) + "\n"
            for x in [{"fingerprint": fingerprint}, *rows.values()]
        )
        write_bytes_atomic(self.path, text.encode("utf-8"))
        return rows
