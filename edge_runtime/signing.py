"""Optional Ed25519 signatures on bundles (the `cryptography` package, extra `knnper[sign]`).

The exporter signs the exact bytes of the manifest it wrote; since the manifest lists every
file's sha256, the signature covers the encoder, the datastore and every setting (lambda, k,
sigma, the input normalisation, the budget). The signed bytes travel in `signature.json` beside
the manifest, next to the signature itself.

On-device updates (`Runtime.add`) rewrite manifest.json without any private key on the device:
the signed base stays in signature.json, and a runtime that trusts the exporter's key accepts
the current manifest only when it equals the signed base in everything except what an update
may change: the datastore's (and a refitted linear head's, edge_runtime.head_file) file names
and sha256s, the datastore and total footprint (still
bounded by the signed budget) and the recipe's sample counts: n, and a ProtoNN buffer's capacity
b (the concatenate strategy grows them). The recipe string must be the one its parameters spell
(`bundle.validate_manifest`), so it cannot say what they do not. So the encoder and every setting
stay those the exporter signed; the stored samples after an update are the device's own, covered
by the sha256 list against corruption but not by the signature (a key on the device, beside the
bundle, would protect them no better against whoever can rewrite that storage).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._io import parse_json, read_within, write_bytes_atomic
from .cli_help import install_hint
from .errors import SignatureError
from .manifest import Manifest, parse_manifest

SIGNATURE_FILE = "signature.json"
ALGORITHM = "ed25519"
MAX_SIGNATURE_BYTES = 1 << 20


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise SignatureError(
            f"signed bundles need the cryptography package: {install_hint('sign')}"
        ) from None
    return ed25519, serialization, InvalidSignature


def generate_key_pair(private_path: str | os.PathLike, public_path: str | os.PathLike) -> str:
    """Write a new Ed25519 private key (PEM, PKCS8, mode 0600) and its public key (PEM).
    Refuses to overwrite either file (SignatureError).

    Parameters
    ----------
    private_path : where the private key goes (its folder is made with mode 0700).
    public_path : where the public key goes (devices' trusted keys).

    Returns
    -------
    str : the public key's fingerprint.
    """
    ed25519, serialization, _ = _crypto()
    key = ed25519.Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    for path in (private_path, public_path):
        if Path(path).exists():
            raise SignatureError(f"refusing to overwrite {path}")
    for path in (private_path, public_path):  # a keys/ folder of its own, readable by us only
        Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(os.fspath(private_path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem)
    try:
        write_bytes_atomic(public_path, public_pem)
    except BaseException:  # a private key without its public half is of no use: no orphan
        Path(private_path).unlink(missing_ok=True)
        raise
    return fingerprint(key.public_key())


def _read_key_file(path: str | os.PathLike) -> bytes:
    return read_within(
        path, 64 * 1024, lambda why: SignatureError(f"cannot read key {path}: it {why}")
    )


def load_private_key(path: str | os.PathLike):
    """An Ed25519 private key from an unencrypted PEM file."""
    ed25519, serialization, _ = _crypto()
    try:
        key = serialization.load_pem_private_key(_read_key_file(path), password=None)
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"{path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise SignatureError(f"{path} is not an Ed25519 private key")
    return key


def load_public_key(path: str | os.PathLike):
    """An Ed25519 public key from a PEM file."""
    ed25519, serialization, _ = _crypto()
    try:
        key = serialization.load_pem_public_key(_read_key_file(path))
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"{path} is not a PEM public key: {exc}") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise SignatureError(f"{path} is not an Ed25519 public key")
    return key


def fingerprint(public_key) -> str:
    """sha256 of the raw 32-byte public key, hex: names the key in signature.json."""
    _, serialization, _ = _crypto()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def signature_document(manifest_bytes: bytes, private_key) -> dict:
    """The content of signature.json for the manifest whose exact bytes are `manifest_bytes`."""
    return {
        "algorithm": ALGORITHM,
        "key": fingerprint(private_key.public_key()),
        "manifest": base64.b64encode(manifest_bytes).decode("ascii"),
        "signature": base64.b64encode(private_key.sign(manifest_bytes)).decode("ascii"),
    }


@dataclass(frozen=True)
class _Document:
    """A signature document as read: what was signed, the signature, and by which key."""

    signed: bytes
    signature: bytes
    algorithm: str
    key: str

    @classmethod
    def read(cls, path: Path, where: str) -> _Document:
        """The document at `path`, bounded; SignatureError (one line) when it is missing, not
        a regular file, or malformed."""
        if not os.path.lexists(path):
            raise SignatureError(
                f"{where}: unsigned ({path.name} is missing) and a trusted key is configured"
            )
        if path.is_symlink() or not path.is_file():
            raise SignatureError(
                f"{where}: {path.name} is a link or not a regular file (a pipe, a device); a "
                "signature is a plain file: copy it again from its exporter"
            )
        raw = read_within(
            path, MAX_SIGNATURE_BYTES, lambda why: SignatureError(f"{where}: {path.name} {why}")
        )
        try:
            doc = parse_json(raw)
            return cls(
                base64.b64decode(doc["manifest"], validate=True),
                base64.b64decode(doc["signature"], validate=True),
                doc["algorithm"],
                doc["key"],
            )
        except (ValueError, TypeError, KeyError, RecursionError, binascii.Error):
            raise SignatureError(f"{where}: {path.name} is malformed") from None

    def verified(self, trusted_keys: Sequence[Any], where: str) -> bytes:
        """The signed bytes, once the signature verifies under one of `trusted_keys`."""
        _, _, invalid_signature = _crypto()
        if self.algorithm != ALGORITHM:
            raise SignatureError(
                f"{where}: signature algorithm {self.algorithm!r} is not {ALGORITHM}"
            )
        keys = [k for k in trusted_keys if fingerprint(k) == self.key]
        if not keys:
            raise SignatureError(
                f"{where}: signed by key {str(self.key)[:16]}..., which is not trusted"
            )
        try:
            keys[0].verify(self.signature, self.signed)
        except invalid_signature:
            raise SignatureError(f"{where}: the signature does not verify") from None
        return self.signed


def verify_signature(
    bundle_dir: str | os.PathLike, manifest: Manifest, trusted_keys: Sequence[Any], where: str
) -> Manifest:
    """Check signature.json against the trusted public keys and the current manifest; returns
    the signed base manifest. SignatureError (one line) when the bundle is unsigned, signed by
    an untrusted key, the signature does not verify, or the manifest departs from the signed
    base in anything an on-device update cannot change."""
    doc = _Document.read(Path(bundle_dir) / SIGNATURE_FILE, where)
    base = parse_manifest(doc.verified(trusted_keys, where), f"{where}: signed manifest")
    _check_against_base(manifest, base, where)
    return base


def sign_file(path: str | os.PathLike, private_key) -> Path:
    """Sign a release file other than a manifest (a key map): PATH.sig.json signs its sha256."""
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest().encode("ascii")
    out = Path(f"{os.fspath(path)}.sig.json")
    write_bytes_atomic(out, json.dumps(signature_document(digest, private_key)).encode())
    return out


def verify_file(path: str | os.PathLike, data: bytes, trusted_keys: Sequence[Any]) -> None:
    """SignatureError unless PATH.sig.json, by a trusted key, signs the sha256 of `data` (the
    file's bytes as read)."""
    where = os.fspath(path)
    signed = _Document.read(Path(f"{where}.sig.json"), where).verified(trusted_keys, where)
    if signed != hashlib.sha256(data).hexdigest().encode("ascii"):
        raise SignatureError(f"{where}: the file is not the one that was signed")


def check_signed_base(bundle_dir: str | os.PathLike, manifest: Manifest, where: str) -> None:
    """Without checking the signature itself (no key at hand): SignatureError when the
    manifest departs from the base signature.json signed in anything an update cannot
    change, so a runtime that trusts the signer will accept it."""
    signed = _Document.read(Path(bundle_dir) / SIGNATURE_FILE, where).signed
    _check_against_base(manifest, parse_manifest(signed, f"{where}: signed manifest"), where)


def _check_against_base(manifest: Manifest, base: Manifest, where: str) -> None:
    what = manifest.departure_from(base)
    if what is not None:
        raise SignatureError(f"{where}: {what} differs from the signed manifest")
