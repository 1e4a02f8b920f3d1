"""A release's record (export.json): one type, parsed once and bounded, written back in the
same bytes; anything that is no release record refused in one line."""

from __future__ import annotations

import json

import pytest

from edge_runtime.release import (
    MAX_RELEASE_BYTES,
    Release,
    ReleaseError,
    read_release,
    write_release,
)
from edge_runtime.versions import ModelVersion

MODEL = {"run": "v2", "round": 3, "weights_sha256": "a" * 64, "embedding": "b" * 64}
OLDER = {**MODEL, "run": "v1", "embedding": "c" * 64}
V2, V2_AFTER_V1 = ModelVersion.from_record(MODEL), ModelVersion.from_record(MODEL, OLDER)


@pytest.mark.parametrize(
    "release",
    [
        Release("runs/v2", V2, (0, 3, 1)),
        Release("runs/v2", V2_AFTER_V1, (4,), continues="runs/v1"),
    ],
)
def test_a_record_is_written_back_in_the_same_bytes(release, tmp_path):
    write_release(tmp_path, release)
    raw = (tmp_path / "export.json").read_bytes()
    parsed = read_release(tmp_path)
    assert parsed == release and not parsed.finished
    assert parsed.model.replaces == release.model.replaces
    (tmp_path / "again").mkdir()
    write_release(tmp_path / "again", parsed)
    assert (tmp_path / "again" / "export.json").read_bytes() == raw


def test_the_finished_report_records_the_same_release(tmp_path):
    """The exporter's report (settings, encoder figures, each client's row) around the record."""
    report = {
        "run": "runs/v2",
        "settings": {"k": 10},
        "encoder": {"bytes": 1},
        "model": MODEL,
        "replaces": OLDER,
        "clients": [{"client_id": 2, "bundle": "client_0002"}, {"client_id": 0, "bundle": "x"}],
    }
    (tmp_path / "export.json").write_text(json.dumps(report))
    release = read_release(tmp_path)
    assert release == Release("runs/v2", V2_AFTER_V1, (2, 0), finished=True)
    assert release.model.replaces == ModelVersion.from_record(OLDER)
    assert read_release(tmp_path / "none") is None


def test_a_finished_release_carries_each_clients_row_and_bundle(tmp_path):
    """What `evaluate_export` reads of export.json, through the type: the rows of the report
    in the clients' order (without the candidates tried) and where each bundle is."""
    rows = [{"client_id": 7, "recipe": "r", "candidates": [1, 2]}, {"client_id": 0, "lambda": 1}]
    report = {"run": "runs/v2", "model": MODEL, "clients": rows}
    (tmp_path / "export.json").write_text(json.dumps(report))
    release = read_release(tmp_path)
    assert release.rows == ({"client_id": 7, "recipe": "r"}, {"client_id": 0, "lambda": 1})
    assert release.bundle_dir(tmp_path, 7) == tmp_path / "client_0007"
    with pytest.raises(ReleaseError, match="holds no bundle for client 3"):
        release.bundle_dir(tmp_path, 3)
    write_release(tmp_path, Release("runs/v2", V2, (7, 0)))
    assert read_release(tmp_path).rows == ()  # the record before the bundles: no rows yet


@pytest.mark.parametrize(
    "doc, why",
    [
        ([], "not a JSON object"),
        ({"model": MODEL, "clients": []}, "'run' must be a string"),
        ({"run": "r", "clients": []}, "'model' must be an object"),
        ({"run": "r", "model": {**MODEL, "round": -1}, "clients": []}, "'model' 'round'"),
        ({"run": "r", "model": MODEL, "replaces": {}, "clients": []}, "'replaces' must be"),
        ({"run": "r", "model": MODEL, "clients": {}}, "'clients' must be a list"),
        ({"run": "r", "model": MODEL, "clients": [1, 1]}, "each client once"),
        ({"run": "r", "model": MODEL, "clients": [-1]}, "each client once"),
        ({"run": "r", "model": MODEL, "clients": [{"bundle": "b"}]}, "each client once"),
        ({"run": "r", "model": MODEL, "clients": [], "continues": 3}, "'continues'"),
    ],
)
def test_what_is_no_release_record_is_refused_in_one_line(doc, why, tmp_path):
    (tmp_path / "export.json").write_text(json.dumps(doc))
    with pytest.raises(ReleaseError, match=why) as err:
        read_release(tmp_path)
    assert str(tmp_path / "export.json") in str(err.value) and "\n" not in str(err.value)


def test_a_record_is_read_bounded(tmp_path):
    with open(tmp_path / "export.json", "wb") as f:
        f.truncate(MAX_RELEASE_BYTES + 1)
    with pytest.raises(ReleaseError, match="export.json"):
        read_release(tmp_path)
    (tmp_path / "export.json").unlink()
    (tmp_path / "export.json").symlink_to(tmp_path)
    with pytest.raises(ReleaseError, match="export.json"):
        read_release(tmp_path)
