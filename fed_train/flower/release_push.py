"""A release pushed to the SuperNodes' own bundles (`knnper deploy release`).

The server sends each node the files it needs from an export (`knnper export`): the release's
encoder (and its signature, where the export is signed), its client's bundle and the release's
key maps (upgrades/); the client's encoder only where it is another than the release's (the
linear base gives each client its own), else the node writes the release's there, and the
bundle's sha256 list (and its signature) checks that copy as it would a sent one. The node
keeps its bundle in its own directory (node config `bundle-dir`): the first time, it builds it
from its own train split and teaches it its validation split, as `knnper-edge init --like` and
`add` do; later, when the release is a new model version, it upgrades it in place as
`knnper-edge upgrade` does, keeping every sample it learned. The node's reply holds only the
scalar fields listed here (counts, accuracies, lambda, bytes) and short version ids; the
server refuses any other reply, so no sample can leave a node on it."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from edge_runtime._io import read_within, write_bytes_atomic
from edge_runtime.manifest import ENCODER_FILE, MANIFEST
from edge_runtime.release import bundle_name

RELEASE_ACTION = "release"  # the ClientApp's handler for message type "train.release"
UPGRADES = "upgrades"  # the release's key maps, as `knnper export --upgrade-from` writes them
CLIENT = "client"  # where a node writes its client's bundle of the release
ENCODER_SIGNATURE = f"{ENCODER_FILE}.sig.json"  # a signed export's signature of its encoder
CLIENT_ENCODER = f"{CLIENT}/{ENCODER_FILE}"  # the client's encoder, sent where not the release's
MAX_FILE_BYTES = 64 << 20  # one file of a release (an encoder, a datastore, a key map)
MAX_FILES = 64  # a bundle's few files and a release's maps (one per older version)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

# A node's reply: these numbers in MetricRecord "metrics", these short texts in ConfigRecord
# "versions"; nothing else.
REPLY_METRICS = (
    "client-id",
    "built",
    "upgraded",
    "stored",
    "added",
    "carried",
    "evicted",
    "lambda",
    "footprint-bytes",
    "test-accuracy",
    "test-accuracy-before",
)
REPLY_TEXTS = ("version", "version-before", "how")
MAX_TEXT = 200
# what each reply number may be: a count, a flag or a fraction; and what every reply holds
_FLAGS = ("built", "upgraded")
_FRACTIONS = ("lambda", "test-accuracy", "test-accuracy-before")
_REQUIRED = ("client-id", *_FLAGS, "stored")
_MAX_COUNT = 2**53  # exact in a float64


class PushError(ValueError):
    """A release that cannot be pushed, or a node's reply that the server refuses."""


def release_files(release: Path, client_id: int) -> ConfigRecord:
    """What the node of `client_id` needs from the release directory: its encoder, the
    client's bundle (client_NNNN) and the key maps, as file bytes under their relative names;
    the client's encoder is left out where its bytes are the release's encoder's (sent once)."""
    bundle = release / bundle_name(client_id)
    if not (bundle / MANIFEST).is_file():
        raise PushError(
            f"{release} holds no bundle for client {client_id} (export it with --clients all)"
        )
    files = {ENCODER_FILE: release / ENCODER_FILE}
    if (release / ENCODER_SIGNATURE).is_file():
        files[ENCODER_SIGNATURE] = release / ENCODER_SIGNATURE
    files |= {f"{CLIENT}/{p.name}": p for p in sorted(bundle.iterdir()) if p.is_file()}
    if (release / UPGRADES).is_dir():
        files |= {
            f"{UPGRADES}/{p.name}": p for p in sorted((release / UPGRADES).iterdir()) if p.is_file()
        }
    record = {name: _read(path) for name, path in files.items()}
    if record.get(CLIENT_ENCODER) == record[ENCODER_FILE]:
        del record[CLIENT_ENCODER]
    return ConfigRecord(record)


