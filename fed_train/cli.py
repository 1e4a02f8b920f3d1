"""The `knnper` command line: train a federated run, evaluate it, write a client's data for the
device commands. Other packages add their own sub-commands through `main(extra=...)`."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from edge_runtime._io import write_json_atomic
from edge_runtime.cli_help import (
    DefaultsHelpFormatter,
    missing_command_message,
    package_version,
)
from fed_train import defaults
from fed_train.algorithms import build_algorithm
from fed_train.algorithms.base import TrainingConfig, get_weights
from fed_train.bench import add_bench_command
from fed_train.client_files import write_client_files
from fed_train.data import DEFAULT_PATHS
from fed_train.device import DEVICES, PRECISIONS, resolve_device
from fed_train.errors import KnnperError
from fed_train.evaluation import client_accuracies, format_table, merge_results
from fed_train.knn_choice import (
    KNNRequest,
    add_knn_arguments,
    describe_record,
    knn_request,
    load_or_choose,
)
from fed_train.pretrain import PretrainConfig, pretrain
from fed_train.run import LoadedRun, RunConfig, load_run, train

log = logging.getLogger("knnper")

EVAL_METHODS = ("local", "fedavg", "knnper")
CommandAdder = Callable[[argparse._SubParsersAction], None]
DESCRIPTION = ("Personalized federated learning through local memorization (kNN-Per): train a "
               "federated run, evaluate it, export per-device bundles. Start with `knnper demo`.")
INTERRUPTED = 130  # the shell's code for a process ended by SIGINT
DATA_HELP = ("path of the data (file or directory); default: none needed for digits (it ships "
             "with scikit-learn), " + ", ".join(f"{path} for {name}" for name, path
                                                in DEFAULT_PATHS.items())
             + "; every other data set needs one")


class _Parser(argparse.ArgumentParser):
    """One line on stderr and exit 2 for a bad flag, like every other error of this CLI; every
    option's help shows its default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {missing_command_message(self, message)}\n")


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


FLOAT32_MAX = 3.4028234663852886e38


def _learning_rate(text: str) -> float:
    """A rate torch can apply to float32 weights (larger ones overflow inside the optimizer;
    merely large ones end in the trainer's 'loss became NaN' error)."""
    value = _positive_float(text)
    if value > FLOAT32_MAX:
        raise argparse.ArgumentTypeError(f"must fit a float32 (at most {FLOAT32_MAX:.3g}), "
                                         f"got {text}")
    return value


