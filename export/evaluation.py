"""Test accuracy of exported bundles, measured through the device runtime itself, and the
server-side reference it is compared with (the full float32 flat datastore)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime._io import JSONFileError, read_json
from edge_runtime.datastores import FlatDatastore
from edge_runtime.encoder import Encoder
from edge_runtime.knn import DEFAULT_K, DEFAULT_SIGMA
from edge_runtime.personal_head import PersonalHead
from edge_runtime.runtime import Runtime
from export.errors import ExportError
from export.exporter import REPORT_FILE, client_embeddings
from fed_train.algorithms.base import ClientData
from fed_train.client_files import client_split
from fed_train.run import LoadedRun


def weighted_mean(rows: Sequence[dict[str, Any]], key: str = "test_accuracy") -> float:
    """Mean accuracy weighted by client test size (the evaluation's convention)."""
    total = sum(r["test_samples"] for r in rows)
    if total == 0:
        return float("nan")
    return float(sum(r[key] * r["test_samples"] for r in rows) / total)


MAX_REPORT_BYTES = 64 << 20  # export.json: a row per client


def evaluate_export(run: LoadedRun, out_dir: str | Path) -> list[dict[str, Any]]:
    """Each exported bundle's test accuracy, predicted by edge_runtime's Runtime from raw
    inputs: the accuracy a device gets."""
    out_dir = Path(out_dir)
    try:
        report = read_json(
            out_dir / REPORT_FILE, limit=MAX_REPORT_BYTES, fix="export the run again"
        )
        clients = report["clients"]
        if not isinstance(clients, list) or not all(
            isinstance(r, dict)
            and isinstance(r.get("bundle"), str)
            and isinstance(r.get("client_id"), int)
            for r in clients
        ):
            raise TypeError
    except FileNotFoundError:
        raise ExportError(f"{out_dir} holds no {REPORT_FILE}: export the run first") from None
    except JSONFileError as err:
        raise ExportError(str(err)) from None
    except (TypeError, KeyError):
        raise ExportError(
            f"{out_dir / REPORT_FILE} does not list clients with their bundle "
            "and client id; export the run again"
        ) from None
    rows = []
    for row in clients:
        runtime = Runtime.load(out_dir / row["bundle"], intra_op_threads=1)
        x, y = client_split(run, row["client_id"], "test")
        acc = float(np.mean(runtime.predict(x) == y)) if len(y) else float("nan")
        rows.append(
            {
                **{k: v for k, v in row.items() if k != "candidates"},
                "test_accuracy": acc,
                "test_samples": int(len(y)),
            }
        )
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
