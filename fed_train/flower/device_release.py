"""What a SuperNode does with a release the server pushed (fed_train.flower.release_push):
build its bundle from its own data and learn, or upgrade the bundle it has, with the device
runtime alone (no torch), as `knnper-edge init --like`, `add` and `upgrade` do on a device. A
node whose config names a `trusted-key` takes only releases signed by that key (`knnper export
--signing-key`), as `knnper-edge --trusted-key` does; a node without one takes any release."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime._io import read_within
from edge_runtime.bundle import read_bundle
from edge_runtime.device_choice import InitSettings
from edge_runtime.device_init import init_bundle
from edge_runtime.errors import BundleError, SignatureError
from edge_runtime.manifest import ENCODER_FILE, MANIFEST, read_manifest
from edge_runtime.runtime import Runtime
from edge_runtime.signing import load_public_key, verify_file
from edge_runtime.versions import ModelVersion, describe
from fed_train.flower.release_push import MAX_FILE_BYTES, write_pushed_files

Split = tuple[np.ndarray, np.ndarray]


def bring_to_release(
    files: Any,
    bundle: Path,
    splits: dict[str, Split],
    *,
    client_id: int,
    keep_inputs: bool,
    force: bool,
    seed: int,
    trusted_keys: Sequence[Any] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Bring the node's bundle at `bundle` to the release in `files` (a ConfigRecord of file
    bytes). No bundle yet: build one from the train split (the release's encoder, input, k,
    sigma, budget and lambda rule for a new device; its model version recorded) and `add` the
    validation split. A bundle of another model version: upgrade it in place (every stored
    sample kept; `force` maps keys where the release advises otherwise). With `trusted_keys`,
    a release that is unsigned, signed by another key or altered since it was signed is
    refused (SignatureError, one line) before the bundle is touched. Returns the reply's
    numbers and version texts; the test split only measures accuracy."""
    bundle.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".release-", dir=bundle.parent) as tmp:
        try:
            client_dir = write_pushed_files(files, Path(tmp))
            if trusted_keys is not None:
                _verify(Path(tmp), client_dir, trusted_keys)
            release = read_manifest(client_dir)
            if not (bundle / MANIFEST).is_file():
                return _build(
                    Path(tmp) / ENCODER_FILE, release, bundle, splits, client_id, keep_inputs, seed
                )
            return _upgrade(client_dir, release, bundle, splits, client_id, force, trusted_keys)
        except SignatureError as exc:  # name the release's files, not the node's scratch
            raise SignatureError(
                f"refused the release: {str(exc).replace(tmp, 'release')}"
            ) from None


def node_trusted_keys(node_config: dict[str, Any]) -> list[Any] | None:
    """The public key a node trusts (node config `trusted-key`: a PEM file's path), or None
    where it names none."""
    path = str(node_config.get("trusted-key", ""))
    if not path.strip():  # a path is taken as it is: a file name may end in a space
        return None
    return [load_public_key(Path(path).expanduser())]


def _verify(root: Path, client_dir: Path, trusted_keys: Sequence[Any]) -> None:
    """The client's bundle verifies against `trusted_keys` (signature, every file's sha256),
    and so does the release's shared encoder, which a new bundle is built on (its own
    signature: with the linear base the client's bundle carries another encoder); the key
    maps are verified by the upgrade that reads them."""
    try:
        read_bundle(client_dir, intra_op_threads=1, trusted_keys=trusted_keys)
    except BundleError as exc:  # a file the signed sha256 list does not match, too
        raise SignatureError(str(exc)) from None
    encoder = root / ENCODER_FILE
    data = read_within(encoder, MAX_FILE_BYTES, lambda why: SignatureError(f"{encoder} {why}"))
    verify_file(encoder, data, trusted_keys)


def _build(
    encoder: Path,
    like: dict,
    bundle: Path,
    splits: dict[str, Split],
    client_id: int,
    keep_inputs: bool,
    seed: int,
) -> tuple[dict[str, Any], dict[str, str]]:
    rule, _ = like.new_device_lambda_rule()
    x, y = splits["train"]
    init_bundle(
        encoder,
        x,
        y,
        int(like.budget.total),
        bundle,
        input_spec=like.input,
        settings=InitSettings(
            k=int(like.k),
            sigma=float(like.sigma),
            seed=seed,
            client_id=client_id,
            intra_op_threads=1,
            lambda_rule=rule,
            keep_inputs=keep_inputs,
        ),
        release=like,
    )
    runtime = Runtime.load(bundle, intra_op_threads=1)
    learned = runtime.add(*splits["val"])
    metrics = {
        "client-id": client_id,
        "built": 1,
        "upgraded": 0,
        "stored": learned.size,
        "added": learned.added,
        "evicted": learned.evicted,
        "lambda": runtime.lam,
        "footprint-bytes": learned.footprint_bytes,
        **_accuracy("test-accuracy", runtime, splits["test"]),
    }
    return metrics, {"version": _version(runtime)}


def _upgrade(
    client_dir: Path,
    release: dict,
    bundle: Path,
    splits: dict[str, Split],
    client_id: int,
    force: bool,
    trusted_keys: Sequence[Any] | None,
) -> tuple[dict[str, Any], dict[str, str]]:
    runtime = Runtime.load(bundle, intra_op_threads=1)
    before = _version(runtime)
    metrics: dict[str, Any] = {"client-id": client_id, "built": 0, "upgraded": 0}
    texts = {"version-before": before, "version": before, "how": "already this version"}
    keys = ModelVersion.of_keys(runtime.datastore)
    if keys is None or not keys.matches(release.model):
        metrics |= _accuracy("test-accuracy-before", runtime, splits["test"])
        report = runtime.upgrade(client_dir, force=force, trusted_keys=trusted_keys)
        metrics |= {"upgraded": 1, "carried": report.carried, "evicted": report.evicted}
        texts |= {"version": _version(runtime), "how": report.how}
    metrics |= {
        "stored": len(runtime.datastore),
        "lambda": runtime.lam,
        "footprint-bytes": int(runtime.manifest.footprint.total),
        **_accuracy("test-accuracy", runtime, splits["test"]),
    }
    return metrics, texts


def _version(runtime: Runtime) -> str:
    return describe(runtime.version)


def _accuracy(name: str, runtime: Runtime, split: Split) -> dict[str, float]:
    """The bundle's accuracy on the node's test split (nothing when it has none)."""
    x, y = split
    if len(y) == 0:
        return {}
    return {name: float(np.mean(runtime.predict(x) == y))}
