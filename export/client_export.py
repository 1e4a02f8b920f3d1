"""One client's share of an export: size its datastore to its budget and write its bundle. The
same code runs in the exporter's process or in worker processes (one per core), which receive
plain data (the client's embeddings and budget) and send back the report row."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime.budget import Budget
from edge_runtime.bundle import BundleError, write_bundle
from edge_runtime.knn_provenance import KNNProvenance
from edge_runtime.manifest import BundleFields
from edge_runtime.personal_head import ClientSplits
from edge_runtime.preprocess import InputSpec
from edge_runtime.signing import load_private_key
from edge_runtime.versions import ModelVersion
from export.errors import ExportError
from export.journal import ExportJournal
from export.sizing import DatastoreSizer, SearchSpace
from fed_train.knn_setting import KNNChoice


@dataclass
class ClientTask:
    """What a worker needs for one client; embeddings are computed by the exporter's process."""

    data: ClientSplits
    budget: Budget  # its encoder's share: the shared encoder's, or this client's own
    unseen: bool
    target: Path
    input_spec: InputSpec
    encoder: bytes | None = None  # this client's own encoder (linear base); None: the shared one
    inputs: np.ndarray | None = None  # the train split's raw inputs, where the bundle keeps them


@dataclass
class SizingContext:
    """What stays the same for every client of an export."""

    encoder_path: Path
    num_classes: int
    knn: KNNChoice  # what every bundle runs; its provenance is recorded in every manifest
    space: SearchSpace
    seed: int
    update_strategy: str
    signing_key: str | None = None  # a path: workers load the key themselves
    journal: Path | None = None  # where each finished client is recorded (export.journal)
    model: ModelVersion | None = None  # what every manifest records, with its lineage

    def sizer(self) -> DatastoreSizer:
        return DatastoreSizer(self.num_classes, knn=self.knn, space=self.space, seed=self.seed)


def export_client(
    task: ClientTask, context: SizingContext, sizer: DatastoreSizer | None = None
) -> dict[str, Any]:
    """Size, write the bundle atomically, and return the client's row of export.json."""
    sizer = sizer or context.sizer()
    data = task.data
    encoder = context.encoder_path if task.encoder is None else task.encoder
    sizer.fit(data, task.budget, task.inputs)
    best, datastore = sizer.best_, sizer.datastore_
    provenance = context.knn.provenance()
    fields = BundleFields(
        int(data.client_id),
        task.input_spec,
        float(best.lam),
        task.budget.total,
        context.update_strategy,
        None if provenance is None else KNNProvenance(provenance),
        context.knn.lambda_rule,  # where it pools evidence, `init --like` chooses by it
        context.model,
    )
    try:
        key = load_private_key(context.signing_key) if context.signing_key else None
        manifest = write_bundle(task.target, fields, encoder, datastore, signing_key=key)
    except BundleError as err:
        raise ExportError(f"client {data.client_id}: {err}") from err
    row = {
        "client_id": int(data.client_id),
        "unseen": bool(task.unseen),
        "bundle": task.target.name,
        "budget": task.budget.total,
        "backend": best.backend,
        "recipe": best.recipe,
        "stored": best.stored,
        "encoder_bytes": manifest.footprint.encoder,
        "datastore_bytes": manifest.footprint.datastore,
        "total_bytes": manifest.footprint.total,
        "lambda": best.lam,
        "val_accuracy": best.val_accuracy,
        "val_nll": best.val_nll,
        "train_samples": int(len(data.y_train)),
        "val_samples": int(len(data.y_val)),
        "candidates": [c.as_row() for c in sizer.candidates_],
    }
    if context.journal is not None:
        ExportJournal(context.journal).add(row)
    return row


# -- worker processes: one sizer each, built once by the pool's initializer
_worker: dict[str, Any] = {}


def init_worker(context: SizingContext) -> None:
    """Pool initializer (fed_train.workers makes the worker deaf to Ctrl-C): one sizer per
    worker, built once."""
    import torch

    torch.set_num_threads(1)
    _worker["context"] = context
    _worker["sizer"] = context.sizer()


def export_client_in_worker(task: ClientTask) -> dict[str, Any]:
    return export_client(task, _worker["context"], _worker["sizer"])
