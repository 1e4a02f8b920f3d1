"""One data set split into a server-held public part and the part the clients share, as two npz
files, for the fair tables (BENCHMARKS.md): `knnper pretrain --public-data SERVER.npz` trains on
the first, `knnper bench table --data CLIENTS.npz --init DIR` partitions the second. Both are
stratified by label and seeded, and no training image is in both."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fed_train.data import load_dataset, stratified_subsample
from fed_train.errors import DataError


def split_public(
    dataset: str, data: str | None, client_train: int, client_test: int | None, seed: int, out: Path
) -> tuple[Path, Path]:
    """Write OUT/server.npz and OUT/clients.npz: `client_train` training images (and
    `client_test` test images, or the whole test split) for the clients, the other training
    images for the server. Returns their paths (server, clients)."""
    ds = load_dataset(dataset, data, seed=seed)
    if not 0 < client_train < len(ds.y_train):
        raise DataError(f"client_train must be in (0, {len(ds.y_train)}), got {client_train}")
    rng = np.random.default_rng([seed, 0x9B])
    clients = stratified_subsample(ds.y_train, client_train, rng)
    server = np.setdiff1d(np.arange(len(ds.y_train)), clients)
    test = (
        np.arange(len(ds.y_test))
        if client_test is None
        else stratified_subsample(ds.y_test, client_test, rng)
    )
    out.mkdir(parents=True, exist_ok=True)
    server_path, clients_path = out / "server.npz", out / "clients.npz"
    # the server part has no test split of its own: pretraining holds out part of its train
    np.savez(
        server_path,
        x_train=ds.x_train[server],
        y_train=ds.y_train[server],
        x_test=ds.x_test[:0],
        y_test=ds.y_test[:0],
    )
    np.savez(
        clients_path,
        x_train=ds.x_train[clients],
        y_train=ds.y_train[clients],
        x_test=ds.x_test[test],
        y_test=ds.y_test[test],
    )
    return server_path, clients_path
