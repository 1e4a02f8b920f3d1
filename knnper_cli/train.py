"""`knnper train`, `evaluate`, `client-data` and `pretrain`: a federated run, its evaluation,
a client's data for the device commands, and the server-held pretraining. The training code
(torch) is imported by the command that runs, after its flags are parsed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from edge_runtime._io import is_stdout, write_output
from edge_runtime.arg_types import (
    count,
    fraction,
    output_dir,
    output_file_or_stdout,
    positive_int,
    seed,
)
from edge_runtime.cli_help import examples
from edge_runtime.commands import command
from fed_train import defaults
from fed_train.accelerator import resolve_device
from fed_train.knn_request import KNNRequest
from fed_train.knn_setting import describe_record
from fed_train.run_config import EVAL_METHODS, PretrainConfig
from knnper_cli.commands import help_of
from knnper_cli.training_args import (
    DATA_HELP,
    add_device_argument,
    add_model_argument,
    add_precision_argument,
    add_setting_flags,
    add_sgd_arguments,
    add_training_arguments,
    config_from_args,
    from_flags,
)


def _cmd_train(args: argparse.Namespace) -> int:
    from fed_train.run import train

    config = config_from_args(args)
    result = train(
        config,
        Path(args.out),
        progress=not args.no_progress,
        device=resolve_device(args.device),
        client_batch=args.client_batch,
    )
    print(f"trained {result.rounds_done} rounds into {args.out}")
    return 0


def _report(result: dict[str, Any], json_path: str | None) -> None:
    """The table on stdout (on stderr when the JSON goes to standard output, so that stdout
    is one JSON document) and the JSON in `json_path`."""
    from fed_train.evaluation import format_table

    print(format_table(result), file=sys.stderr if is_stdout(json_path) else sys.stdout)
    if json_path:
        write_output(json_path, (json.dumps(result, indent=2) + "\n").encode("utf-8"))
        if not is_stdout(json_path):
            print(f"wrote {json_path}")


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from fed_train.run import load_run
    from fed_train.run_evaluation import evaluate_run

    run = load_run(args.run, resolve_device(args.device))
    result = evaluate_run(
        run,
        args.methods,
        knn=KNNRequest.from_args(args),
        capacity=args.capacity,
        progress=not args.no_progress,
    )
    if "knn" in result:
        print(describe_record(result["knn"]))
    _report(result, args.json)
    return 0


def _cmd_client_data(args: argparse.Namespace) -> int:
    from fed_train.client_files import write_client_files
    from fed_train.run import load_run

    written = write_client_files(load_run(args.run), args.client, Path(args.out))
    for path in written:
        print(f"wrote {path}")
    return 0


def _cmd_pretrain(args: argparse.Namespace) -> int:
    from fed_train.pretrain import pretrain

    config = from_flags(PretrainConfig, args)
    record = pretrain(
        config, Path(args.out), progress=not args.no_progress, device=resolve_device(args.device)
    )
    print(
        f"pretrained {record['model']} on {record['samples']['train']} samples: validation "
        f"accuracy {100 * record['val_accuracy']:.1f}% at epoch {record['best_epoch']}; wrote "
        f"{args.out} (use it with --init {args.out})"
    )
    return 0


def _add_pretrain_command(sub: argparse._SubParsersAction) -> None:
    d = PretrainConfig()
    p = command(
        "pretrain",
        _cmd_pretrain,
        help=help_of("pretrain"),
        epilog=examples(
            "knnper pretrain --dataset fashion-mnist --server-fraction 0.1 --out "
            "runs/pretrain-fmnist",
            "knnper train --dataset fashion-mnist --init runs/pretrain-fmnist "
            "--out runs/fmnist-init",
        ),
    ).add_to(sub)
    add_setting_flags(p, d, dataset="the data set the runs will use", data=DATA_HELP)
    p.add_argument(
        "--out",
        required=True,
        type=output_dir,
        help="directory for model.pt, pretrain.json and server_indices.npy",
    )
    add_setting_flags(
        p,
        d,
        public_data="train on this .npz (x_train, y_train, "
        "x_test, y_test) instead of a split of the training set",
        server_fraction=(fraction, "stratified fraction of the training set the server keeps"),
        val_fraction=(fraction, "fraction of the pretraining data held out to choose the epoch"),
        max_train=(positive_int, "draw the server fraction of this many training samples"),
    )
    add_model_argument(p)
    add_setting_flags(
        p,
        d,
        epochs=(positive_int, "most epochs of central training"),
        patience=(positive_int, "stop after this many epochs without a better validation accuracy"),
    )
    add_sgd_arguments(p, d, "SGD")
    p.add_argument(
        "--augment",
        action="store_true",
        help="random 4-pixel shifted crops and horizontal flips of the images (for "
        "CIFAR-like data; not for digits or letters)",
    )
    add_setting_flags(
        p,
        d,
        seed=(seed, "seed of the split (and of the training, without --weights-seed)"),
        weights_seed=(
            seed,
            "seed of the initial weights, the batch order and the augmentation: another "
            "value trains an independent model on the same server split (default: --seed)",
        ),
    )
    add_device_argument(p)
    add_precision_argument(p)


def _add_core_commands(sub: argparse._SubParsersAction) -> None:
    p = command(
        "train",
        _cmd_train,
        help=help_of("train"),
        epilog=examples(
            "knnper train --out runs/digits                     # digits, a minute",
            "knnper train --dataset fashion-mnist --partition dirichlet --alpha "
            "0.3 --clients 100 --out runs/fmnist",
            note="Re-running the same command resumes from the last checkpoint.",
        ),
    ).add_to(sub)
    add_training_arguments(p)
    p.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=defaults.CHECKPOINT_EVERY,
        help="rounds between checkpoints (Ctrl-C loses at most this many; a write "
        "that would take over a tenth of the training time waits for a later round)",
    )
    p.add_argument(
        "--out", required=True, type=output_dir, help="run directory (re-running resumes it)"
    )
    p.add_argument(
        "--continue-from",
        metavar="RUN",
        default=None,
        help="continue training a finished run's model (its weights are the start; "
        "its pretraining's server split stays the server's); recorded in config.json "
        "so that exports know which version they follow",
    )

    p = command(
        "evaluate",
        _cmd_evaluate,
        help=help_of("evaluate"),
        epilog=examples(
            "knnper evaluate runs/fmnist --json runs/fmnist/evaluation.json",
            "knnper evaluate runs/fmnist --knn-config paper --methods knnper",
            note="Each client's local model is kept in RUN/eval/local.jsonl as "
            "it finishes: an interrupted evaluate resumes there.",
        ),
    ).add_to(sub)
    p.add_argument("run", help="run directory written by `knnper train`")
    KNNRequest.add_arguments(p)
    p.add_argument(
        "--capacity",
        type=fraction,
        default=1.0,
        help="fraction of each client's train split kept in its datastore",
    )
    p.add_argument(
        "--methods", nargs="+", default=list(EVAL_METHODS), help=f"any of {', '.join(EVAL_METHODS)}"
    )
    p.add_argument(
        "--json",
        default=None,
        type=output_file_or_stdout,
        help="write summaries and per-client rows here (- or /dev/stdout: to "
        "standard output, the table then going to stderr; an existing path must be "
        "a regular file or a link to one)",
    )
    add_device_argument(p)  # the precision of local training is the run's own

    p = command(
        "client-data",
        _cmd_client_data,
        help=help_of("client-data"),
        epilog=examples("knnper client-data runs/fmnist --client 3 --out data/client_3"),
    ).add_to(sub)
    p.add_argument("run", help="run directory written by `knnper train`")
    p.add_argument("--client", type=count, required=True, help="client id")
    p.add_argument(
        "--out",
        required=True,
        type=output_dir,
        help="directory for train.npz, val.npz, test.npz (x, y) and test_x.npy",
    )


def add_train_commands(sub: argparse._SubParsersAction) -> None:
    _add_core_commands(sub)
    _add_pretrain_command(sub)
