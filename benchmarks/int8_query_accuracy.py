"""What quantising the query to 7 bits (the integer scan of int8 keys) costs in accuracy: int8
bundles of a digits run predicted by the runtime, against the same bundles searched with the
float query (the int8 path before the integer scan).

    python benchmarks/int8_query_accuracy.py --out OUT [--clients 6] [--rounds 5] [--seed 0]

Writes OUT/int8_query_accuracy.json: test accuracy of both, and how often their argmax agrees.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edge_runtime.knn import exact_search, kernel_posterior, softmax
from edge_runtime.runtime import Runtime
from experiments import benchmark_support as C
from export.exporter import ExportSettings, export_run
from export.sizing import SearchSpace
from fed_train.algorithms.base import TrainingConfig
from fed_train.run import RunConfig, load_run, train


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = C.script_parser(__doc__)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--clients", type=C.positive_int, default=6)
    p.add_argument("--rounds", type=C.positive_int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _counts(args: argparse.Namespace, root: Path) -> dict[str, int]:
    """Test images each query form gets right, over every client's int8 bundle, trained and
    exported under `root`."""
    config = RunConfig(
        dataset="digits",
        clients=args.clients,
        seed=args.seed,
        training=TrainingConfig(rounds=args.rounds, epochs=1, batch_size=16, lr=0.05, momentum=0.9),
    )
    train(config, root / "run", progress=False)
    run = load_run(root / "run")
    space = SearchSpace(backends=("flat",), flat_dtypes=("int8",))
    report = export_run(
        run,
        root / "bundles",
        {c: 10**7 for c in range(args.clients)},
        ExportSettings(space=space),
        progress=False,
    )
    counts = {
        "quantised_query_correct": 0,
        "float_query_correct": 0,
        "argmax_agree": 0,
        "test_images": 0,
    }
    for row in report["clients"]:
        rt = Runtime.load(root / "bundles" / row["bundle"])
        idx = run.partition.clients[row["client_id"]].test
        if len(idx) == 0:
            continue
        x, y = run.dataset.x_test[idx], run.dataset.y_test[idx]
        now = rt.predict_proba(x).argmax(1)
        z, logits = rt.embed(x)
        ds = rt.datastore
        sq, nb = exact_search(z, ds.keys(), ds.k)  # float query, keys as int8 x scale
        p_local = kernel_posterior(sq, ds.labels_[nb], ds.num_classes, ds.sigma, z.shape[1])
        before = rt.head.mix(p_local, softmax(logits)).argmax(1)
        counts["quantised_query_correct"] += int(np.sum(now == y))
        counts["float_query_correct"] += int(np.sum(before == y))
        counts["argmax_agree"] += int(np.sum(now == before))
        counts["test_images"] += len(y)
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    C.start_benchmark(args.out, threads=1)
    with tempfile.TemporaryDirectory(prefix="knnper-int8-query-") as work:
        counts = _counts(args, Path(work))
    n = counts["test_images"]
    C.write_json(
        args.out / "int8_query_accuracy.json",
        {
            "command": C.command_line(),
            "machine": C.machine_info(),
            **counts,
            "quantised_query_accuracy": counts["quantised_query_correct"] / n,
            "float_query_accuracy": counts["float_query_correct"] / n,
            "argmax_agreement": counts["argmax_agree"] / n,
        },
    )
    print(counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