def _read(path: Path) -> bytes:
    return read_within(path, MAX_FILE_BYTES, lambda why: PushError(f"{path} {why}"))


def write_pushed_files(record: ConfigRecord, root: Path) -> Path:
    """Write the files the server sent under `root` (names checked: one folder of CLIENT or
    UPGRADES at most, plain names, no path tricks), the release's encoder as the client's where
    the server left that out; returns the client bundle's directory. The bundle's own checks
    (sha256s, schema, sizes, its signature) run when the device runtime reads it."""
    if len(record) > MAX_FILES:
        raise PushError(f"the server sent {len(record)} files, over {MAX_FILES}")
    for name, data in record.items():
        parts = name.split("/")
        folder_ok = len(parts) == 1 or (len(parts) == 2 and parts[0] in (CLIENT, UPGRADES))
        if not (folder_ok and _NAME.fullmatch(parts[-1]) and ".." not in parts[-1]):
            raise PushError(f"the server sent a file with a refused name {name!r:.80}")
        if not isinstance(data, bytes) or len(data) > MAX_FILE_BYTES:
            raise PushError(f"the server's file {name} is not bytes within {MAX_FILE_BYTES}")
        if len(parts) == 2:
            (root / parts[0]).mkdir(exist_ok=True)
        write_bytes_atomic(root / name, data, sync_dir=False)
    if not (root / CLIENT / MANIFEST).is_file() or not (root / ENCODER_FILE).is_file():
        raise PushError("the server sent no client bundle or no encoder")
    if CLIENT_ENCODER not in record:
        write_bytes_atomic(root / CLIENT_ENCODER, record[ENCODER_FILE], sync_dir=False)
    return root / CLIENT


def node_reply(msg: Message, metrics: dict[str, Any], texts: dict[str, str]) -> Message:
    """The node's reply: the listed numbers and texts only (PushError otherwise)."""
    extra = (set(metrics) - set(REPLY_METRICS)) | (set(texts) - set(REPLY_TEXTS))
    if extra:
        raise PushError(f"fields {sorted(extra)} are not part of a release reply")
    return Message(
        RecordDict(
            {
                "metrics": MetricRecord(metrics),
                "versions": ConfigRecord({k: str(v)[:MAX_TEXT] for k, v in texts.items()}),
            }
        ),
        reply_to=msg,
    )


def read_reply(reply: Message) -> dict[str, Any]:
    """A node's reply as one flat dict, refused unless it is what node_reply makes: exactly a
    MetricRecord "metrics" of listed scalars and a ConfigRecord "versions" of listed short
    texts (no array record, no list, no bytes: nothing a sample could hide in)."""
    content = reply.content
    if set(content.keys()) != {"metrics", "versions"} or content.array_records:
        raise PushError(f"a release reply holds records {sorted(content.keys())}")
    metrics = content.metric_records["metrics"]
    texts = content.config_records["versions"]
    row: dict[str, Any] = {}
    for key, value in metrics.items():
        if key not in REPLY_METRICS or not _metric_ok(key, value):
            raise PushError(f"a release reply's metric {key!r:.40} = {value!r:.40} is refused")
        row[key] = value
    missing = [key for key in _REQUIRED if key not in row]
    if missing:
        raise PushError(f"a release reply lacks {missing}")
    for key, value in texts.items():
        if key not in REPLY_TEXTS or not isinstance(value, str) or len(value) > MAX_TEXT:
            raise PushError(f"a release reply's text {key!r:.40} is refused")
        row[key] = value
    return row


def _metric_ok(key: str, value: Any) -> bool:
    """A fraction in [0, 1], a flag 0 or 1, else a count: a whole number in [0, 2**53]."""
    if not isinstance(value, int | float) or not math.isfinite(value):
        return False
    if key in _FRACTIONS:
        return 0.0 <= value <= 1.0
    if key in _FLAGS:
        return value in (0, 1)
    return value == int(value) and 0 <= value <= _MAX_COUNT
