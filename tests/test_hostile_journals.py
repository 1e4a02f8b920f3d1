"""Journals and caches are inputs too: a crafted, duplicated or foreign row is recomputed,
never trusted (a KeyError, a changed table), and an append never follows a link out of the
run or --out."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from experiments.points import GridPoint, PointStore
from fed_train.journal import ClientRows, Journal


def _client(cid: int, unseen: bool = False, n_test: int = 4, n_val: int = 2):
    return SimpleNamespace(
        client_id=cid, unseen=unseen, y_test=np.zeros(n_test), y_val=np.zeros(n_val)
    )


def _row(cid: int, unseen: bool = False, **changes):
    return {"client_id": cid, "unseen": unseen, "n_test": 4, "accuracy": 0.5, "info": {}, **changes}


def test_rows_that_are_not_this_runs_clients_are_computed_again(tmp_path, caplog):
    """A `client_id: true` row, a duplicate or a row without 'unseen' changed a table or
    raised KeyError: 'unseen'."""
    path = tmp_path / "rows.jsonl"
    rows = [
        _row(0),
        _row(True),
        _row(1),
        _row(1, accuracy=1.0),
        _row(2, unseen=True),
        _row(2, unseen=False),
        {"client_id": 3},
        _row(4, n_test=400),
        _row(5, accuracy=7.0),
        _row(99),
    ]
    path.write_text("\n".join(json.dumps(r) for r in [{"key": "k"}, *rows]) + "\n")
    clients = [_client(c, unseen=(c == 2)) for c in range(6)]
    with caplog.at_level("WARNING"):
        done = ClientRows(path, "k").start(clients)
    assert done == {0: _row(0), 2: _row(2, unseen=True)}
    assert "computed again" in caplog.text


def test_appends_never_follow_links(tmp_path):
    outside = tmp_path / "outside.jsonl"
    outside.write_text('{"key": "k"}\n')
    (tmp_path / "run").mkdir()
    link = tmp_path / "run" / "rows.jsonl"
    link.symlink_to(outside)
    with pytest.raises(OSError, match="appends never follow links"):
        Journal(link).add({"client_id": 0})
    store = PointStore(tmp_path / "run" / "points.jsonl")
    (tmp_path / "run" / "points.jsonl").symlink_to(outside)
    with pytest.raises(OSError, match="appends never follow links"):
        store.compute({"a": 1}, lambda: {"rows": []})
    from fed_train.simulation import log_round

    (tmp_path / "run" / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(OSError, match="appends never follow links"):
        log_round(tmp_path / "run", {"round": 1}, SimpleNamespace(rounds_done=1), False)
    from fed_train.deploy import Processes

    (tmp_path / "run" / "superlink.log").symlink_to(outside)
    with pytest.raises(OSError, match="appends never follow links"):
        Processes({}, tmp_path / "run").start("superlink", ["true"])
    assert outside.read_text() == '{"key": "k"}\n'


def test_a_stored_point_its_table_cannot_read_is_computed_again(tmp_path):
    """A crafted record without the summary's fields raised KeyError: 'all_mean'."""
    path = tmp_path / "points.jsonl"
    key = {"alpha": 0.1}
    path.write_text(json.dumps({"key": key, "record": {"seconds": 1.0, "rows": []}}) + "\n")
    computed = []

    def compute():
        computed.append(1)
        return {"all_mean": 0.5, "rows": [_row(0)]}

    points, clients = PointStore(path).collect(
        [GridPoint({"alpha": 0.1}, key, compute)], lambda r: {"all_mean": r["all_mean"]}
    )
    assert computed == [1] and points[0]["all_mean"] == 0.5 and len(clients) == 1
    again, _ = PointStore(path).collect(
        [GridPoint({"alpha": 0.1}, key, compute)], lambda r: {"all_mean": r["all_mean"]}
    )
    assert computed == [1] and again[0]["all_mean"] == 0.5  # the recomputed line wins


@pytest.mark.parametrize("content", [b"\x00\xff\xfe binary", b'{"settings": ' + b"7" * 5000 + b"}"])
def test_a_damaged_report_json_is_one_warning_and_remade(tmp_path, caplog, content):
    """OUT/capacity/report.json was read with json.loads, not the bounded reader: a binary or
    huge-integer one was a UnicodeDecodeError or 'Exceeds the limit' naming no file."""
    from experiments.report import SETTINGS_FILE, refuse_other_report

    (tmp_path / SETTINGS_FILE).write_bytes(content)
    with caplog.at_level("WARNING"):
        refuse_other_report(tmp_path, {"alpha": 0.1}, "knnper experiment capacity")
    assert str(tmp_path / SETTINGS_FILE) in caplog.text
