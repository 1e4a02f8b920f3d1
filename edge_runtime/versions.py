"""Which embedding space a bundle's keys live in, so that keys of one encoder are never searched
with queries of another (same dimension is not the same space: a retrained encoder leaves old
keys silently worse).

An encoder's embedding id is the value of its ONNX metadata entry `knnper.embedding` (the
exporter stamps the shared encoder with its own sha256, and each client's encoder with a linear
head of its own keeps it: their embeddings are the same), else the sha256 of the encoder's
bytes. A datastore records the id of the encoder that embedded its keys inside its own .npz
(array `embedding_id`, 32 bytes), so a datastore file moved into another bundle is caught by
the file itself, not by a manifest that could be rewritten with it.

Bundles written before this record existed carry no `embedding_id`: they load as before (their
keys are taken to be their own encoder's), and `upgrade` treats them likewise.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np

from .onnx_proto import ParsedModel

EMBEDDING_KEY = "knnper.embedding"
EMBEDDING_ARRAY = "embedding_id"
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")


def embedding_id(model: bytes, file_sha256: str | None = None) -> str:
    """The embedding id of an encoder's bytes (see the module docstring). `file_sha256`: the
    sha256 of the encoder's file as shipped, when `model` is those bytes with a refitted head
    put in (the same embeddings, other bytes)."""
    try:
        stamped = ParsedModel(model).metadata.get(EMBEDDING_KEY)
    except ValueError:
        stamped = None
    if isinstance(stamped, str) and _HEX_RE.match(stamped):
        return stamped
    return file_sha256 or hashlib.sha256(model).hexdigest()


def short(identity: str | None) -> str:
    """The first 12 hex digits, as messages and `info` show an id."""
    return "unrecorded" if identity is None else identity[:12]


def id_array(identity: str) -> np.ndarray:
    """An id as the uint8[32] array a datastore's .npz stores."""
    return np.frombuffer(bytes.fromhex(identity), dtype=np.uint8).copy()


def id_from_arrays(arrays: dict[str, np.ndarray], file: str) -> str | None:
    """The id a datastore's .npz records, None where it records none (an older bundle)."""
    if EMBEDDING_ARRAY not in arrays:
        return None
    value = arrays[EMBEDDING_ARRAY]
    if value.dtype != np.uint8 or value.shape != (32,):
        raise ValueError(
            f"{file}: {EMBEDDING_ARRAY} must be 32 uint8 bytes (a sha256), got "
            f"{value.dtype} {list(value.shape)}"
        )
    return bytes(value).hex()


def datastore_embedding(datastore: Any) -> str | None:
    return getattr(datastore, "embedding_id_", None)


def mismatch(where: str, datastore_id: str | None, encoder_id: str) -> str | None:
    """The one-line refusal when a datastore's keys come from another encoder, else None."""
    if datastore_id is None or datastore_id == encoder_id:
        return None
    return (
        f"{where}: the datastore's keys were embedded by encoder {short(datastore_id)}, "
        f"this bundle's encoder is {short(encoder_id)}: keys of one encoder cannot be searched "
        "with another's queries; carry them over with `knnper-edge upgrade BUNDLE --to "
        "NEW_BUNDLE` (from a bundle of the keys' own version), or build a fresh one with "
        "`knnper-edge init`"
    )
