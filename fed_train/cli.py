"""The `knnper` command line: train a federated run, evaluate it, or do both on digits (demo).
Other packages add their own sub-commands through `main(extra=...)`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fed_train.algorithms import build_algorithm
from fed_train.algorithms.base import TrainingConfig, get_weights
from fed_train.bench import add_bench_command
from fed_train.errors import KnnperError
from fed_train.evaluation import client_accuracies, format_table, merge_results
from fed_train.pretrain import PretrainConfig, pretrain
from fed_train.run import LoadedRun, RunConfig, load_run, train

log = logging.getLogger("knnper")

EVAL_METHODS = ("local", "fedavg", "knnper")
CommandAdder = Callable[[argparse._SubParsersAction], None]


class _Parser(argparse.ArgumentParser):
    """One line on stderr and exit 2 for a bad flag, like every other error of this CLI."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
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
    """Data, partition and optimisation flags shared by `train` and `bench table`."""
    d = RunConfig()
    t = TrainingConfig()
    p.add_argument("--dataset", default=d.dataset, help="digits, fashion-mnist, mnist, npz, "
                   "cifar10, cifar100, femnist, shakespeare")
    p.add_argument("--data", default=None, help="path of the data (file or directory)")
    p.add_argument("--max-train", type=_positive_int, default=None,
                   help="subsample the training set (stratified) to this many samples")
    p.add_argument("--partition", default=d.partition,
                   help="dirichlet, pachinko, pathological, natural")
    p.add_argument("--alpha", type=_positive_float, default=d.alpha)
    p.add_argument("--beta", type=_positive_float, default=d.beta)
    p.add_argument("--classes-per-client", type=_positive_int, default=d.classes_per_client)
    p.add_argument("--clients", type=_positive_int, default=d.clients)
    p.add_argument("--unseen-fraction", type=float, default=d.unseen_fraction)
    p.add_argument("--val-fraction", type=float, default=d.val_fraction)
    p.add_argument("--model", default=None,
                   help="small-cnn, mobilenet-v2, char-lstm (default: by input kind)")
    p.add_argument("--rounds", type=_positive_int, default=t.rounds)
    p.add_argument("--participation", type=_fraction, default=t.participation,
                   help="fraction of training clients sampled per round")
    p.add_argument("--local-epochs", type=_positive_int, default=t.epochs)
    p.add_argument("--local-steps", type=_positive_int, default=None,
                   help="a fixed number of local SGD steps instead of epochs")
    p.add_argument("--batch-size", type=_positive_int, default=t.batch_size)
    p.add_argument("--lr", type=_positive_float, default=t.lr)
    p.add_argument("--momentum", type=float, default=t.momentum)
    p.add_argument("--weight-decay", type=float, default=t.weight_decay)
    p.add_argument("--milestones", type=float, nargs="*", default=list(t.milestones),
                   help="fractions of the rounds at which the learning rate decays")
    p.add_argument("--lr-gamma", type=_positive_float, default=t.gamma)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--init", default=None,
                   help="start every method from these weights: a `knnper pretrain` directory "
                   "(its server split is then left out of the clients' data) or a .pt state dict")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    training = TrainingConfig(rounds=args.rounds, participation=args.participation,
                              epochs=args.local_epochs, steps=args.local_steps,
                              batch_size=args.batch_size, lr=args.lr, momentum=args.momentum,
                              weight_decay=args.weight_decay, milestones=tuple(args.milestones),
                              gamma=args.lr_gamma)
    return RunConfig(dataset=args.dataset, data=args.data, max_train=args.max_train,
                     partition=args.partition, alpha=args.alpha, beta=args.beta,
                     classes_per_client=args.classes_per_client, clients=args.clients,
                     unseen_fraction=args.unseen_fraction, val_fraction=args.val_fraction,
                     model=args.model, init=args.init, seed=args.seed,
                     checkpoint_every=getattr(args, "checkpoint_every", 5), training=training)


def _local_cache_key(run: LoadedRun) -> dict[str, Any]:
    return {"training": run.config.to_dict()["training"], "seed": run.config.seed}


def evaluate_run(run: LoadedRun, methods: Sequence[str], *, k: int = 10, sigma: float = 1.0,
                 capacity: float = 1.0, progress: bool = True) -> dict[str, Any]:
    """Local, FedAvg and kNN-Per on every client of a finished run. Local models take as long to
    train as the run itself, so their per-client results are cached in RUN/eval/local.json."""
    clients = run.clients()
    weights = get_weights(run.model)
    per_method: dict[str, list[dict[str, Any]]] = {}
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
        hyper = {"k": k, "sigma": sigma, "capacity": capacity} if method == "knnper" else {}
        algorithm = build_algorithm(method, run.model_factory(), run.config.training, **hyper)
        rows = client_accuracies(algorithm, weights, {}, clients, seed=run.config.seed,
                                 progress=progress)
        per_method[method] = rows
        if method == "local":
            cache.parent.mkdir(exist_ok=True)
            cache.write_text(json.dumps({"key": _local_cache_key(run), "rows": rows}))
    return merge_results(per_method)


