"""Test accuracy of exported bundles, measured through the device runtime itself, and the
server-side reference it is compared with (the full float32 flat datastore)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime.datastores import FlatDatastore
from edge_runtime.encoder import Encoder
from edge_runtime.knn import DEFAULT_K, DEFAULT_SIGMA
from edge_runtime.personal_head import PersonalHead
from edge_runtime.release import RELEASE_FILE, ReleaseError, read_release
from edge_runtime.runtime import Runtime
from export.errors import ExportError
from export.exporter import client_embeddings
from fed_train.algorithms.base import ClientData
from fed_train.client_files import client_split
from fed_train.run import LoadedRun


def weighted_mean(rows: Sequence[dict[str, Any]], key: str = "test_accuracy") -> float:
    """Mean accuracy weighted by client test size (the evaluation's convention)."""
    total = sum(r["test_samples"] for r in rows)
    if total == 0:
        return float("nan")
    return float(sum(r[key] * r["test_samples"] for r in rows) / total)


def evaluate_export(run: LoadedRun, out_dir: str | Path) -> list[dict[str, Any]]:
    """Each exported bundle's test accuracy, predicted by edge_runtime's Runtime from raw
    inputs: the accuracy a device gets, beside the client's row of the release's report."""
    out_dir = Path(out_dir)
    try:
        release = read_release(out_dir)
    except ReleaseError as err:
        raise ExportError(f"{err}; export the run again") from None
    if release is None:
        raise ExportError(f"{out_dir} holds no {RELEASE_FILE}: export the run first")
    if not release.finished:
        raise ExportError(
            f"{out_dir / RELEASE_FILE} records a release whose export did not finish: "
            "export the run again (it resumes)"
        )
    rows = []
    for client, row in zip(release.clients, release.rows, strict=True):
        runtime = Runtime.load(release.bundle_dir(out_dir, client), intra_op_threads=1)
        x, y = client_split(run, client, "test")
        acc = float(np.mean(runtime.predict(x) == y)) if len(y) else float("nan")
        rows.append({**row, "test_accuracy": acc, "test_samples": int(len(y))})
    return rows


def reference_accuracy(
    encoder_path: str | Path,
    clients: Sequence[ClientData],
    *,
    num_classes: int,
    k: int = DEFAULT_K,
    sigma: float = DEFAULT_SIGMA,
) -> list[dict[str, Any]]:
    """kNN-Per per client with no budget: every train sample as float32 keys, lambda chosen on
    the validation split, accuracy on the test split; embeddings from `encoder_path`."""
    encoder = Encoder(encoder_path, intra_op_threads=1)
    rows = []
    for client in clients:
        data = client_embeddings(encoder, client, test=True)
        store = FlatDatastore(num_classes, k=k, sigma=sigma).fit(data.z_train, data.y_train)
        head = PersonalHead(num_classes, k=k, sigma=sigma).fit(data, datastore=store)
        acc = head.accuracy(data.z_test, data.p_test, data.y_test)
        rows.append(
            {
                "client_id": client.client_id,
                "unseen": client.unseen,
                "lambda": head.lambda_,
                "test_accuracy": float("nan") if acc is None else acc,
                "test_samples": int(len(data.y_test)),
            }
        )
    return rows
