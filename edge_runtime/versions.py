"""A model version: which training (run, round, weights fingerprint) and which embedding space
(the encoder's embedding id) a bundle, a release or a datastore's keys belong to, so that keys
of one encoder are never searched with queries of another (same dimension is not the same
space: a retrained encoder leaves old keys silently worse), and a device is not moved back to
an older version unnoticed.

An encoder's embedding id is the value of its ONNX metadata entry `knnper.embedding` (the
exporter stamps the shared encoder with its own sha256, and each client's encoder with a linear
head of its own keeps it: their embeddings are the same), else the sha256 of the encoder's
bytes. This module is the one place an encoder is hashed (`ModelVersion.of_encoder`, `stamp`,
`encoder_sha256`); a test fails if another module does. A datastore records the id of the
encoder that embedded its keys inside its own .npz (array `embedding_id`, 32 bytes), so a
datastore file moved into another bundle is caught by the file itself, not by a manifest that
could be rewritten with it.

Bundles written before these records existed carry none: they load as before (their keys are
taken to be their own encoder's), and `upgrade` treats them likewise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .onnx_proto import ParsedModel
from .values import is_integer

EMBEDDING_KEY = "knnper.embedding"
EMBEDDING_ARRAY = "embedding_id"
# the keys of a manifest's model record, in the order the exporter writes them
RECORD_KEYS = ("run", "round", "weights_sha256", "embedding")
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
# the longest run name a record may carry (a hostile one must not choose its size freely)
MAX_RUN_NAME = 256


@dataclass(frozen=True)
class ModelVersion:
    """One model version. `embedding` (64 hex) names the encoder's embedding space; `run`,
    `round` and `weights_sha256` the training it came from, where known (an encoder alone, or
    a bundle from before versions, knows only its embedding). `replaces`: the version this one
    was released to replace (a manifest's "replaces" record), the lineage `compare` follows.
    """

    embedding: str
    run: str | None = None
    round: int | None = None
    weights_sha256: str | None = None
    replaces: ModelVersion | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, manifest: Any) -> ModelVersion | None:
        """The version a bundle was built from (edge_runtime.manifest.Manifest.model: its
        "model" record, with its "replaces" record as the lineage); None for a bundle from
        before versions."""
        return manifest.model

    @classmethod
    def parse(cls, record: Any, key: str = "model") -> ModelVersion:
        """The version a record (RECORD_KEYS: a manifest's or export.json's "model" or
        "replaces", as read, unchecked) names, without its lineage; ValueError, one line naming
        the record by `key`, for anything else."""
        if not isinstance(record, dict) or sorted(record) != sorted(RECORD_KEYS):
            raise ValueError(f"{key!r} must be an object with keys {sorted(RECORD_KEYS)}")
        run, round_ = record["run"], record["round"]
        if not isinstance(run, str) or len(run) > MAX_RUN_NAME:
            raise ValueError(f"{key!r} 'run' must be a string of at most {MAX_RUN_NAME} characters")
        if round_ is not None and (not is_integer(round_) or round_ < 0):
            raise ValueError(f"{key!r} 'round' must be a non-negative integer or null")
        for name in ("embedding", "weights_sha256"):
            value = record[name]
            if name == "weights_sha256" and value is None:
                continue
            if not isinstance(value, str) or not _HEX_RE.match(value):
                raise ValueError(f"{key!r} {name!r} must be a lowercase hex sha256")
        return cls(record["embedding"], run, round_, record["weights_sha256"])

    @classmethod
    def from_record(cls, record: Any, replaces: Any = None) -> ModelVersion | None:
        """A version from its record and the record of the one it replaces (each checked by
        `parse`), None for no record."""
        if record is None:
            return None
        lineage = None if replaces is None else cls.parse(replaces, "replaces")
        return dataclasses.replace(cls.parse(record), replaces=lineage)

    @classmethod
    def of_encoder(cls, model: bytes, file_sha256: str | None = None) -> ModelVersion:
        """The version an encoder's bytes are (its embedding only). `file_sha256`: the sha256
        of the encoder's file as shipped, when `model` is those bytes with a refitted head put
        in (the same embeddings, other bytes)."""
        try:
            stamped = ParsedModel(model).metadata.get(EMBEDDING_KEY)
        except ValueError:
            stamped = None
        if isinstance(stamped, str) and _HEX_RE.match(stamped):
            return cls(stamped)
        return cls(file_sha256 or encoder_sha256(model))

    @classmethod
    def of_keys(cls, datastore: Any) -> ModelVersion | None:
        """The version of the encoder a datastore's keys were embedded by; None where its
        files record none (a bundle from before versions)."""
        embedding = getattr(datastore, "embedding_id_", None)
        return None if embedding is None else cls(embedding)

    def to_record(self) -> dict[str, Any]:
        """The record a manifest and export.json hold (without the lineage)."""
        return {
            "run": self.run,
            "round": self.round,
            "weights_sha256": self.weights_sha256,
            "embedding": self.embedding,
        }

    @property
    def short(self) -> str:
        """The embedding id's first 12 hex digits: what messages show and release file names
        carry (upgrades/from-<short>.npz)."""
        return self.embedding[:12]

    def describe(self) -> str:
        """The version in words, the one text form: "run R round N (encoder <12 hex>)", or
        "encoder <12 hex>" where the training is not known."""
        if self.run is None:
            return f"encoder {self.short}"
        return f"run {self.run} round {self.round} (encoder {self.short})"

    def matches(self, other: ModelVersion | None) -> bool:
        """Whether `other` embeds into the same space (the same encoder's embedding id): its
        keys and this version's queries can be searched together."""
        return other is not None and other.embedding == self.embedding

    def compare(self, other: ModelVersion) -> int | None:
        """-1 if this version is older than `other`, 1 if newer, 0 if the same; None where no
        lineage links them. A lineage: the same run (ordered by round), or one version
        released as replacing the other."""
        if self == other:
            return 0
        if self.replaces == other:
            return 1
        if other.replaces == self:
            return -1
        if (
            self.run is not None
            and self.run == other.run
            and self.round is not None
            and other.round is not None
            and self.round != other.round
        ):
            return -1 if self.round < other.round else 1
        return None

    def older_than(self, other: ModelVersion) -> bool:
        """Whether a lineage shows this version to be older than `other` (moving a device from
        `other` to this one is a downgrade)."""
        return self.compare(other) == -1

    def keys_problem(
        self, where: str, keys: ModelVersion | None, said: str = "the datastore's keys were"
    ) -> str | None:
        """The one-line refusal when `keys` (the version a datastore's keys were embedded by,
        as `said`) is not this encoder's space, else None."""
        if keys is None or self.matches(keys):
            return None
        return (
            f"{where}: {said} embedded by encoder {keys.short}, "
            f"this bundle's encoder is {self.short}: keys of one encoder cannot be searched "
            "with another's queries; carry them over with `knnper-edge upgrade BUNDLE --to "
            "NEW_BUNDLE` (from a bundle of the keys' own version), or build a fresh one with "
            "`knnper-edge init`"
        )

    def encoder_problem(self, model: bytes, what: str) -> str | None:
        """The rule "this encoder is the release's", in one place: the one-line refusal when
        the encoder `model` (its bytes, named `what`) is not this release version's, else
        None."""
        given = ModelVersion.of_encoder(model)
        if self.matches(given):
            return None
        return f"{what} is {given.describe()}, not the release's {self.describe()}"

    def as_array(self) -> np.ndarray:
        """The embedding id as the uint8[32] array a datastore's (or key map's) .npz stores."""
        return np.frombuffer(bytes.fromhex(self.embedding), dtype=np.uint8).copy()

    @classmethod
    def from_array(cls, value: np.ndarray, what: str) -> ModelVersion:
        """The version an .npz's uint8[32] id array names; ValueError if it is not one."""
        if value.dtype != np.uint8 or value.shape != (32,):
            raise ValueError(
                f"{what} must be 32 uint8 bytes (a sha256), got {value.dtype} {list(value.shape)}"
            )
        return cls(bytes(value).hex())


def describe(version: ModelVersion | None) -> str:
    """`ModelVersion.describe`, and the words for a bundle that records no version."""
    return "unrecorded (a bundle from before versions)" if version is None else version.describe()


def id_from_arrays(arrays: dict[str, np.ndarray], file: str) -> str | None:
    """The embedding id a datastore's .npz records, None where it records none (an older
    bundle)."""
    if EMBEDDING_ARRAY not in arrays:
        return None
    return ModelVersion.from_array(arrays[EMBEDDING_ARRAY], f"{file}: {EMBEDDING_ARRAY}").embedding


def encoder_sha256(model: bytes) -> str:
    """The sha256 of an encoder file's bytes: what a manifest's `files` entry records for it,
    and its embedding id where the exporter stamped none."""
    return hashlib.sha256(model).hexdigest()


def stamp(proto: Any) -> None:
    """Stamp an ONNX ModelProto with its own embedding id (the sha256 of its bytes as they
    are), so that a client's encoder made from it with a linear head of its own keeps it."""
    proto.metadata_props.add(key=EMBEDDING_KEY, value=encoder_sha256(proto.SerializeToString()))
