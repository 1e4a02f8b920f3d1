"""Where an HNSW bundle's answer parts between x86 and emulated ARM: the encoder's embedding and
logits, the neighbours found (squared distances and positions) and the probabilities, dumped on
each side and compared array by array (bit for bit, then the largest difference).

    python -m tests.helpers.arm_trace dump CASES OUT.npz     # once on x86, once under qemu
    python -m tests.helpers.arm_trace compare X86.npz ARM.npz

CASES is the folder `python -m tests.helpers.arm_cases` wrote; the model is MobileNet-v2-gn's
HNSW bundle (the case that parted). Under qemu run it as .ci/arm runs the device tests (its
PYTHONPATH, userland and -cpu).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from edge_runtime.runtime import Runtime

MODEL = "cifar10-mobilenet-v2-gn"


def dump(cases: Path, out: Path) -> None:
    runtime = Runtime.load(cases / MODEL / "hnsw" / "client_0000", intra_op_threads=1)
    x = np.load(cases / MODEL / "inputs.npy", allow_pickle=False)
    z, logits = runtime.embed(x)
    sq, positions = runtime.datastore.kneighbors(z)
    np.savez(out, z=z, logits=logits, sq=sq, positions=positions, p=runtime.posterior(z, logits))


def compare(x86: Path, arm: Path) -> None:
    want, got = np.load(x86, allow_pickle=False), np.load(arm, allow_pickle=False)
    for name in want.files:
        a, b = want[name], got[name]
        rows = np.flatnonzero((a != b).reshape(len(a), -1).any(axis=1))
        largest = float(np.abs(a.astype(np.float64) - b).max())
        print(f"{name}: {len(rows)} of {len(a)} rows differ, largest difference {largest:.3g}")
        for row in rows[:3] if name == "positions" else ():
            print(f"  row {row}: x86 {a[row].tolist()} arm {b[row].tolist()}")
            print(f"    squared distances x86 {want['sq'][row].tolist()}")
            print(f"    squared distances arm {got['sq'][row].tolist()}")


if __name__ == "__main__":
    {"dump": dump, "compare": compare}[sys.argv[1]](Path(sys.argv[2]), Path(sys.argv[3]))
