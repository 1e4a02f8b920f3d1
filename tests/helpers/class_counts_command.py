"""A device command defined in one file, for docs/extending.md: `knnper-edge classes BUNDLE`
prints how many samples of each class the bundle's datastore stores. One function, one
registration."""

from __future__ import annotations

import numpy as np

from edge_runtime.cli import bundle_argument, register_command
from edge_runtime.cli_help import examples
from edge_runtime.commands import command
from edge_runtime.runtime import Runtime


def cmd_classes(args) -> int:
    rt = Runtime.load(args.bundle)  # verifies the bundle; a bad one is a one-line error
    counts = np.bincount(rt.datastore.labels_, minlength=rt.num_classes)
    print(" ".join(f"{label}:{n}" for label, n in enumerate(counts)))
    return 0


register_command(
    command(
        "classes",
        cmd_classes,
        bundle_argument,
        help="how many samples of each class the bundle's datastore stores",
        epilog=examples("knnper-edge classes bundles/500k/client_0003"),
    )
)
