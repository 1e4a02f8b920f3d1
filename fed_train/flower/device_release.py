"""What a SuperNode does with a release the server pushed (fed_train.flower.release): build its
bundle from its own data and learn, or upgrade the bundle it has, with the device runtime alone
(no torch), as `knnper-edge init --like`, `add` and `upgrade` do on a device."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime.device_init import init_bundle
from edge_runtime.manifest import ENCODER_FILE, MANIFEST, new_device_lambda_rule, read_manifest
from edge_runtime.runtime import Runtime
from edge_runtime.versions import datastore_embedding
from fed_train.flower.release import version_text, write_release

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
) -> tuple[dict[str, Any], dict[str, str]]:
    """Bring the node's bundle at `bundle` to the release in `files` (a ConfigRecord of file
    bytes). No bundle yet: build one from the train split (the release's encoder, input, k,
    sigma, budget and lambda rule for a new device; its model version recorded) and `add` the
    validation split. A bundle of another model version: upgrade it in place (every stored
    sample kept; `force` maps keys where the release advises otherwise). Returns the reply's
    numbers and version texts; the test split only measures accuracy."""
    bundle.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".release-", dir=bundle.parent) as tmp:
        client_dir = write_release(files, Path(tmp))
        release = read_manifest(client_dir)
        if not (bundle / MANIFEST).is_file():
            return _build(
                Path(tmp) / ENCODER_FILE, release, bundle, splits, client_id, keep_inputs, seed
            )
        return _upgrade(client_dir, release, bundle, splits, client_id, force)


def _build(
    encoder: Path,
    like: dict,
    bundle: Path,
    splits: dict[str, Split],
    client_id: int,
    keep_inputs: bool,
    seed: int,
) -> tuple[dict[str, Any], dict[str, str]]:
    rule, _ = new_device_lambda_rule(like)
    x, y = splits["train"]
    init_bundle(
        encoder,
        x,
        y,
        int(like["budget_bytes"]),
        bundle,
        input_spec=like["input"],
        k=int(like["k"]),
        sigma=float(like["sigma"]),
        seed=seed,
        client_id=client_id,
        intra_op_threads=1,
        lambda_rule=rule,
        keep_inputs=keep_inputs,
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
) -> tuple[dict[str, Any], dict[str, str]]:
    runtime = Runtime.load(bundle, intra_op_threads=1)
    before = _version(runtime)
    metrics: dict[str, Any] = {"client-id": client_id, "built": 0, "upgraded": 0}
    texts = {"version-before": before, "version": before, "how": "already this version"}
    if datastore_embedding(runtime.datastore) != release.get("model", {}).get("embedding"):
        metrics |= _accuracy("test-accuracy-before", runtime, splits["test"])
        report = runtime.upgrade(client_dir, force=force)
        metrics |= {"upgraded": 1, "carried": report.carried, "evicted": report.evicted}
        texts |= {"version": _version(runtime), "how": report.how}
    metrics |= {
        "stored": len(runtime.datastore),
        "lambda": runtime.lam,
        "footprint-bytes": int(runtime.manifest["footprint"]["total"]),
        **_accuracy("test-accuracy", runtime, splits["test"]),
    }
    return metrics, texts


def _version(runtime: Runtime) -> str:
    return version_text(runtime.manifest, datastore_embedding(runtime.datastore))


def _accuracy(name: str, runtime: Runtime, split: Split) -> dict[str, float]:
    """The bundle's accuracy on the node's test split (nothing when it has none)."""
    x, y = split
    if len(y) == 0:
        return {}
    return {name: float(np.mean(runtime.predict(x) == y))}
