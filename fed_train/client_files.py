"""One client's raw data from a run, written as the files the device commands read: labelled
.npz archives (x, y) for `knnper-edge init / add / evaluate` and a plain .npy of test inputs for
`knnper-edge predict`. Raw means as the device receives it (uint8 images, token ids), before the
normalisation the encoder applies itself."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from edge_runtime._io import write_atomic
from fed_train.errors import KnnperError
from fed_train.run import LoadedRun

SPLITS = ("train", "val", "test")


def client_split(run: LoadedRun, client_id: int, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of one split of one client; val is drawn from the data set's train part."""
    split_of = run.partition.clients[client_id]
    idx = np.asarray(getattr(split_of, split), dtype=np.int64)
    if split == "test":
        return run.dataset.x_test[idx], np.asarray(run.dataset.y_test[idx], dtype=np.int64)
    return run.dataset.x_train[idx], np.asarray(run.dataset.y_train[idx], dtype=np.int64)


def write_client_files(run: LoadedRun, client_id: int, out_dir: Path) -> list[Path]:
    """Write train.npz, val.npz, test.npz (x, y) and test_x.npy into out_dir; each file is
    written under a temporary name and renamed, so a reader never sees half of one."""
    count = len(run.partition.clients)
    if not 0 <= client_id < count:
        raise KnnperError(f"client {client_id} is not in the run (it has clients 0 to {count - 1})")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise KnnperError(f"--out {out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for split in SPLITS:
        x, y = client_split(run, client_id, split)
        written.append(
            _save_atomic(out_dir / f"{split}.npz", lambda f, x=x, y=y: np.savez(f, x=x, y=y))
        )
    x_test, _ = client_split(run, client_id, "test")
    written.append(_save_atomic(out_dir / "test_x.npy", lambda f: np.save(f, x_test)))
    return written


def _save_atomic(path: Path, save: Callable[[BinaryIO], None]) -> Path:
    write_atomic(path, save)
    return path
