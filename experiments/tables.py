"""`knnper bench table`: the paper's Table 1 (clients seen in training) and Table 2 (unseen
clients) on one partition, every method with the same rounds, local epochs, batch size, learning
rate schedule and model.

One partition is drawn and saved in OUT. Each training run lives in OUT/runs/METHOD/lr_LR and
checkpoints, so an interrupted table resumes; FedAvg is trained once and personalized four ways
(FedAvg, FedAvg+, FedAvg + linear head, kNN-Per). Per-client results of each method are cached in
OUT/eval, so adding a method to a finished table only runs that method. Outputs: table.md,
table1.csv, table2.csv, clients.csv and results.json.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, KeysView, Mapping, Sequence
from concurrent.futures import as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from edge_runtime._io import (
    JSONFileError,
    csv_text,
    read_json,
    read_json_cache,
    to_json_types,
    write_json_atomic,
    write_text_atomic,
)
from edge_runtime.linear_head import L2_GRID
from experiments.attribution import BODIES, attribution_table, body_rows, format_attribution
from experiments.lr_tuning import LR_GRID, check_lr_grid, choose_lr, validation_score
from experiments.table_estimate import estimate_table
from experiments.table_seeds import (
    clients_hurt,
    format_hurt,
    seed_dir,
    summarize_seeds,
    write_seeds,
)
from fed_train.algorithms import ALGORITHMS, build_algorithm
from fed_train.algorithms.base import ClientData, TrainingConfig
from fed_train.errors import KnnperError, TrainingDiverged
from fed_train.evaluation import client_accuracies, merge_results, summarize
from fed_train.journal import ClientRows, rows_fit
from fed_train.knn_choice import load_or_choose
from fed_train.knn_request import KNNRequest
from fed_train.knn_tuning import choose_l2, client_rows, client_views, linear_base_views
from fed_train.models import EmbedHeadModel, build_model, default_model
from fed_train.partition import Partition
from fed_train.progress import Progress
from fed_train.run import (
    CONFIG_FILE,
    PARTITION_FILE,
    RunConfig,
    check_same_init,
    init_record,
    initial_weights,
    load_run_data,
    prepare_clients,
    run_partition,
)
from fed_train.simulation import simulate
from fed_train.workers import worker_pool

log = logging.getLogger(__name__)

# the table's rows, read live from the registry: a registered method joins every table
METHODS: KeysView[str] = ALGORITHMS.keys()


def titles() -> dict[str, str]:
    """Each method's row title, as its class declares it."""
    return {name: algorithm.title for name, algorithm in ALGORITHMS.items()}


def trainer_of(method: str) -> str:
    """The method whose training run `method` personalizes (itself unless it declares another)."""
    return ALGORITHMS[method].trained_by or method


class BenchError(KnnperError, ValueError):
    """A table that cannot be made with the given methods, grid, partition or output folder."""


def _read_identity(path: Path) -> Any:
    """A JSON file that says what an output folder holds (config.json, bench.json)."""
    try:
        return read_json(path, limit=1 << 20, fix="delete it (or choose another --out)")
    except JSONFileError as err:
        raise BenchError(str(err)) from None


def parse_methods(text: str | Sequence[str]) -> list[str]:
    """ "all" or a comma-separated list, returned in the table's order without repeats."""
    names = text.split(",") if isinstance(text, str) else list(text)
    names = [n.strip() for n in names if n.strip()]
    if names == ["all"]:
        return list(METHODS)
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise BenchError(
            f"unknown method {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"known: all, {', '.join(METHODS)}"
        )
    return [m for m in METHODS if m in names]


def check_validation_splits(clients: list[ClientData]) -> None:
    """Every client needs validation data: tuning and most personalizations choose on it."""
    empty = [c.client_id for c in clients if len(c.y_val) == 0]
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (" ..." if len(empty) > 10 else "")
        raise BenchError(
            f"{len(empty)} client(s) have no validation data (client {shown}); "
            "the table chooses hyper-parameters on each client's validation split: "
            "raise --val-fraction or use fewer clients"
        )


