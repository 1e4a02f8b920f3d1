"""Whether a client an earlier run of the same export finished can be skipped: its journal row
must be well formed and its bundle must still be the one that row describes, made with this
command's settings (verified in full: manifest, files, signature). Anything else is rebuilt, so
a resumed export never reports a bundle it did not make."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edge_runtime.bundle import BundleError, read_bundle
from edge_runtime.datastores import BACKENDS
from edge_runtime.manifest import ENCODER_FILE
from edge_runtime.signing import SIGNATURE_FILE
from edge_runtime.values import is_integer, is_real


def row_problem(row: Any) -> str | None:
    """What is wrong with a journal row's fields, or None."""
    if not isinstance(row, dict):
        return "not a JSON object"
    for key in (
        "client_id",
        "budget",
        "stored",
        "encoder_bytes",
        "datastore_bytes",
        "total_bytes",
        "train_samples",
        "val_samples",
    ):
        if not (is_integer(row.get(key)) and row[key] >= 0):
            return f"{key!r} is not a non-negative integer"
    if row.get("backend") not in BACKENDS or not isinstance(row.get("recipe"), str):
        return "unknown backend or recipe"
    if not isinstance(row.get("bundle"), str) or not isinstance(row.get("unseen"), bool):
        return "'bundle' or 'unseen' is malformed"
    if not (is_real(row.get("lambda"), finite=True) and 0 <= row["lambda"] <= 1):
        return "'lambda' is not in [0, 1]"
    for key in ("val_accuracy", "val_nll"):
        if row.get(key) is not None and not is_real(row[key], finite=True):
            return f"{key!r} is not a number"
    if not isinstance(row.get("candidates"), list):
        return "'candidates' is not a list"
    return None


def bundle_problem(
    path: Path,
    row: dict[str, Any],
    expected: dict[str, Any],
    trusted_keys: Sequence[Any] | None,
    encoder_sha256: str,
) -> str | None:
    """What makes the bundle at `path` differ from the journal row and this export's settings
    (`expected`: manifest fields the command decides; `encoder_sha256`: this export's
    encoder, so a bundle of another model is rebuilt even when its row was rewritten to
    match), or None when it can be kept. `trusted_keys`: the signing key's public half when
    the export signs; then the bundle must verify against it, and without it the bundle must
    be unsigned."""
    if trusted_keys is None and (path / SIGNATURE_FILE).exists():
        return "it is signed and this export does not sign"
    try:
        manifest = read_bundle(path, intra_op_threads=1, trusted_keys=trusted_keys).manifest
    except BundleError as err:
        return str(err)
    if manifest.files[ENCODER_FILE] != encoder_sha256:
        return "its encoder is not this export's (another model or export)"
    got = {
        "client_id": manifest.client_id,
        "input": manifest.input.to_json(),
        "k": manifest.k,
        "sigma": manifest.sigma,
        "update_strategy": manifest.update_strategy,
    }
    if got != expected:
        return f"its settings {got} are not this export's {expected}"
    footprint = manifest.footprint
    described = {
        "client_id": row["client_id"],
        "budget_bytes": row["budget"],
        "lambda": row["lambda"],
        "recipe": row["recipe"],
        "backend": row["backend"],
        "encoder": row["encoder_bytes"],
        "datastore": row["datastore_bytes"],
        "total": row["total_bytes"],
    }
    actual = {
        "client_id": manifest.client_id,
        "budget_bytes": manifest.budget.total,
        "lambda": manifest.lam,
        "recipe": manifest.recipe,
        "backend": manifest.backend,
        **footprint._asdict(),
    }
    if described != actual:
        return "it is not the bundle its journal row describes"
    return None
