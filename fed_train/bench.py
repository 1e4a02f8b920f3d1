"""`knnper bench table`: the paper's Table 1 (clients seen in training) and Table 2 (unseen
clients) on one partition, every method with the same rounds, local epochs, batch size, learning
rate schedule and model.

One partition is drawn and saved in OUT. Each training run lives in OUT/runs/METHOD/lr_LR and
checkpoints, so an interrupted table resumes; FedAvg is trained once and personalized three ways
(FedAvg, FedAvg+, kNN-Per). Per-client results of each method are cached in OUT/eval, so adding a
method to a finished table only runs that method. Outputs: table.md, table1.csv, table2.csv,
clients.csv and results.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fed_train.algorithms import ALGORITHMS, build_algorithm
from fed_train.algorithms.base import ClientData, TrainingConfig, get_weights
from fed_train.data import load_dataset
from fed_train.errors import KnnperError
from fed_train.evaluation import merge_results
from fed_train.models import EmbedHeadModel, build_model, default_model
from fed_train.partition import Partition, make_partition
from fed_train.run import CONFIG_FILE, PARTITION_FILE, RunConfig, prepare_clients
from fed_train.simulation import simulate
from fed_train.tuning import (
    LR_GRID,
    check_lr_grid,
    choose_lr,
    parse_lr_grid,
    personalized_accuracies,
    validation_score,
)

log = logging.getLogger(__name__)

METHODS: tuple[str, ...] = ("local", "fedavg", "fedavg+", "clustered", "ditto", "fedrep", "apfl",
                            "pfedgp", "knnper")
TITLES = {"local": "Local", "fedavg": "FedAvg", "fedavg+": "FedAvg+", "clustered": "ClusteredFL",
          "ditto": "Ditto", "fedrep": "FedRep", "apfl": "APFL", "pfedgp": "pFedGP",
          "knnper": "kNN-Per"}
# methods that personalize another method's training run instead of training their own
TRAINED_BY = {"fedavg+": "fedavg", "knnper": "fedavg"}


class BenchError(KnnperError, ValueError):
    """A table that cannot be made with the given methods, grid, partition or output folder."""


def parse_methods(text: str | Sequence[str]) -> list[str]:
    """"all" or a comma-separated list, returned in the table's order without repeats."""
    names = text.split(",") if isinstance(text, str) else list(text)
    names = [n.strip() for n in names if n.strip()]
    if names == ["all"]:
        return list(METHODS)
    unknown = [n for n in names if n not in METHODS or n not in ALGORITHMS]
    if unknown or not names:
        raise BenchError(f"unknown method {', '.join(map(repr, unknown)) or '(none given)'}; "
                         f"known: all, {', '.join(METHODS)}")
    return [m for m in METHODS if m in names]


def check_validation_splits(clients: list[ClientData]) -> None:
    """Every client needs validation data: tuning and most personalizations choose on it."""
    empty = [c.client_id for c in clients if len(c.y_val) == 0]
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (" ..." if len(empty) > 10 else "")
        raise BenchError(f"{len(empty)} client(s) have no validation data (client {shown}); "
                         "the table chooses hyper-parameters on each client's validation split: "
                         "raise --val-fraction or use fewer clients")


