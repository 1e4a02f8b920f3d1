"""Split one data set into a server-held public part and the part the clients share, as two npz
files, for the fair tables (BENCHMARKS.md): `knnper pretrain --public-data SERVER.npz` trains on
the first, `knnper bench table --data CLIENTS.npz --init DIR` partitions the second. Both are
stratified by label and seeded, and no training image is in both.

    python benchmarks/split_public.py --dataset cifar10 --data ../shared/data/cifar10/cifar10.npz \
        --client-train 15000 --client-test 5000 --out runs/fair/cifar10
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fed_train.data import load_dataset, stratified_subsample


def split(dataset: str, data: str | None, client_train: int, client_test: int | None,
          seed: int, out: Path) -> tuple[Path, Path]:
    ds = load_dataset(dataset, data, seed=seed)
    if not 0 < client_train < len(ds.y_train):
        raise SystemExit(f"--client-train must be in (0, {len(ds.y_train)}), got {client_train}")
    rng = np.random.default_rng([seed, 0x9B])
    clients = stratified_subsample(ds.y_train, client_train, rng)
    server = np.setdiff1d(np.arange(len(ds.y_train)), clients)
    test = (np.arange(len(ds.y_test)) if client_test is None
            else stratified_subsample(ds.y_test, client_test, rng))
    out.mkdir(parents=True, exist_ok=True)
    server_path, clients_path = out / "server.npz", out / "clients.npz"
    # the server part has no test split of its own: pretraining holds out part of its train
    np.savez(server_path, x_train=ds.x_train[server], y_train=ds.y_train[server],
             x_test=ds.x_test[:0], y_test=ds.y_test[:0])
    np.savez(clients_path, x_train=ds.x_train[clients], y_train=ds.y_train[clients],
             x_test=ds.x_test[test], y_test=ds.y_test[test])
    return server_path, clients_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True)
    p.add_argument("--data", default=None)
    p.add_argument("--client-train", type=int, required=True,
                   help="training images the clients share; the rest goes to the server")
    p.add_argument("--client-test", type=int, default=None,
                   help="test images dealt to the clients (default: the whole test split)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    for path in split(args.dataset, args.data, args.client_train, args.client_test, args.seed,
                      args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
