"""The argument types every `knnper` command shares: one definition of a positive int, a
fraction, a byte count (edge_runtime.byte_count, shared with knnper-edge). The training flags
are knnper_cli.training_args', kNN-Per's fed_train.knn_request's (`KNNRequest.add_arguments`).
No torch: a command's flags are parsed, and a bad one refused, before torch is imported."""

from __future__ import annotations

from edge_runtime.arg_types import (
    byte_count,
    count,
    fraction,
    output_dir,
    output_file,
    output_file_or_stdout,
    positive,
    positive_float,
    positive_int,
    seed,
    threads,
)
from edge_runtime.cli_help import examples

__all__ = [
    "byte_count",
    "count",
    "examples",
    "fraction",
    "output_dir",
    "output_file",
    "output_file_or_stdout",
    "positive",
    "seed",
    "positive_float",
    "positive_int",
    "threads",
]