def _plain(obj: Any) -> Any:
    """JSON-ready copies of rows whose info may hold numpy scalars."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _lr_dir(lr: float) -> str:
    return f"lr_{lr:.4g}"


class TableRunner:
    """Trains and evaluates the methods of one table inside its output folder."""

    def __init__(self, config: RunConfig, out: Path, *,
                 hyper: Mapping[str, Mapping[str, Any]] | None = None,
                 progress: bool = True) -> None:
        self.config = config
        self.out = Path(out)
        self.hyper = {m: dict(h) for m, h in (hyper or {}).items()}
        self.progress = progress
        self.dataset = load_dataset(config.dataset, config.data, max_train=config.max_train,
                                    seed=config.seed)
        self.model_name = config.model or default_model(self.dataset.input_spec)
        saved = self._load_or_make_partition()
        self.clients = prepare_clients(self.dataset, self.partition)
        check_validation_splits(self.clients)  # before writing anything into OUT
        if saved is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            self.partition.save(self.out / PARTITION_FILE)
            (self.out / CONFIG_FILE).write_text(json.dumps(saved, indent=2))
        torch.manual_seed(config.seed)
        self.initial_weights = get_weights(self.model_fn())
        self._trained: dict[tuple[str, float], Any] = {}

    def model_fn(self) -> EmbedHeadModel:
        return build_model(self.model_name, self.dataset.num_classes, self.dataset.input_spec)

    def _load_or_make_partition(self) -> dict[str, Any] | None:
        """Load OUT's partition after checking that OUT holds this same table (its cached runs
        and results are only valid for it), or draw a new one and return the configuration to
        save. The learning rate is not part of it: runs are kept per learning rate."""
        saved = self.config.to_dict()
        saved["training"].pop("lr")
        saved.pop("checkpoint_every")
        saved.update(model_name=self.model_name, num_classes=self.dataset.num_classes,
                     input_spec=self.dataset.input_spec)
        saved = json.loads(json.dumps(saved))
        path = self.out / CONFIG_FILE
        if path.exists():
            if json.loads(path.read_text()) != saved:
                raise BenchError(f"{self.out} holds a table with a different configuration; "
                                 "choose another --out or delete it")
            self.partition = Partition.load(self.out / PARTITION_FILE)
            return None
        c = self.config
        self.partition = make_partition(self.dataset, c.partition, c.clients, alpha=c.alpha,
                                        beta=c.beta, classes_per_client=c.classes_per_client,
                                        val_fraction=c.val_fraction,
                                        unseen_fraction=c.unseen_fraction, seed=c.seed)
        return saved

    def _train(self, trainer: str, training: TrainingConfig) -> Any:
        """The simulation result of `trainer` at this learning rate, resumed from its folder."""
        key = (trainer, training.lr)
        if key in self._trained:
            return self._trained[key]
        run_dir = self.out / "runs" / trainer / _lr_dir(training.lr)
        hyper = self.hyper.get(trainer, {})
        stamp = run_dir / "bench.json"
        identity = _plain({"method": trainer, "lr": training.lr, "hyper": hyper})
        if stamp.exists() and json.loads(stamp.read_text()) != identity:
            raise BenchError(f"{run_dir} was trained with other settings "
                             f"({stamp.read_text().strip()}); delete it to retrain")
        run_dir.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps(identity))
        algorithm = build_algorithm(trainer, self.model_fn, training, **hyper)
        result = simulate(algorithm, self.clients, training, self.initial_weights,
                          seed=self.config.seed, run_dir=run_dir,
                          checkpoint_every=self.config.checkpoint_every, progress=self.progress)
        self._trained[key] = result
        return result

    def rows(self, method: str, lr: float) -> list[dict[str, Any]]:
        """Per-client rows of `method` at learning rate `lr`, from the cache when it is there."""
        hyper = self.hyper.get(method, {})
        cache = self.out / "eval" / method / f"{_lr_dir(lr)}.json"
        if cache.exists():
            cached = json.loads(cache.read_text())
            if cached.get("hyper") == _plain(hyper):
                return cached["rows"]
        start = time.perf_counter()
        training = replace(self.config.training, lr=lr)
        algorithm = build_algorithm(method, self.model_fn, training, **hyper)
        if getattr(algorithm, "federated", True):
            sim = self._train(TRAINED_BY.get(method, method), training)
            weights, states = sim.weights, sim.states
        else:
            weights, states = {}, {}
        rows = _plain(personalized_accuracies(algorithm, weights, states, self.clients,
                                              seed=self.config.seed, progress=self.progress))
        seconds = round(time.perf_counter() - start, 1)
        log.info("%s at lr=%g: %.1f s", method, lr, seconds)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"hyper": _plain(hyper), "seconds": seconds, "rows": rows}))
        return rows


def run_table(config: RunConfig, methods: str | Sequence[str], out: str | Path, *,
              tune_lr: bool = False, lr_grid: Sequence[float] = LR_GRID,
              hyper: Mapping[str, Mapping[str, Any]] | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Run every method, write the tables and per-client files into `out`, return the results
    (evaluation's JSON plus the learning rates and validation scores)."""
    names = parse_methods(methods)
    lrs = check_lr_grid(lr_grid) if tune_lr else check_lr_grid([config.training.lr])
    runner = TableRunner(config, Path(out), hyper=hyper, progress=progress)
    per_method: dict[str, list[dict[str, Any]]] = {}
    chosen: dict[str, float] = {}
    scores: dict[str, dict[str, float | None]] = {}
    for method in names:
        by_lr = {lr: runner.rows(method, lr) for lr in lrs}
        val = {lr: validation_score(rows) for lr, rows in by_lr.items()}
        chosen[method] = choose_lr(val) if tune_lr else lrs[0]
        scores[method] = {f"{lr:g}": s for lr, s in val.items()}
        per_method[method] = by_lr[chosen[method]]
    result = merge_results(per_method)
    result.update(methods=names, lr=chosen, validation=scores, tuned=tune_lr,
                  config={**config.to_dict(), "model_name": runner.model_name})
    write_outputs(result, Path(out))
    return result