def _cmd_train(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    result = train(config, Path(args.out), progress=not args.no_progress)
    print(f"trained {result.rounds_done} rounds into {args.out}")
    return 0


def _report(result: dict[str, Any], json_path: str | None) -> None:
    print(format_table(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {json_path}")


def _cmd_evaluate(args: argparse.Namespace) -> int:
    run = load_run(args.run)
    result = evaluate_run(run, args.methods, k=args.k, sigma=args.sigma, capacity=args.capacity,
                          progress=not args.no_progress)
    _report(result, args.json)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.threads is None:
        torch.set_num_threads(1)  # 8x8 images: intra-op threads cost more than they save
    config = RunConfig(dataset="digits", partition="dirichlet", alpha=0.3, clients=20,
                       seed=args.seed,
                       training=TrainingConfig(rounds=20, epochs=2, batch_size=16, lr=0.05,
                                               momentum=0.9))
    out = Path(args.out)
    train(config, out, progress=not args.no_progress)
    result = evaluate_run(load_run(out), EVAL_METHODS, progress=not args.no_progress)
    _report(result, str(out / "evaluation.json"))
    return 0


def _cmd_pretrain(args: argparse.Namespace) -> int:
    config = PretrainConfig(dataset=args.dataset, data=args.data, public_data=args.public_data,
                            model=args.model, server_fraction=args.server_fraction,
                            val_fraction=args.val_fraction, max_train=args.max_train,
                            epochs=args.epochs, patience=args.patience,
                            batch_size=args.batch_size, lr=args.lr, momentum=args.momentum,
                            weight_decay=args.weight_decay, seed=args.seed)
    record = pretrain(config, Path(args.out), progress=not args.no_progress)
    print(f"pretrained {record['model']} on {record['samples']['train']} samples: validation "
          f"accuracy {record['val_accuracy']:.4f} at epoch {record['best_epoch']}; wrote "
          f"{args.out} (use it with --init {args.out})")
    return 0


def _add_pretrain_command(sub: argparse._SubParsersAction) -> None:
    d = PretrainConfig()
    p = sub.add_parser("pretrain", help="train the model centrally on a server-held split that "
                       "no client sees, as the starting point for --init")
    p.add_argument("--dataset", default=d.dataset, help="the data set the runs will use")
    p.add_argument("--data", default=None, help="path of the data (file or directory)")
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
    p.add_argument("--epochs", type=_positive_int, default=d.epochs)
    p.add_argument("--patience", type=_positive_int, default=d.patience,
                   help="stop after this many epochs without a better validation accuracy")
    p.add_argument("--batch-size", type=_positive_int, default=d.batch_size)
    p.add_argument("--lr", type=_positive_float, default=d.lr)
    p.add_argument("--momentum", type=float, default=d.momentum)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the split and the training")
    p.set_defaults(func=_cmd_pretrain)


def _add_core_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train FedAvg's global model on a partitioned data set")
    add_training_arguments(p)
    p.add_argument("--checkpoint-every", type=_positive_int, default=5)
    p.add_argument("--out", required=True, help="run directory (re-running resumes it)")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("evaluate", help="local / FedAvg / kNN-Per accuracy of a finished run")
    p.add_argument("run")
    p.add_argument("--k", type=_positive_int, default=10)
    p.add_argument("--sigma", type=_positive_float, default=1.0)
    p.add_argument("--capacity", type=_fraction, default=1.0,
                   help="fraction of each client's train split kept in its datastore")
    p.add_argument("--methods", nargs="+", default=list(EVAL_METHODS))
    p.add_argument("--json", default=None, help="write summaries and per-client rows here")
    p.set_defaults(func=_cmd_evaluate)

    p = sub.add_parser("demo", help="train and evaluate on scikit-learn's digits (about a minute)")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_demo)


def main(argv: Sequence[str] | None = None, extra: Sequence[CommandAdder] = ()) -> int:
    parser = _Parser(prog="knnper", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="torch intra-op threads (default: torch's choice)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_core_commands(sub)
    _add_pretrain_command(sub)
    add_bench_command(sub)
    for add in extra:
        add(sub)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (KnnperError, ValueError, FileNotFoundError) as err:
        print(f"knnper: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