def _lr_dir(lr: float) -> str:
    return f"lr_{lr:.4g}"


@dataclass(frozen=True)
class TableOptions:
    """How a table is run, beside what every method trains with (its `RunConfig`).

    Parameters
    ----------
    tune_lr : choose each method's learning rate from `lr_grid` on validation accuracy.
    lr_grid : the learning rates tried when `tune_lr`.
    hyper : each method's own hyper-parameters, by method.
    progress : a bar on a terminal, a line every 30 s in a log.
    knn : kNN-Per's configuration request; the default is chosen on validation.
    workers : > 1 trains the (method, learning rate) runs in that many processes first.
    attribution : also evaluate every head on every body (attribution.csv).
    device, client_batch : torch's device and the clients stepped together on it.
    """

    tune_lr: bool = False
    lr_grid: Sequence[float] = LR_GRID
    hyper: Mapping[str, Mapping[str, Any]] | None = None
    progress: bool = True
    knn: KNNRequest = KNNRequest()
    workers: int = 1
    attribution: bool = False
    device: str = "cpu"
    client_batch: int = 1

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise BenchError(f"workers must be >= 1, got {self.workers}")


class TableRunner:
    """Trains and evaluates the methods of one table inside its output folder."""

    def __init__(
        self, config: RunConfig, out: Path, options: TableOptions = TableOptions()
    ) -> None:
        self.knn = options.knn
        self.config = config
        self.out = Path(out)
        self.hyper = {m: dict(h) for m, h in (options.hyper or {}).items()}
        self.progress = options.progress
        self.device, self.client_batch = torch.device(options.device), options.client_batch
        self.dataset, self.init = load_run_data(config)
        self.model_name = config.model or default_model(self.dataset.input_spec)
        # every method starts here; a mismatched --init fails before anything is written
        self.initial_weights = initial_weights(self.model_fn, config.seed, self.init)
        saved = self._load_or_make_partition()
        self.clients = prepare_clients(self.dataset, self.partition, self.device)
        check_validation_splits(self.clients)  # before writing anything into OUT
        if saved is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            self.partition.save(self.out / PARTITION_FILE)
            write_json_atomic(self.out / CONFIG_FILE, saved)
        self._trained: dict[tuple[str, float], Any] = {}

    def model_fn(self) -> EmbedHeadModel:
        return build_model(self.model_name, self.dataset.num_classes, self.dataset.input_spec).to(
            self.device
        )

    def _load_or_make_partition(self) -> dict[str, Any] | None:
        """Load OUT's partition after checking that OUT holds this same table (its cached runs
        and results are only valid for it), or draw a new one and return the configuration to
        save. The learning rate is not part of it: runs are kept per learning rate."""
        saved = self.config.to_dict()
        saved["training"].pop("lr")
        saved.pop("checkpoint_every")
        saved.update(
            model_name=self.model_name,
            num_classes=self.dataset.num_classes,
            input_spec=self.dataset.input_spec,
            **init_record(self.init),
        )
        saved = json.loads(json.dumps(saved))
        path = self.out / CONFIG_FILE
        if path.exists():
            previous = _read_identity(path)
            check_same_init(previous, saved, self.out)
            if previous != saved:
                raise BenchError(
                    f"{self.out} holds a table with a different configuration; "
                    "choose another --out or delete it"
                )
            self.partition = Partition.load(self.out / PARTITION_FILE)
            return None
        self.partition = run_partition(self.config, self.dataset)
        return saved

    def train(self, trainer: str, training: TrainingConfig) -> Any:
        """The simulation result of `trainer` at this learning rate, resumed from its folder."""
        key = (trainer, training.lr)
        if key in self._trained:
            return self._trained[key]
        run_dir = self.out / "runs" / trainer / _lr_dir(training.lr)
        hyper = self.hyper.get(trainer, {})
        stamp = run_dir / "bench.json"
        identity = to_json_types({"method": trainer, "lr": training.lr, "hyper": hyper})
        if stamp.exists() and _read_identity(stamp) != identity:
            raise BenchError(
                f"{run_dir} was trained with other settings "
                f"({stamp.read_text().strip()}); delete it to retrain"
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(stamp, identity)  # a worker may be terminated at any point
        algorithm = build_algorithm(trainer, self.model_fn, training, **hyper)
        result = simulate(
            algorithm,
            self.clients,
            training,
            self.initial_weights,
            seed=self.config.seed,
            run_dir=run_dir,
            checkpoint_every=self.config.checkpoint_every,
            progress=self.progress,
            client_batch=self.client_batch,
        )
        self._trained[key] = result
        return result

    def _knn_identity(self) -> dict[str, Any]:
        return {**self.hyper.get("knnper", {}), "knn": asdict(self.knn)}

    def _knn_choice(self, lr: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """kNN-Per's hyper-parameters at this learning rate and the record of how they were
        chosen: the FedAvg run's saved choice (fed_train.knn_choice), made on first use."""
        training = replace(self.config.training, lr=lr)
        fedavg = build_algorithm("fedavg", self.model_fn, training)
        model = fedavg.global_model(self.train("fedavg", training).weights)
        choice = load_or_choose(
            self.out / "runs" / "fedavg" / _lr_dir(lr),
            model,
            self.clients,
            self.knn,
            seed=self.config.seed,
        )
        # each client's lambda beside the test oracle's, for the report only (never saved with
        # the choice, which holds nothing of the test splits)
        views = client_views(model, self.clients)
        if choice.base == "linear":
            views = linear_base_views(views, choice.l2, choice.config.normalize)
        oracle = client_rows(
            views,
            choice.config,
            estimator=choice.lambda_estimator,
            rule=choice.lambda_rule,
            seed=self.config.seed,
        )
        return (
            {**self.hyper.get("knnper", {}), "choice": choice},
            {**choice.record, "oracle_rows": oracle},
        )

    def _linear_choice(self, lr: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """The linear head's l2 at this learning rate, chosen on the seen clients' pooled
        validation splits of the FedAvg run (fed_train.knn_tuning), and the record of it."""
        training = replace(self.config.training, lr=lr)
        model = build_algorithm("fedavg", self.model_fn, training).global_model(
            self.train("fedavg", training).weights
        )
        l2, record = choose_l2(client_views(model, self.clients))
        return {**self.hyper.get("linear", {}), "l2": l2}, record

    def _identity(self, method: str) -> dict[str, Any]:
        """What a method's cached rows depend on besides the training run."""
        if method == "knnper":
            return self._knn_identity()
        if method == "linear":
            return {**self.hyper.get("linear", {}), "l2_grid": list(L2_GRID)}
        return self.hyper.get(method, {})

    def _cached(self, method: str, lr: float) -> tuple[Any, Path, dict[str, Any] | None]:
        """The settings `method`'s rows at `lr` depend on, their cache file, and what it holds
        when it was made with these same settings."""
        identity = self._identity(method)
        cache = self.out / "eval" / method / f"{_lr_dir(lr)}.json"
        cached = read_json_cache(cache)
        if cached is not None and cached.get("hyper") == to_json_types(identity):
            rows = cached.get("rows")
            if rows is None or (isinstance(rows, list) and rows_fit(rows, self.clients)):
                return identity, cache, cached
            log.warning(
                "%s: its rows are not one per client of this run (edited?); computing them again",
                cache,
            )
        return identity, cache, None

    def is_cached(self, method: str, lr: float) -> bool:
        """Whether `rows` reads these rows back: no time of this call goes into them."""
        return self._cached(method, lr)[2] is not None

    def rows(
        self, method: str, lr: float, *, diverged_ok: bool = False
    ) -> list[dict[str, Any]] | None:
        """Per-client rows of `method` at learning rate `lr`, from the cache when it is there.
        With `diverged_ok` (a learning-rate grid), a run whose loss diverges is recorded and
        gives None instead of stopping the table: that learning rate cannot be chosen."""
        identity, cache, cached = self._cached(method, lr)
        if cached is not None:
            if cached["rows"] is None and not diverged_ok:
                raise TrainingDiverged(str(cached.get("diverged")))
            return cached["rows"]
        try:
            return self._rows(method, lr, identity, cache)
        except TrainingDiverged as err:
            if not diverged_ok:
                raise
            log.warning("%s at lr=%g diverged: %s", method, lr, err)
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(
                cache, {"hyper": to_json_types(identity), "diverged": str(err), "rows": None}
            )
            return None

    def _rows(
        self, method: str, lr: float, identity: Mapping[str, Any], cache: Path
    ) -> list[dict[str, Any]]:
        start = time.perf_counter()
        hyper = self.hyper.get(method, {})
        knn_record = linear_record = None
        if method == "knnper":
            hyper, knn_record = self._knn_choice(lr)
        elif method == "linear":
            hyper, linear_record = self._linear_choice(lr)
        training = replace(self.config.training, lr=lr)
        algorithm = build_algorithm(method, self.model_fn, training, **hyper)
        if getattr(algorithm, "federated", True):
            sim = self.train(trainer_of(method), training)
            weights, states = sim.weights, sim.states
        else:
            weights, states = {}, {}
        # each finished client is kept until the method's rows are: an interrupted table
        # resumes at the next client (a local model or a new client's training each)
        journal = ClientRows(cache.with_suffix(".partial.jsonl"), to_json_types(identity))
        rows = client_accuracies(
            algorithm,
            weights,
            states,
            self.clients,
            seed=self.config.seed,
            progress=self.progress,
            validation=True,
            journal=journal,
        )
        if knn_record is not None:
            # the test-oracle lambda, for the report only: the honest lambda must be the same
            # one the algorithm chose
            for row, oracle in zip(rows, knn_record.pop("oracle_rows"), strict=True):
                if row["info"]["lambda"] != oracle["info"]["lambda"]:
                    raise RuntimeError(
                        f"client {row['client_id']}: lambda differs between "
                        "the algorithm and the tuning report"
                    )
                for key in ("oracle_lambda", "oracle_accuracy", "cross_oracle_accuracy"):
                    if key in oracle["info"]:
                        row["info"][key] = oracle["info"][key]
        seconds = round(time.perf_counter() - start, 1)
        log.info("%s at lr=%g: %.1f s", method, lr, seconds)
        cache.parent.mkdir(parents=True, exist_ok=True)
        payload = {"hyper": to_json_types(identity), "seconds": seconds, "rows": rows}
        if knn_record is not None:
            payload["knn"] = to_json_types(knn_record)
        if linear_record is not None:
            payload["linear"] = to_json_types(linear_record)
        write_json_atomic(cache, payload)
        journal.remove()
        return rows

    def knn_record(self, lr: float) -> dict[str, Any] | None:
        """How kNN-Per's hyper-parameters were chosen at `lr` (written by `rows`)."""
        return self._choice_record("knnper", "knn", lr)

    def linear_record(self, lr: float) -> dict[str, Any] | None:
        """How the linear head's l2 was chosen at `lr` (written by `rows`)."""
        return self._choice_record("linear", "linear", lr)

    def _choice_record(self, method: str, key: str, lr: float) -> dict[str, Any] | None:
        cached = read_json_cache(self.out / "eval" / method / f"{_lr_dir(lr)}.json")
        return None if cached is None else cached.get(key)


Job = tuple[Callable[..., None], tuple, float]  # function, arguments, its cost (for estimates)


def _in_processes(
    workers: int, calls: Sequence[Job], *, desc: str, progress: bool, done: int = 0
) -> None:
    """Run the calls in up to `workers` worker processes; a worker's error stops the table with
    that error, and so does Ctrl-C, at once. Results land in OUT's caches. `done`: jobs found
    finished before this call (counted, never timed)."""
    if not calls:
        return
    with (
        worker_pool(max(1, min(workers, len(calls)))) as pool,
        Progress(
            done + len(calls),
            desc=desc,
            unit="job",
            enabled=progress,
            initial=done,
            total_work=sum(cost for _, _, cost in calls),
        ) as bar,
    ):
        futures = {pool.submit(fn, *args): cost for fn, args, cost in calls}
        for future in as_completed(futures):
            future.result()
            bar.update(futures[future])


def _table_job(
    config: RunConfig,
    out: str,
    options: TableOptions,
    methods: list[str],
    lr: float,
    diverged_ok: bool,
) -> None:
    """One worker's share of a table: the methods that share one training run at one rate."""
    torch.set_num_threads(1)
    runner = TableRunner(config, Path(out), replace(options, progress=False))
    for method in methods:
        runner.rows(method, lr, diverged_ok=diverged_ok)


def _attribution_job(
    config: RunConfig, out: str, options: TableOptions, body: str, lr: float, estimator: str
) -> None:
    torch.set_num_threads(1)
    runner = TableRunner(config, Path(out), replace(options, progress=False, knn=KNNRequest()))
    body_rows(runner, body, lr, lambda_estimator=estimator)


def _table_jobs(
    runner: TableRunner, names: Sequence[str], lrs: Sequence[float], options: TableOptions
) -> tuple[list[Job], int]:
    """One job per (training run, learning rate), the costliest first, less the jobs whose
    rows are all cached already; and how many those were."""
    groups: dict[str, list[str]] = {}
    for m in names:
        groups.setdefault(trainer_of(m), []).append(m)
    jobs = sorted(
        ((trainer, methods, lr) for trainer, methods in groups.items() for lr in lrs),
        key=lambda j: -ALGORITHMS[j[0]].job_cost,
    )
    todo = [
        (
            _table_job,
            (runner.config, str(runner.out), options, methods, lr, len(lrs) > 1),
            ALGORITHMS[trainer].job_cost,
        )
        for trainer, methods, lr in jobs
        if not all(runner.is_cached(m, lr) for m in methods)
    ]
    return todo, len(jobs) - len(todo)


def run_table(
    config: RunConfig,
    methods: str | Sequence[str],
    out: str | Path,
    options: TableOptions = TableOptions(),
    *,
    command: str | None = None,
) -> dict[str, Any]:
    """Run every method, write the tables and per-client files into `out`, return the results
    (evaluation's JSON plus the learning rates, validation scores and kNN-Per's choices).

    Parameters
    ----------
    config : the data set, partition, model and training settings every method shares.
    methods : names (`METHODS`) or "all".
    out : the table's folder: table.md, table1.csv, table2.csv, clients.csv, results.json, and
        the training runs and evaluation caches an interrupted table resumes from.
    options : how the table runs (`TableOptions`): learning rates, hyper-parameters, workers,
        attribution, device.
    command : the command line, recorded in table.md.
    """
    names = parse_methods(methods)
    lrs = check_lr_grid(options.lr_grid if options.tune_lr else [config.training.lr])
    runner = TableRunner(config, Path(out), options)
    _train_in_workers(runner, names, lrs, options)
    by_run = _rows_by_run(runner, names, lrs, options.progress)
    per_method: dict[str, list[dict[str, Any]]] = {}
    chosen: dict[str, float] = {}
    scores: dict[str, dict[str, float | None]] = {}
    for method in names:
        by_lr = {lr: by_run[method, lr] for lr in lrs}
        if all(rows is None for rows in by_lr.values()):
            raise BenchError(f"{method}: training diverged at every learning rate of the grid")
        val = {lr: None if rows is None else validation_score(rows) for lr, rows in by_lr.items()}
        chosen[method] = choose_lr(val) if options.tune_lr else lrs[0]
        scores[method] = {f"{lr:g}": s for lr, s in val.items()}
        per_method[method] = by_lr[chosen[method]]
    result = merge_results(per_method)
    result.update(
        methods=names,
        lr=chosen,
        validation=scores,
        tuned=options.tune_lr,
        config={**config.to_dict(), "model_name": runner.model_name},
    )
    if command is not None:
        result["command"] = command
    if "knnper" in names:
        result["knn"] = _knn_summary(runner, chosen["knnper"], per_method["knnper"])
    if "linear" in names:
        result["linear"] = runner.linear_record(chosen["linear"])
    if options.attribution:
        body_lrs = {b: chosen.get(b, lrs[0]) for b in BODIES}
        result["attribution"] = _attribution(runner, body_lrs, options)
    write_outputs(result, Path(out))
    return result


def _train_in_workers(
    runner: TableRunner, names: list[str], lrs: list[float], options: TableOptions
) -> None:
    """Log the table's estimated time, then (with `workers` > 1) train every training run not
    cached yet in worker processes, so that the rows are read from their caches."""
    jobs, done = _table_jobs(runner, names, lrs, options)
    if jobs:  # said before the first job starts: a table at its documented scale takes hours
        costs = [cost for _, _, cost in jobs]
        estimate = estimate_table(
            costs, runner.clients, runner.config.training, runner.model_fn, options.workers
        )
        log.info(estimate.line())
    if options.workers > 1:
        _in_processes(
            options.workers,
            jobs,
            desc="bench table: training runs",
            progress=options.progress,
            done=done,
        )


def _rows_by_run(
    runner: TableRunner, names: list[str], lrs: list[float], progress: bool
) -> dict[tuple[str, float], list[dict[str, Any]] | None]:
    """Every method's per-client rows at every learning rate (None: training diverged)."""
    runs = [(method, lr) for method in names for lr in lrs]
    by_run: dict[tuple[str, float], list[dict[str, Any]] | None] = {}
    with Progress(len(runs), desc="bench table", unit="method run", enabled=progress) as bar:
        for run in runs:
            measured = not runner.is_cached(*run)  # a cached run's time says nothing of the rest
            by_run[run] = runner.rows(*run, diverged_ok=len(lrs) > 1)
            bar.update(measured=measured)
    return by_run


def _knn_summary(runner: TableRunner, lr: float, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """kNN-Per's choice record at its chosen rate, with the test-chosen (oracle) lambda's and
    the split-half cross-oracle's accuracies beside it."""
    oracle_rows = [{**r, "accuracy": r["info"].get("oracle_accuracy")} for r in rows]
    cross_rows = [{**r, "accuracy": r["info"].get("cross_oracle_accuracy")} for r in rows]
    return {
        **(runner.knn_record(lr) or {}),
        "oracle": summarize(oracle_rows),
        "cross_oracle": summarize(cross_rows),
    }


def _attribution(
    runner: TableRunner, body_lrs: dict[str, float], options: TableOptions
) -> dict[str, Any]:
    """Every head on every body at that body's chosen rate (the bodies' evaluations in worker
    processes first where `workers` > 1)."""
    estimator = options.knn.estimator()  # "auto": each body gets its own cross-validated choice
    if options.workers > 1:
        _in_processes(
            options.workers,
            [
                (
                    _attribution_job,
                    (runner.config, str(runner.out), options, body, lr, estimator),
                    1.0,
                )
                for body, lr in body_lrs.items()
            ],
            desc="bench table: attribution",
            progress=options.progress,
        )
    return attribution_table(
        runner, body_lrs, lambda_estimator=estimator, progress=options.progress
    )


def run_seeds(
    config: RunConfig,
    seeds: int,
    out: str | Path,
    methods: str | Sequence[str],
    options: TableOptions = TableOptions(),
    *,
    command: str | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The same table for seeds config.seed, config.seed + 1, ...: each in OUT/seed_S with its
    own partition and training, then seeds.md / seeds.csv / seeds.json across them.

    Parameters
    ----------
    config : as for `run_table`; its seed is the first.
    seeds : how many seeds.
    out : the folder holding seed_S/ per seed and the summary.
    methods, options : as for `run_table`, the same for every seed.
    command : the command line, recorded in seeds.md.

    Returns
    -------
    Each seed's results and the summary across seeds (means ± std, kNN-Per minus each baseline
    with its interval, the clients hurt).
    """
    if seeds < 1:
        raise BenchError(f"seeds must be >= 1, got {seeds}")
    numbers = [config.seed + i for i in range(seeds)]
    results = [
        run_table(
            replace(config, seed=s), methods, seed_dir(Path(out), s), options, command=command
        )
        for s in numbers
    ]
    summary = summarize_seeds(results, numbers)
    write_seeds(summary, Path(out), titles(), command)
    return results, summary


def _summary_rows(result: dict[str, Any], group: str) -> list[dict[str, Any]]:
    rows = []
    for m in result["methods"]:
        s = result[group].get(m)
        rows.append(
            {
                "method": m,
                "mean": None if s is None else round(s["mean"], 6),
                "bottom_decile": None if s is None else round(s["bottom_decile"], 6),
                "clients": 0 if s is None else s["clients"],
                "lr": result["lr"][m],
                "val_accuracy": result["validation"][m].get(f"{result['lr'][m]:g}"),
            }
        )
    return rows


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    write_text_atomic(path, csv_text(rows, list(dict.fromkeys(k for r in rows for k in r))))


def _knn_lines(result: dict[str, Any]) -> list[str]:
    """kNN-Per's chosen hyper-parameters, the lambda estimators' validation scores, and the
    honest lambda against the test oracle's (reported, never used)."""
    knn = result.get("knn")
    if not knn or "config" not in knn:
        return []
    c, report = knn["config"], knn.get("lambda_report", {})
    cv = (
        (
            "; 2-fold cross-validation inside the validation splits: "
            + ", ".join(f"`{e}` {100 * v:.1f}%" for e, v in knn["lambda_cv"].items())
        )
        if knn["lambda_cv"]
        else ""
    )
    if "source" in knn:
        source = knn["source"]
        lines = [
            "## kNN-Per's choices",
            "",
            f"- k = {c['k']} ({source['k']}), sigma = {c['sigma']:.3g} ({source['sigma']}), "
            f"embeddings {c['normalize']} ({source['normalize']}); lr "
            f"{result['lr']['knnper']:g}.",
            f"- lambda per client by `{knn['estimator']}` ({source['lambda_estimator']}){cv}.",
        ]
        if "lambda_rule" in knn:
            rule_cv = (
                "; 2-fold cross-validation: "
                + ", ".join(f"`{r}` {100 * v:.1f}%" for r, v in knn["lambda_rule_cv"].items())
                if knn.get("lambda_rule_cv")
                else ""
            )
            lines.append(
                f"- lambda rule `{knn['lambda_rule']['name']}` "
                f"({source.get('lambda_rule', 'paper default')}){rule_cv}."
            )
        if "base" in knn:
            base = knn["base"]
            what = (
                f"each client's linear head (l2 = {base['l2']:g})"
                if base["name"] == "linear"
                else "the global model"
            )
            lines.append(
                f"- the kNN interpolated with {what} ({source.get('base', 'paper default')})."
            )
    else:  # results written before choices recorded their sources (BENCHMARKS.md's tables)
        how = "chosen on pooled validation" if knn.get("tuned") else "fixed"
        lines = [
            "## kNN-Per's choices",
            "",
            f"- k = {c['k']}, sigma = {c['sigma']:.3g}, embeddings {c['normalize']} ({how}; "
            f"lr {result['lr']['knnper']:g}).",
            f"- lambda per client by `{knn['estimator']}`{cv}.",
        ]
    if report.get("clients"):
        lines.append(
            f"- The honest lambda differs from the test-oracle lambda for "
            f"{report['differs']} of {report['clients']} clients; the oracle would add "
            f"{report['cost_pp']:.2f} pp to the mean ({100 * report['honest_mean']:.1f}"
            f" -> {100 * report['oracle_mean']:.1f}, all clients). The oracle rows in "
            "the tables are for scale only: the official code picks lambda on test, "
            "this table never does."
        )
        if "cross_oracle_mean" in report:
            lines.append(
                f"- The test oracle is optimistic by construction (each choice is "
                f"scored on the samples that made it). The split-half cross-oracle "
                f"(lambda chosen on one half of each test split, scored on the other, "
                f"mean of 20 halvings) gives {100 * report['cross_oracle_mean']:.1f}: "
                f"what choosing on test is worth without that optimism."
            )
    lines.append("")
    return lines


def _linear_lines(result: dict[str, Any]) -> list[str]:
    """The linear head's l2 and what it was chosen on."""
    record = result.get("linear")
    if not record:
        return []
    on = record["chosen_on"]
    scores = ", ".join(f"{g['l2']:.3g}: {100 * g['val_accuracy']:.1f}%" for g in record["grid"])
    return [
        "## FedAvg + linear head's choice",
        "",
        f"- l2 = {record['config']['l2']:.3g}, chosen on the pooled validation splits of "
        f"{len(on['clients'])} seen clients ({on['samples']} samples); lr "
        f"{result['lr']['linear']:g}. Validation accuracy per l2: {scores}.",
        "",
    ]


def format_markdown(result: dict[str, Any]) -> str:
    """Table 1 and Table 2 in markdown: accuracy in %, mean / bottom decile per method."""
    c = result["config"]
    t = c["training"]
    lr_note = "tuned per method on validation" if result["tuned"] else "fixed"
    init = f"; every method starts from `{c['init']}`" if c.get("init") else ""
    lines = [
        f"# {c['dataset']}, {c['partition']} partition",
        "",
        f"{c['clients']} clients ({c['unseen_fraction']:.0%} unseen), model "
        f"{c['model_name']}, {t['rounds']} rounds x {t['epochs']} local epoch(s), batch "
        f"{t['batch_size']}, participation {t['participation']:g}; learning rate "
        f"{lr_note}{init}. Accuracy in %: mean weighted by test size / bottom decile.",
        "",
    ]
    if result.get("command"):
        lines += ["Command:", "", "```bash", result["command"], "```", ""]
    knn = result.get("knn", {})
    for group, title in (
        ("seen", "Table 1: clients seen in training"),
        ("unseen", "Table 2: unseen clients"),
    ):
        lines += [f"## {title}", "", "| method | mean | bottom 10% | lr |", "|---|---|---|---|"]
        for row in _summary_rows(result, group):
            cells = [
                "-" if row[k] is None else f"{100 * row[k]:.1f}" for k in ("mean", "bottom_decile")
            ]
            lines.append(
                f"| {ALGORITHMS[row['method']].title} | {cells[0]} | {cells[1]} | {row['lr']:.3g} |"
            )
        for key, name in (
            ("oracle", "test-oracle lambda"),
            ("cross_oracle", "split-half cross-oracle lambda on test"),
        ):
            if (knn.get(key) or {}).get(group):
                o = knn[key][group]
                lines.append(
                    f"| (kNN-Per, {name}: not a method) | "
                    f"{100 * o['mean']:.1f} | {100 * o['bottom_decile']:.1f} | "
                    f"{result['lr']['knnper']:.3g} |"
                )
        lines.append("")
    hurt = clients_hurt([result["clients"]], result["methods"])
    for group, title in (("seen", "seen clients"), ("unseen", "unseen clients")):
        rows = format_hurt(hurt, group, titles())
        if rows:
            lines += [
                f"## Clients hurt, {title}",
                "",
                "The share of clients whose accuracy is below FedAvg's (the global model) "
                "or, for kNN-Per, below FedAvg+'s (FedAvg fine-tuned), % [bootstrap 95% "
                "interval over clients].",
                "",
                *rows,
            ]
    lines += _knn_lines(result) + _linear_lines(result)
    if "attribution" in result:
        lines.append(format_attribution(result["attribution"]))
    return "\n".join(lines)


def write_outputs(result: dict[str, Any], out: Path) -> None:
    _write_csv(out / "table1.csv", _summary_rows(result, "seen"))
    _write_csv(out / "table2.csv", _summary_rows(result, "unseen"))
    _write_csv(out / "clients.csv", result["clients"])
    if "attribution" in result:
        _write_csv(out / "attribution.csv", result["attribution"]["clients"])
    write_text_atomic(out / "table.md", format_markdown(result))
    write_text_atomic(out / "results.json", json.dumps(to_json_types(result), indent=2))
