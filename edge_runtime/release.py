"""A release: one export folder with one identity. Its `export.json` is the release's record,
written before any bundle (the run, the model version every bundle of it is built from, the one
it replaces, its clients) and completed into the export's report once every bundle is in place.
So a folder always says which release it holds: an export of another version into it is
refused, a resumed export continues only the same release, and a bundle loaded from it whose
manifest names another version says so.

The record is parsed once here, bounded, into a `Release`; the report's other members (settings,
the encoder's figures, each client's row) are the exporter's and are not read here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._io import parse_json, read_data_bytes, write_json_atomic
from .values import is_integer
from .versions import ModelVersion

log = logging.getLogger(__name__)

RELEASE_FILE = "export.json"
# a finished report holds a row per client with every candidate tried: a few MB for thousands
MAX_RELEASE_BYTES = 64 << 20
MAX_RUN_PATH = 4096


class ReleaseError(ValueError):
    """An export.json that is no release record; the message is one line."""


@dataclass(frozen=True)
class Release:
    """The identity of one export folder.

    Parameters
    ----------
    run : the run directory the release was exported from, as the export was given it.
    model : the model version every bundle of the release is built from (the manifests'
        "model"), with the version it replaces (their "replaces") as its lineage.
    clients : the client ids the release holds, in the export's order.
    continues : the run the release's run continued from, if any.
    finished : whether export.json is the finished report (each client's row), not only the
        record written before the bundles.
    rows : the finished report's row per client, in `clients`' order, as the exporter wrote it
        (its columns are the exporter's: export.client_export) without the candidates it
        tried; () before the export finished.
    """

    run: str
    model: ModelVersion
    clients: tuple[int, ...]
    continues: str | None = None
    finished: bool = False
    rows: tuple[dict[str, Any], ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def parse(cls, raw: bytes, where: str) -> Release:
        """The release an export.json's bytes record (its record or its finished report);
        ReleaseError, one line naming `where`, for anything else."""

        def fail(why: str) -> ReleaseError:
            return ReleaseError(f"{where}: {why}")

        try:
            doc = parse_json(raw)
        except ValueError as exc:
            raise fail(str(exc)) from None
        if not isinstance(doc, dict):
            raise fail("not a JSON object")
        run, continues = doc.get("run"), doc.get("continues")
        if not isinstance(run, str) or len(run) > MAX_RUN_PATH:
            raise fail(f"'run' must be a string of at most {MAX_RUN_PATH} characters")
        if continues is not None and (
            not isinstance(continues, str) or len(continues) > MAX_RUN_PATH
        ):
            raise fail(f"'continues' must be a string of at most {MAX_RUN_PATH} characters")
        try:
            model = ModelVersion.parse(doc.get("model"), "model")
            if "replaces" in doc:
                model = dataclasses.replace(
                    model, replaces=ModelVersion.parse(doc["replaces"], "replaces")
                )
        except ValueError as exc:
            raise fail(str(exc)) from None
        entries = doc.get("clients")
        if not isinstance(entries, list):
            raise fail("'clients' must be a list")
        finished = all(isinstance(e, dict) for e in entries)
        ids = [e.get("client_id") if isinstance(e, dict) else e for e in entries]
        if not all(is_integer(c) and c >= 0 for c in ids) or len(set(ids)) != len(ids):
            raise fail("'clients' must name each client once, by a non-negative integer id")
        rows = tuple(_without_candidates(e) for e in entries) if finished else ()
        return cls(run, model, tuple(ids), continues, finished, rows)

    def record(self) -> dict[str, Any]:
        """The record written before any bundle, in the order `parse` reads it back."""
        out: dict[str, Any] = {"run": self.run, "model": self.model.to_record()}
        if self.model.replaces is not None:
            out["replaces"] = self.model.replaces.to_record()
        if self.continues is not None:
            out["continues"] = self.continues
        out["clients"] = list(self.clients)
        return out

    def bundle_dir(self, folder: str | os.PathLike, client_id: int) -> Path:
        """Where in the release's `folder` client `client_id`'s bundle is; ReleaseError where
        the release holds no such client."""
        if client_id not in self.clients:
            raise ReleaseError(f"{folder} holds no bundle for client {client_id}")
        return Path(folder) / bundle_name(client_id)

    def same_version(self, other: Release) -> bool:
        """Whether both are releases of one model version (same run, round, weights and
        encoder): bundles of the two may share a folder."""
        return self.model == other.model


def bundle_name(client_id: int) -> str:
    """The name of client `client_id`'s bundle folder in a release (client_0003)."""
    return f"client_{client_id:04d}"


def _without_candidates(row: dict[str, Any]) -> dict[str, Any]:
    """A finished report's client row without the candidates tried (a long list per client
    that nothing after the export reads)."""
    return {key: value for key, value in row.items() if key != "candidates"}


def read_release(folder: str | os.PathLike) -> Release | None:
    """The release `folder`'s export.json records, None where it has none; ReleaseError where
    the file is not a release record (damaged, too large, or no export's)."""
    path = Path(folder) / RELEASE_FILE
    try:
        raw = read_data_bytes(path, MAX_RELEASE_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ReleaseError(f"{path}: {exc}") from None
    return Release.parse(raw, str(path))


def write_release(folder: str | os.PathLike, release: Release) -> None:
    """Write `release`'s record as `folder`'s export.json, atomically."""
    write_json_atomic(Path(folder) / RELEASE_FILE, release.record())


def bundle_release_problem(bundle_dir: str | os.PathLike, manifest: dict) -> str | None:
    """Why the bundle at `bundle_dir` does not belong to the release its folder records (the
    export.json beside it), or None: it is that release's version, or a device's upgrade from
    it (a newer version along its lineage), or there is no readable record to compare with,
    or the bundle records no version."""
    version = ModelVersion.of(manifest)
    path = Path(bundle_dir).absolute().parent / RELEASE_FILE
    try:
        info = path.stat()
    except OSError:
        return None
    release = _cached_release(str(path), (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size))
    if release is None or version is None or release.model.compare(version) in (0, -1):
        return None
    return (
        f"bundle {bundle_dir} is {version.describe()}, and its folder's release record "
        f"{path} names {release.model.describe()}: the folder mixes two releases (export "
        "again with --force to replace the older one whole)"
    )


@functools.lru_cache(maxsize=4)
def _cached_release(path: str, _stat: tuple[int, ...]) -> Release | None:
    """A folder's release record, read once per version of the file (every bundle of a
    folder loaded in turn reads it once); None where it cannot be read."""
    try:
        return read_release(Path(path).parent)
    except ReleaseError as err:
        log.debug("%s", err)
        return None
