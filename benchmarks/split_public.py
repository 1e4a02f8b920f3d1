"""Split one data set into a server-held public part and the part the clients share, as two npz
files, for the fair tables (BENCHMARKS.md); the code is fed_train.public_split.

    python benchmarks/split_public.py --dataset cifar10 --data ../shared/data/cifar10/cifar10.npz \
        --client-train 15000 --client-test 5000 --out runs/fair/cifar10
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fed_train.errors import DataError
from fed_train.public_split import split_public


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True)
    p.add_argument("--data", default=None)
    p.add_argument(
        "--client-train",
        type=int,
        required=True,
        help="training images the clients share; the rest goes to the server",
    )
    p.add_argument(
        "--client-test",
        type=int,
        default=None,
        help="test images dealt to the clients (default: the whole test split)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    try:
        paths = split_public(
            args.dataset, args.data, args.client_train, args.client_test, args.seed, args.out
        )
    except DataError as err:
        raise SystemExit(f"split_public.py: {err}") from None
    for path in paths:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