def _summary_rows(result: dict[str, Any], group: str) -> list[dict[str, Any]]:
    rows = []
    for m in result["methods"]:
        s = result[group].get(m)
        rows.append({"method": m, "mean": None if s is None else round(s["mean"], 6),
                     "bottom_decile": None if s is None else round(s["bottom_decile"], 6),
                     "clients": 0 if s is None else s["clients"], "lr": result["lr"][m],
                     "val_accuracy": result["validation"][m].get(f"{result['lr'][m]:g}")})
    return rows


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def format_markdown(result: dict[str, Any]) -> str:
    """Table 1 and Table 2 in markdown: accuracy in %, mean / bottom decile per method."""
    c = result["config"]
    t = c["training"]
    lr_note = "tuned per method on validation" if result["tuned"] else "fixed"
    lines = [f"# {c['dataset']}, {c['partition']} partition",
             "",
             f"{c['clients']} clients ({c['unseen_fraction']:.0%} unseen), model "
             f"{c['model_name']}, {t['rounds']} rounds x {t['epochs']} local epoch(s), batch "
             f"{t['batch_size']}, participation {t['participation']:g}; learning rate "
             f"{lr_note}. Accuracy in %: mean weighted by test size / bottom decile.", ""]
    for group, title in (("seen", "Table 1: clients seen in training"),
                         ("unseen", "Table 2: unseen clients")):
        lines += [f"## {title}", "", "| method | mean | bottom 10% | lr |", "|---|---|---|---|"]
        for row in _summary_rows(result, group):
            cells = ["-" if row[k] is None else f"{100 * row[k]:.1f}"
                     for k in ("mean", "bottom_decile")]
            lines.append(f"| {TITLES[row['method']]} | {cells[0]} | {cells[1]} | "
                         f"{row['lr']:.3g} |")
        lines.append("")
    return "\n".join(lines)


def write_outputs(result: dict[str, Any], out: Path) -> None:
    _write_csv(out / "table1.csv", _summary_rows(result, "seen"))
    _write_csv(out / "table2.csv", _summary_rows(result, "unseen"))
    _write_csv(out / "clients.csv", result["clients"])
    (out / "table.md").write_text(format_markdown(result))
    (out / "results.json").write_text(json.dumps(_plain(result), indent=2))


def _positive(kind: type, upper: float | None = None):
    """An argparse type: a positive number (at most `upper`), refused with a one-line reason."""

    def parse(text: str):
        value = kind(text)
        if not value > 0 or (upper is not None and value > upper):
            bound = f"in (0, {upper:g}]" if upper is not None else "> 0"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


def _cmd_table(args: argparse.Namespace) -> int:
    from fed_train.cli import config_from_args  # here, not at the top: the CLI imports this module

    if args.lr_grid is not None and not args.tune_lr:
        raise BenchError("--lr-grid is used only with --tune-lr")
    try:
        grid = parse_lr_grid(args.lr_grid) if args.lr_grid is not None else LR_GRID
    except ValueError as err:
        raise BenchError(str(err)) from None
    config = config_from_args(args)
    hyper = {"knnper": {"k": args.k, "sigma": args.sigma, "capacity": args.capacity}}
    result = run_table(config, args.methods, Path(args.out), tune_lr=args.tune_lr, lr_grid=grid,
                       hyper=hyper, progress=not getattr(args, "no_progress", False))
    print(format_markdown(result))
    print(f"wrote {args.out}/table.md, table1.csv, table2.csv, clients.csv, results.json")
    return 0


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    """`knnper bench table ...`; the CLI passes this to `main(extra=...)`."""
    from fed_train.cli import add_training_arguments  # here: the CLI imports this module

    bench = subparsers.add_parser("bench", help="benchmarks: the paper's comparison tables")
    sub = bench.add_subparsers(dest="bench_command", metavar="table", required=True)
    p = sub.add_parser("table", help="every method on one partition: Table 1 (seen clients) and "
                       "Table 2 (unseen clients) as CSV and markdown")
    add_training_arguments(p)
    p.add_argument("--methods", default="all",
                   help=f"all, or a comma-separated list of: {', '.join(METHODS)}")
    p.add_argument("--out", required=True, help="output folder (re-running resumes it)")
    p.add_argument("--tune-lr", action="store_true",
                   help="choose each method's learning rate on validation accuracy over the "
                   "paper's grid (multiplies the cost by the grid's size)")
    p.add_argument("--lr-grid", default=None,
                   help="comma-separated learning rates for --tune-lr (default: 10^-0.5 ... "
                   "10^-2.5)")
    p.add_argument("--checkpoint-every", type=_positive(int), default=5)
    p.add_argument("--k", type=_positive(int), default=10, help="kNN-Per neighbours")
    p.add_argument("--sigma", type=_positive(float), default=1.0, help="kNN-Per kernel scale")
    p.add_argument("--capacity", type=_positive(float, 1.0), default=1.0,
                   help="kNN-Per: fraction of each client's train split in its datastore")
    p.set_defaults(func=_cmd_table)
