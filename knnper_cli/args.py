"""The argument types and flag groups every `knnper` command shares: one definition of a
positive int, a fraction, a byte count (edge_runtime.byte_count, shared with knnper-edge), and
kNN-Per's configuration flags (the training flags are knnper_cli.training_args). No torch: a
command's flags are parsed, and a bad one refused, before torch is imported."""

from __future__ import annotations

import argparse

from edge_runtime.arg_types import (
    byte_count,
    count,
    fraction,
    k_neighbours,
    kernel_sigma,
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
from edge_runtime.knn import NORMALIZATIONS
from fed_train.knn_request import (
    BASE_CHOICES,
    ESTIMATOR_CHOICES,
    KNN_MODES,
    RULE_CHOICES,
    KNNRequest,
)

__all__ = [
    "add_knn_arguments",
    "byte_count",
    "count",
    "examples",
    "fraction",
    "knn_request",
    "output_dir",
    "output_file",
    "output_file_or_stdout",
    "positive",
    "seed",
    "positive_float",
    "positive_int",
    "threads",
]


def add_knn_arguments(p: argparse.ArgumentParser) -> None:
    """--knn-config and the flags that pin one value of it, for every command that runs
    kNN-Per (evaluate, export, bench table, demo, experiment, deploy)."""
    p.add_argument(
        "--knn-config",
        choices=KNN_MODES,
        default="tuned",
        help="kNN-Per's k, sigma, normalisation and lambda estimator: chosen on the "
        "seen clients' pooled validation splits (tuned, saved in the run directory "
        "and reused) or the paper's fixed setting (k=10, sigma=1, raw embeddings, "
        "lambda on validation)",
    )
    p.add_argument(
        "--k",
        type=k_neighbours,
        default=None,
        help="pin kNN-Per's number of neighbours (default: from --knn-config)",
    )
    p.add_argument(
        "--sigma",
        type=kernel_sigma,
        default=None,
        help="pin kNN-Per's kernel width (default: from --knn-config)",
    )
    p.add_argument(
        "--normalize",
        choices=NORMALIZATIONS,
        default=None,
        help="pin the embedding normalisation before the kNN (default: from --knn-config)",
    )
    p.add_argument(
        "--lambda-estimator",
        choices=ESTIMATOR_CHOICES,
        default=None,
        help="pin how each client picks lambda: its validation split (val), plus "
        "leave-one-out posteriors of its datastore (loo+val), or whichever wins 2-fold "
        "cross-validation inside the validation splits (auto; default: from "
        "--knn-config)",
    )
    p.add_argument(
        "--lambda-rule",
        choices=RULE_CHOICES,
        default=None,
        help="pin how lambda pools evidence across clients: each client's own "
        "(client, the paper's), one lambda from the seen clients' pooled validation "
        "splits (pooled), each client's own evidence shrunk toward the pooled one "
        "(shrunk), or whichever wins 2-fold cross-validation inside the validation "
        "splits (auto; default: auto with --knn-config tuned, client with paper)",
    )
    p.add_argument(
        "--base",
        choices=BASE_CHOICES,
        default=None,
        help="pin what the kNN is interpolated with: the global model (global, the "
        "paper's), each client's linear head fitted on its own embeddings (linear), "
        "or whichever wins 2-fold cross-validation inside the validation splits "
        "(auto; default: auto with --knn-config tuned, global with paper)",
    )


def knn_request(args: argparse.Namespace) -> KNNRequest:
    return KNNRequest(
        args.knn_config,
        args.k,
        args.sigma,
        args.normalize,
        args.lambda_estimator,
        args.lambda_rule,
        args.base,
    )