def _threads(text: str) -> int:
    """1 to this machine's cores: more threads only contend, and huge counts fail to start."""
    value = _positive_int(text)
    cores = os.cpu_count() or 1
    if value > cores:
        raise argparse.ArgumentTypeError(f"must be at most {cores} (this machine's cores), "
                                         f"got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    """Data, partition and optimisation flags shared by `train` and `bench table`; the
    optimisation defaults are fed_train.defaults.TRAINING (chosen on validation)."""
    d = RunConfig()
    t = defaults.TRAINING
    p.add_argument("--dataset", default=d.dataset, help="digits, fashion-mnist, mnist, npz, "
                   "cifar10, cifar100, femnist, shakespeare")
    p.add_argument("--data", default=None, help=DATA_HELP)
    p.add_argument("--max-train", type=_positive_int, default=None,
                   help="subsample the training set (stratified) to this many samples")
    p.add_argument("--partition", default=d.partition,
                   help="dirichlet, pachinko, pathological, natural")
    p.add_argument("--alpha", type=_positive_float, default=d.alpha,
                   help="Dirichlet / pachinko concentration (smaller: more heterogeneous)")
    p.add_argument("--beta", type=_positive_float, default=d.beta,
                   help="pachinko: concentration of the fine labels within a coarse label")
    p.add_argument("--classes-per-client", type=_positive_int, default=d.classes_per_client,
                   help="pathological: classes each client holds")
    p.add_argument("--clients", type=_positive_int, default=d.clients, help="number of clients")
    p.add_argument("--unseen-fraction", type=float, default=d.unseen_fraction,
                   help="fraction of clients held out of training (evaluated as unseen)")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction,
                   help="fraction of each client's train data kept for validation")
    p.add_argument("--model", default=None,
                   help="small-cnn, mobilenet-v2, char-lstm (default: chosen by input kind)")
    p.add_argument("--rounds", type=_positive_int, default=t.rounds,
                   help="federated rounds")
    p.add_argument("--participation", type=_fraction, default=t.participation,
                   help="fraction of training clients sampled per round")
    p.add_argument("--local-epochs", type=_positive_int, default=t.epochs,
                   help="local epochs per round")
    p.add_argument("--local-steps", type=_positive_int, default=None,
                   help="a fixed number of local SGD steps instead of epochs")
    p.add_argument("--batch-size", type=_positive_int, default=t.batch_size,
                   help="local SGD batch size")
    p.add_argument("--lr", type=_learning_rate, default=t.lr, help="client learning rate")
    p.add_argument("--momentum", type=float, default=t.momentum, help="client SGD momentum")
    p.add_argument("--weight-decay", type=float, default=t.weight_decay,
                   help="client SGD weight decay")
    p.add_argument("--milestones", type=_fraction, nargs="*", default=list(t.milestones),
                   help="fractions of the rounds at which the learning rate decays")
    p.add_argument("--lr-gamma", type=_positive_float, default=t.gamma,
                   help="learning-rate factor at each milestone")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the partition, initialisation and client sampling")
    p.add_argument("--init", default=None,
                   help="start every method from these weights: a `knnper pretrain` directory "
                   "(its server split is then left out of the clients' data) or a .pt state dict")
    add_device_argument(p)
    add_precision_argument(p)
    p.add_argument("--client-batch", type=_positive_int, default=1,
                   help="step up to this many sampled clients together (one vmap over their "
                   "stacked weights): for a GPU; on 2 CPU cores it was 3x slower. Models with "
                   "BatchNorm or an LSTM train one after another (mobilenet-v2-gn can)")


def add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to train and evaluate: auto takes the GPU when torch sees one; "
                   "cuda without one is an error. Checkpoints and model.pt load on any device")


def add_precision_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="of the training forward passes: bf16 autocasts them (weights and "
                   "optimiser state stay fp32); saved with the run's training settings")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    training = TrainingConfig(rounds=args.rounds, participation=args.participation,
                              epochs=args.local_epochs, steps=args.local_steps,
                              batch_size=args.batch_size, lr=args.lr, momentum=args.momentum,
                              weight_decay=args.weight_decay, milestones=tuple(args.milestones),
                              gamma=args.lr_gamma, precision=args.precision)
    return RunConfig(dataset=args.dataset, data=args.data, max_train=args.max_train,
                     partition=args.partition, alpha=args.alpha, beta=args.beta,
                     classes_per_client=args.classes_per_client, clients=args.clients,
                     unseen_fraction=args.unseen_fraction, val_fraction=args.val_fraction,
                     model=args.model, seed=args.seed, training=training,
                     # absolute, so later commands find it from any directory
                     init=None if args.init is None else str(Path(args.init).resolve()),
                     checkpoint_every=getattr(args, "checkpoint_every",
                                              defaults.CHECKPOINT_EVERY))


def _local_cache_key(run: LoadedRun) -> dict[str, Any]:
    """As it reads back from JSON (tuples become lists), so a saved key equals a fresh one."""
    return json.loads(json.dumps({"training": run.config.to_dict()["training"],
                                  "seed": run.config.seed}))


def evaluate_run(run: LoadedRun, methods: Sequence[str], *, knn: KNNRequest | None = None,
                 capacity: float = 1.0, progress: bool = True) -> dict[str, Any]:
    """Local, FedAvg and kNN-Per on every client of a finished run. kNN-Per runs the run's
    saved configuration (chosen on validation the first time it is needed: fed_train.knn_choice).
    Local models take as long to train as the run itself, so their per-client results are
    cached in RUN/eval/local.json."""
    clients = run.clients()
    weights = get_weights(run.model)
    per_method: dict[str, list[dict[str, Any]]] = {}
    choice = None
    for method in methods:
        if method not in EVAL_METHODS:
            raise KnnperError(f"unknown method {method!r} for evaluate; known: "
                              f"{', '.join(EVAL_METHODS)}")
        cache = run.run_dir / "eval" / "local.json"
        if method == "local" and cache.exists():
            cached = json.loads(cache.read_text())
            if cached.get("key") == _local_cache_key(run):
                per_method[method] = cached["rows"]
                continue
        hyper: dict[str, Any] = {}
        if method == "knnper":
            choice = load_or_choose(run.run_dir, run.model, clients, knn or KNNRequest(),
                                    seed=run.config.seed)
            hyper = {**choice.hyper(), "capacity": capacity}
        algorithm = build_algorithm(method, run.model_factory(), run.config.training, **hyper)
        rows = client_accuracies(algorithm, weights, {}, clients, seed=run.config.seed,
                                 progress=progress)
        per_method[method] = rows
        if method == "local":
            cache.parent.mkdir(exist_ok=True)
            write_json_atomic(cache, {"key": _local_cache_key(run), "rows": rows})
    result = merge_results(per_method)
    if choice is not None:
        result["knn"] = choice.record
    return result


def _cmd_train(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    result = train(config, Path(args.out), progress=not args.no_progress,
                   device=resolve_device(args.device), client_batch=args.client_batch)
    print(f"trained {result.rounds_done} rounds into {args.out}")
    return 0


def _report(result: dict[str, Any], json_path: str | None) -> None:
    print(format_table(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {json_path}")


def _cmd_evaluate(args: argparse.Namespace) -> int:
    run = load_run(args.run, resolve_device(args.device))
    result = evaluate_run(run, args.methods, knn=knn_request(args), capacity=args.capacity,
                          progress=not args.no_progress)
    if "knn" in result:
        print(describe_record(result["knn"]))
    _report(result, args.json)
    return 0


def _cmd_client_data(args: argparse.Namespace) -> int:
    written = write_client_files(load_run(args.run), args.client, Path(args.out))
    for path in written:
        print(f"wrote {path}")
    return 0


def _cmd_pretrain(args: argparse.Namespace) -> int:
    config = PretrainConfig(dataset=args.dataset, data=args.data, public_data=args.public_data,
                            model=args.model, server_fraction=args.server_fraction,
                            val_fraction=args.val_fraction, max_train=args.max_train,
                            epochs=args.epochs, patience=args.patience,
                            batch_size=args.batch_size, lr=args.lr, momentum=args.momentum,
                            weight_decay=args.weight_decay, augment=args.augment,
                            precision=args.precision, seed=args.seed)
    record = pretrain(config, Path(args.out), progress=not args.no_progress,
                      device=resolve_device(args.device))
    print(f"pretrained {record['model']} on {record['samples']['train']} samples: validation "
          f"accuracy {record['val_accuracy']:.4f} at epoch {record['best_epoch']}; wrote "
          f"{args.out} (use it with --init {args.out})")
    return 0


def _add_pretrain_command(sub: argparse._SubParsersAction) -> None:
    d = PretrainConfig()
    p = sub.add_parser("pretrain", help="train the model centrally on a server-held split that "
                       "no client sees, as the starting point for --init")
    p.add_argument("--dataset", default=d.dataset, help="the data set the runs will use")
    p.add_argument("--data", default=None, help=DATA_HELP)
    p.add_argument("--out", required=True, help="directory for model.pt, pretrain.json and "
                   "server_indices.npy")
    p.add_argument("--public-data", default=None, help="train on this .npz (x_train, y_train, "
                   "x_test, y_test) instead of a split of the training set")
    p.add_argument("--server-fraction", type=_fraction, default=d.server_fraction,
                   help="stratified fraction of the training set the server keeps")
    p.add_argument("--val-fraction", type=_fraction, default=d.val_fraction,
                   help="fraction of the pretraining data held out to choose the epoch")
    p.add_argument("--max-train", type=_positive_int, default=None,
                   help="draw the server fraction of this many training samples")
    p.add_argument("--model", default=None,
                   help="small-cnn, mobilenet-v2, char-lstm (default: by input kind)")
    p.add_argument("--epochs", type=_positive_int, default=d.epochs,
                   help="most epochs of central training")
    p.add_argument("--patience", type=_positive_int, default=d.patience,
                   help="stop after this many epochs without a better validation accuracy")
    p.add_argument("--batch-size", type=_positive_int, default=d.batch_size,
                   help="SGD batch size")
    p.add_argument("--lr", type=_learning_rate, default=d.lr, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help="SGD weight decay")
    p.add_argument("--augment", action="store_true",
                   help="random 4-pixel shifted crops and horizontal flips of the images (for "
                   "CIFAR-like data; not for digits or letters)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the split and the training")
    add_device_argument(p)
    add_precision_argument(p)
    p.set_defaults(func=_cmd_pretrain)


def _add_core_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train FedAvg's global model on a partitioned data set")
    add_training_arguments(p)
    p.add_argument("--checkpoint-every", type=_positive_int, default=defaults.CHECKPOINT_EVERY,
                   help="rounds between checkpoints (Ctrl-C loses at most this many)")
    p.add_argument("--out", required=True, help="run directory (re-running resumes it)")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("evaluate", help="local / FedAvg / kNN-Per accuracy of a finished run")
    p.add_argument("run", help="run directory written by `knnper train`")
    add_knn_arguments(p, _positive_int, _positive_float)
    p.add_argument("--capacity", type=_fraction, default=1.0,
                   help="fraction of each client's train split kept in its datastore")
    p.add_argument("--methods", nargs="+", default=list(EVAL_METHODS),
                   help=f"any of {', '.join(EVAL_METHODS)}")
    p.add_argument("--json", default=None, help="write summaries and per-client rows here")
    add_device_argument(p)  # the precision of local training is the run's own
    p.set_defaults(func=_cmd_evaluate)

    p = sub.add_parser("client-data", help="write one client's raw data as the .npz / .npy files "
                       "the device commands (knnper-edge) take")
    p.add_argument("run", help="run directory written by `knnper train`")
    p.add_argument("--client", type=int, required=True, help="client id")
    p.add_argument("--out", required=True, help="directory for train.npz, val.npz, test.npz "
                   "(x, y) and test_x.npy")
    p.set_defaults(func=_cmd_client_data)


def build_parser(extra: Sequence[CommandAdder] = ()) -> argparse.ArgumentParser:
    """The whole command line: these commands, bench's, and those `extra` adds."""
    parser = _Parser(prog="knnper", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--threads", type=_threads, default=defaults.THREADS,
                        help="torch intra-op threads (1 trained the digits and Fashion-MNIST "
                        "models fastest: BENCHMARKS.md)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_core_commands(sub)
    _add_pretrain_command(sub)
    add_bench_command(sub)
    for add in extra:
        add(sub)
    return parser


def _one_line(err: BaseException) -> str:
    """An error as one line: a file system error by its reason and path (a full disk, a path
    under a file), a MemoryError by what it means; multi-line messages joined."""
    if isinstance(err, MemoryError):
        return "out of memory (a size or budget larger than this machine can hold?)"
    if isinstance(err, OSError) and err.strerror:
        where = f": {err.filename}" if err.filename else ""
        return f"{err.strerror}{where}"
    return " ".join(str(err).split()) or type(err).__name__


def main(argv: Sequence[str] | None = None, extra: Sequence[CommandAdder] = ()) -> int:
    args = build_parser(extra).parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (KnnperError, ValueError, OSError, MemoryError) as err:
        print(f"knnper: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"knnper: interrupted; run the same command again to resume {args.command}",
              file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
