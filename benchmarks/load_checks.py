"""What the hostile-bundle checks cost when a bundle loads.

    python benchmarks/load_checks.py --out benchmarks/results/runtime [--sizes 1000 10000 50000]

For datastores of N stored samples (random float32 embeddings of dimension --dim; the checks'
cost depends on sizes, not on values):
- hnsw.bin: the structure check (`check_hnsw_index`, from the file's bytes) against hnswlib's own
  `load_index` of the same file, each the median of --reps runs;
- datastore.npz (flat fp32 keys, labels, order): the member check (`check_npz_members`) against
  reading every array with np.load;
- the bundle lock: taking and releasing the shared lock that every load takes.
Outputs in OUT: load_checks.csv, load_checks.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from edge_runtime._io import check_npz_members, load_npz, save_npz_atomic
from edge_runtime.datastores import HNSWDatastore
from edge_runtime.hnsw_format import check_hnsw_index
from edge_runtime.locking import directory_lock
from experiments import benchmark_support as C


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = C.script_parser(__doc__)
    p.add_argument("--out", type=Path, required=True, help="directory for the CSV and markdown")
    p.add_argument(
        "--sizes",
        type=C.positive_int,
        nargs="+",
        default=[1000, 10000, 50000],
        help="stored samples per datastore",
    )
    p.add_argument("--dim", type=C.positive_int, default=64, help="embedding dimension")
    p.add_argument("--reps", type=C.positive_int, default=7, help="timed runs per measurement")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure_size(n: int, dim: int, reps: int, seed: int, directory: Path) -> list[dict]:
    import hnswlib

    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, dim)).astype(np.float32)
    y = rng.integers(0, 10, n)
    hnsw_names = HNSWDatastore(10, M=16, ef_construction=100, seed=seed).fit(z, y).save(directory)
    binary = directory / hnsw_names[1]

    def hnswlib_load():
        hnswlib.Index(space="l2", dim=dim).load_index(str(binary), allow_replace_deleted=True)

    npz = directory / "flat.npz"
    save_npz_atomic(npz, {"keys": z, "labels": y, "order": np.arange(n)})
    rows = [
        {
            "file": "hnsw.bin (M16)",
            "samples": n,
            "bytes": binary.stat().st_size,
            "check_ms": median_ms(lambda: check_hnsw_index(binary.read_bytes(), dim), reps),
            "read_ms": median_ms(hnswlib_load, reps),
        },
        {
            "file": "datastore.npz (flat fp32)",
            "samples": n,
            "bytes": npz.stat().st_size,
            "check_ms": median_ms(lambda: check_npz_members(npz), reps),
            "read_ms": median_ms(lambda: load_npz(npz), reps),
        },
    ]
    for row in rows:
        row["check_over_read"] = row["check_ms"] / row["read_ms"]
    return rows


def lock_ms(directory: Path, reps: int) -> float:
    def take():
        with directory_lock(directory, exclusive=False):
            pass

    return median_ms(take, reps)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _, info = C.start_benchmark(args.out, threads=1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="knnper-load-checks-") as tmp:
        for n in args.sizes:
            rows += measure_size(n, args.dim, args.reps, args.seed, Path(tmp))
        lock = lock_ms(Path(tmp), 1000)
    C.write_csv(args.out / "load_checks.csv", rows)  # the rows' keys, in order
    table = C.markdown_table(
        rows,
        [
            ("file", "file", ""),
            ("samples", "samples", "d"),
            ("bytes", "bytes", "d"),
            ("check_ms", "check (ms)", ".2f"),
            ("read_ms", "reading it (ms)", ".2f"),
            ("check_over_read", "check / read", ".2f"),
        ],
    )
    text = (
        f"Command: `{C.command_line()}`\n\nMachine: {C.machine_line(info)}\n\n{table}\n\n"
        f"Shared bundle lock, taken and released: {1000 * lock:.1f} us (median of 1000).\n"
    )
    (args.out / "load_checks.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
