"""The paper's robustness-to-distribution-shift experiment on Fashion-MNIST, run on the device
side: each client's bundle keeps learning through Runtime.add() with the fifo, concatenate or
fixed update strategy while its label distribution shifts at time t0.

    python benchmarks/distribution_shift.py --run RUN --out OUT
    python benchmarks/distribution_shift.py --out OUT          # trains a FedAvg model first
    python benchmarks/distribution_shift.py --smoke --out OUT  # tiny settings: checks the pipeline

Per seed, --clients clients of the run's partition are drawn (any with at least 10 training
samples). For each client, at t = 0:
- its bundle is exported: the global model as an int8 ONNX encoder (one for all clients), a
  datastore (--recipe; flat by default) of the encoder's embeddings of the client's training
  split (ProtoNN: trained on them; it learns into a buffer beside its prototypes), and lambda chosen
  on the client's validation split as the exporter does (or --lam). The budget leaves room for
  the whole stream, so "concatenate" keeps every sample; "fifo" keeps the datastore at its size
  at export (the recipe's n if --capacity is given); "fixed" never changes it.
- three copies of the bundle are loaded with Runtime.load, one per update strategy.
Then for t = 0 .. T-1 a batch of --batch labelled test images arrives (test images: never seen
in training; drawn without replacement per client). Labels follow the client's training label
distribution before t0 and a shifted one from t0 on: a fresh Dirichlet(--alpha) draw
(--shift dirichlet), or uniform over the --new-classes classes the client had least of
(--shift classes). Each device first predicts the batch (accuracy recorded), then adds it with
its strategy. The global model alone (lambda = 0, the same int8 encoder) is the reference.
Accuracies are averaged over clients and seeds (equal batches, so this is the pooled accuracy).

Outputs in OUT: steps.csv (every client, seed, step and strategy), curve.csv (mean and standard
error per step), clients.csv (per client: sizes, lambda, label distributions), shift.png,
shift.md (summary table, command line, machine), run.json.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime.bundle import UPDATE_STRATEGIES
from edge_runtime.datastores import (
    BACKENDS,
    EXACT_RECIPE,
    format_recipe,
    make_datastore,
    parse_recipe,
)
from edge_runtime.encoder import Encoder
from edge_runtime.personal_head import ClientSplits, PersonalHead
from edge_runtime.preprocess import prepare_input
from edge_runtime.runtime import Runtime
from experiments import benchmark_support as C
from experiments.report import fit_y, pyplot

log = logging.getLogger("benchmarks.shift")

GLOBAL = "global (lambda=0)"
CURVES = (*UPDATE_STRATEGIES, GLOBAL)
MIN_TRAIN = 10


# the CSV files' columns, in order
STEP_COLUMNS = "seed client unseen step phase strategy accuracy batch datastore_size lam".split()
CURVE_COLUMNS = "step strategy mean_accuracy sem n mean_datastore_size".split()
CLIENT_COLUMNS = "seed client unseen train val stored lam pi_before pi_after".split()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = C.script_parser(__doc__, argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument(
        "--run",
        default=None,
        help="finished Fashion-MNIST run (default: train one into OUT/global_run)",
    )
    p.add_argument("--clients", type=C.positive_int, default=10, help="clients per seed")
    p.add_argument("--seeds", type=C.positive_int, default=3, help="seeds 0 .. S-1")
    p.add_argument("--steps", type=C.positive_int, default=30, help="time steps T")
    p.add_argument("--shift-at", type=int, default=10, help="t0: first step after the shift")
    p.add_argument("--batch", type=C.positive_int, default=20, help="samples arriving per step")
    p.add_argument("--shift", choices=("dirichlet", "classes"), default="dirichlet")
    p.add_argument(
        "--alpha",
        type=float,
        default=0.3,
        help="Dirichlet concentration of the shifted label distribution",
    )
    p.add_argument(
        "--new-classes",
        type=C.positive_int,
        default=3,
        help="--shift classes: how many of the client's rarest classes follow",
    )
    p.add_argument(
        "--recipe",
        default=EXACT_RECIPE,
        help="datastore recipe; a protonn one learns into a buffer of --capacity "
        "samples (default: the client's train size) beside its prototypes",
    )
    p.add_argument(
        "--protonn-steps",
        type=C.positive_int,
        default=50,
        help="ProtoNN training steps (protonn recipes)",
    )
    p.add_argument(
        "--capacity",
        type=C.positive_int,
        default=None,
        help="stored samples at export and fifo capacity (default: the whole training split)",
    )
    p.add_argument(
        "--lam",
        default="val",
        help="'val' (chosen on the client's validation split) or a number in [0, 1]",
    )
    p.add_argument("--encoder", choices=("int8", "fp32"), default="int8")
    p.add_argument("--threads", type=C.positive_int, default=1)
    p.add_argument(
        "--train-rounds",
        type=C.positive_int,
        default=10,
        help="without --run: FedAvg rounds of the global model",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny settings (2 clients, T=4) to check the pipeline end to end",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.clients, args.seeds, args.steps, args.shift_at, args.batch = 2, 1, 4, 2, 8
        args.train_rounds = 1
    if not 0 < args.shift_at < args.steps:
        p.error(f"--shift-at must be in 1 .. {args.steps - 1}, got {args.shift_at}")
    if args.lam != "val":
        try:
            lam = float(args.lam)
        except ValueError:
            p.error(f"--lam must be 'val' or a number in [0, 1], got {args.lam!r}")
        if not 0.0 <= lam <= 1.0:
            p.error(f"--lam must be in [0, 1], got {args.lam}")
    return args


def global_run(args: argparse.Namespace) -> Any:
    """The run to personalize: --run, or a FedAvg run trained (or resumed) in OUT/global_run."""
    from fed_train.run import RunConfig, load_run, train

    if args.run is not None:
        return load_run(args.run)
    from fed_train.algorithms.base import TrainingConfig

    config = RunConfig(
        dataset="fashion-mnist",
        partition="dirichlet",
        alpha=0.3,
        clients=20,
        max_train=10_000,
        training=TrainingConfig(
            rounds=args.train_rounds, epochs=1, batch_size=32, lr=0.05, momentum=0.9
        ),
    )
    if args.smoke:
        config = replace(config, clients=6, max_train=600)
    run_dir = args.out / "global_run"
    log.info(
        "no --run: training FedAvg (%d rounds, %d clients, %d images) into %s",
        config.training.rounds,
        config.clients,
        config.max_train,
        run_dir,
    )
    train(config, run_dir, progress=False)
    return load_run(run_dir)


def shifted_distribution(
    before: np.ndarray, args: argparse.Namespace, rng: np.random.Generator
) -> np.ndarray:
    num_classes = len(before)
    if args.shift == "dirichlet":
        return rng.dirichlet(np.full(num_classes, args.alpha))
    # the classes the client had least of (ties broken at random)
    order = np.lexsort((rng.random(num_classes), before))
    after = np.zeros(num_classes)
    after[order[: min(args.new_classes, num_classes)]] = 1.0
    return after / after.sum()


class TestPool:
    """Test images by class, drawn without replacement per client (with it once exhausted)."""

    def __init__(self, y_test: np.ndarray, num_classes: int, rng: np.random.Generator) -> None:
        self.rng = rng
        self.left = [list(rng.permutation(np.flatnonzero(y_test == c))) for c in range(num_classes)]
        self.all = [np.flatnonzero(y_test == c) for c in range(num_classes)]

    def draw(self, label: int) -> int:
        if self.left[label]:
            return int(self.left[label].pop())
        return int(self.rng.choice(self.all[label]))


def client_datastore(
    z: np.ndarray, y: np.ndarray, num_classes: int, seed: int, args: argparse.Namespace
) -> Any:
    """The client's datastore at export, of --recipe: ProtoNN trained on its embeddings with a
    buffer of --capacity new samples, or another backend holding them (--capacity at most)."""
    name, params = parse_recipe(args.recipe)
    if BACKENDS[name].TRAINED:
        datastore = C.build_datastore(
            args.recipe, z, y, num_classes, seed=seed, protonn_steps=args.protonn_steps
        )
        datastore.buffer = args.capacity or len(y)  # the fifo capacity of new samples
        return datastore
    if args.capacity is not None:
        params["n"] = args.capacity
    return make_datastore(format_recipe(name, params), num_classes, seed=seed).fit(z, y)


def client_lambda(
    run: Any, cid: int, encoder: Encoder, train: tuple, datastore: Any, args: argparse.Namespace
) -> float:
    """--lam, or lambda chosen on the client's validation split as the exporter does;
    `train`: its training split's embeddings, logits and labels."""
    if args.lam != "val":
        return float(args.lam)
    split, ds_ = run.partition.clients[cid], run.dataset
    val = None
    if len(split.val):
        x_val = prepare_input(ds_.x_train[split.val], ds_.input_spec)
        val = (*encoder.run(x_val), ds_.y_train[split.val])
    splits = ClientSplits.from_logits(cid, False, train, val)
    return PersonalHead(ds_.num_classes).fit(splits, datastore=datastore).lambda_


def strategy_devices(
    base: Path, encoder_path: Path, datastore: Any, spec: Any, lam: float, cid: int, args: Any
) -> dict[str, Runtime]:
    """The client's bundle, with room for the whole stream, loaded once per update strategy
    (a copy each, under `base`)."""
    dim, store = datastore.embedding_dim_, datastore.sample_store()
    budget = (
        encoder_path.stat().st_size
        + (1 << 12)
        + store.estimate_nbytes(len(store) + args.steps * args.batch, dim)
    )
    C.write_benchmark_bundle(
        base / "export",
        encoder_path,
        datastore,
        spec,
        lam=lam,
        client_id=cid,
        budget_bytes=int(budget),
    )
    runtimes = {}
    for strategy in UPDATE_STRATEGIES:
        shutil.copytree(base / "export", base / strategy)
        runtimes[strategy] = Runtime.load(base / strategy, intra_op_threads=args.threads)
    return runtimes


def run_client(
    run: Any,
    cid: int,
    seed: int,
    encoder_path: Path,
    encoder: Encoder,
    work: Path,
    args: argparse.Namespace,
) -> tuple[list[dict], dict]:
    """One client's stream at one seed: every step's accuracy per strategy (and the global
    model's), and the client's facts (sizes, lambda, label distributions)."""
    ds_ = run.dataset
    spec, num_classes = ds_.input_spec, ds_.num_classes
    split = run.partition.clients[cid]
    rng = np.random.default_rng([seed, cid])
    x_tr, y_tr = ds_.x_train[split.train], ds_.y_train[split.train].astype(np.int64)
    z_tr, logits_tr = encoder.run(prepare_input(x_tr, spec))
    datastore = client_datastore(z_tr, y_tr, num_classes, seed, args)
    lam = client_lambda(run, cid, encoder, (z_tr, logits_tr, y_tr), datastore, args)
    base = work / f"s{seed}-c{cid}"
    runtimes = strategy_devices(base, encoder_path, datastore, spec, lam, cid, args)
    before = np.bincount(y_tr, minlength=num_classes) / len(y_tr)
    after = shifted_distribution(before, args, rng)
    pool = TestPool(ds_.y_test, num_classes, rng)
    who = {"seed": seed, "client": cid, "unseen": bool(run.partition.unseen[cid])}
    rows = []
    for t in range(args.steps):
        pi = before if t < args.shift_at else after
        yb = rng.choice(num_classes, size=args.batch, p=pi).astype(np.int64)
        xb = ds_.x_test[[pool.draw(int(c)) for c in yb]]
        common = {
            **who,
            "step": t,
            "phase": "before" if t < args.shift_at else "after",
            "batch": args.batch,
            "lam": lam,
        }
        rows += step_rows(runtimes, xb, yb, common)
    shutil.rmtree(base, ignore_errors=True)
    info = {
        **who,
        "train": len(split.train),
        "val": len(split.val),
        "stored": len(datastore),
        "lam": lam,
        "pi_before": " ".join(f"{v:.3f}" for v in before),
        "pi_after": " ".join(f"{v:.3f}" for v in after),
    }
    return rows, info


def step_rows(
    runtimes: dict[str, Runtime], xb: np.ndarray, yb: np.ndarray, common: dict
) -> list[dict]:
    """One step: the global model's and every device's accuracy on the arriving batch, then
    each device adds the batch by its strategy."""
    _, p_global = runtimes["fixed"].components(xb)
    rows = [
        {
            **common,
            "strategy": GLOBAL,
            "accuracy": float(np.mean(p_global.argmax(1) == yb)),
            "datastore_size": 0,
        }
    ]
    rows += [
        {
            **common,
            "strategy": strategy,
            "accuracy": float(np.mean(rt.predict(xb) == yb)),
            "datastore_size": len(rt.datastore.sample_store()),
        }
        for strategy, rt in runtimes.items()
    ]
    for strategy, rt in runtimes.items():
        rt.add(xb, yb, strategy=strategy)
    return rows


def curve(rows: list[dict], steps: int) -> list[dict]:
    out = []
    for t in range(steps):
        for strategy in CURVES:
            mine = [r for r in rows if r["step"] == t and r["strategy"] == strategy]
            acc = np.array([r["accuracy"] for r in mine])
            sem = float(acc.std(ddof=1) / np.sqrt(len(acc))) if len(acc) > 1 else 0.0
            size = np.mean([r["datastore_size"] for r in mine])
            out.append(
                {
                    "step": t,
                    "strategy": strategy,
                    "mean_accuracy": float(acc.mean()),
                    "sem": sem,
                    "n": len(acc),
                    "mean_datastore_size": float(size),
                }
            )
    return out


def plot(
    points: list[dict], args: argparse.Namespace, path: Path, weights: str, dataset: str
) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {
        "fifo": ("tab:blue", "-"),
        "concatenate": ("tab:orange", "-"),
        "fixed": ("tab:green", "-"),
        GLOBAL: ("black", "--"),
    }
    shown, spread = [], []
    for strategy in CURVES:
        pts = [p for p in points if p["strategy"] == strategy]
        t = np.array([p["step"] for p in pts])
        m = np.array([p["mean_accuracy"] for p in pts])
        s = np.array([p["sem"] for p in pts])
        color, line = styles[strategy]
        ax.plot(t, m, line, color=color, label=strategy, marker="o", markersize=3)
        ax.fill_between(t, m - s, m + s, color=color, alpha=0.15, linewidth=0)
        shown += list(m)
        spread += list(s)
    ax.axvline(
        args.shift_at - 0.5, color="grey", linestyle=":", label=f"shift (t0={args.shift_at})"
    )
    from matplotlib.ticker import PercentFormatter

    ax.set_xlabel("time step (one batch of labelled samples arrives per step)")
    ax.set_ylabel("accuracy on the arriving batch (%; band: +-1 standard error)")
    fit_y(ax, shown, spread)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(
        "Claim: after a label shift a fixed datastore stays down, FIFO recovers fastest"
        f"\n{dataset}, {args.shift} shift: {args.clients} clients x {args.seeds} "
        f"seeds, batch {args.batch}",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    ax.grid(alpha=0.3)
    fig.text(0.01, 0.01, weights, fontsize=6, color="grey")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def summary(rows: list[dict], args: argparse.Namespace) -> list[dict]:
    after = args.steps - args.shift_at
    window = max(1, after // 3)
    spans = {
        "before shift": range(0, args.shift_at),
        f"first {window} after": range(args.shift_at, args.shift_at + window),
        f"last {window}": range(args.steps - window, args.steps),
        "all after": range(args.shift_at, args.steps),
    }
    out = []
    for strategy in CURVES:
        row: dict[str, Any] = {"strategy": strategy}
        for label, span in spans.items():
            acc = [r["accuracy"] for r in rows if r["strategy"] == strategy and r["step"] in span]
            row[label] = float(np.mean(acc))
        final = [
            r["datastore_size"]
            for r in rows
            if r["strategy"] == strategy and r["step"] == args.steps - 1
        ]
        row["final datastore size"] = float(np.mean(final))
        out.append(row)
    return out


def _after_shift(rows: list[dict], shift_at: int) -> str:
    after = [r for r in rows if r["step"] >= shift_at]
    return ", ".join(
        f"{s} {np.mean([r['accuracy'] for r in after if r['strategy'] == s]):.1%}" for s in CURVES
    )


def measure(run: Any, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Every drawn client's stream at every seed, through one encoder of the global model
    (calibrated on 256 training images): the step rows and the clients' facts."""
    eligible = [c for c, s in enumerate(run.partition.clients) if len(s.train) >= MIN_TRAIN]
    if not eligible:
        raise SystemExit(f"no client of the run has {MIN_TRAIN} training samples")
    rows: list[dict] = []
    infos: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="knnper-shift-", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        calib_rng = np.random.default_rng(0)
        calib_idx = calib_rng.choice(
            len(run.dataset.y_train), size=min(256, len(run.dataset.y_train)), replace=False
        )
        calib = prepare_input(run.dataset.x_train[np.sort(calib_idx)], run.dataset.input_spec)
        encoder_path = C.export_encoder(run.model, calib, work / "encoder", encoder=args.encoder)
        encoder = Encoder(encoder_path, intra_op_threads=args.threads)
        for seed in range(args.seeds):
            chosen = np.random.default_rng(seed).choice(
                eligible, size=min(args.clients, len(eligible)), replace=False
            )
            for cid in sorted(int(c) for c in chosen):
                client_rows, info = run_client(run, cid, seed, encoder_path, encoder, work, args)
                rows += client_rows
                infos.append(info)
                log.info(
                    "seed %d client %d (lambda %.1f): after the shift %s",
                    seed,
                    cid,
                    info["lam"],
                    _after_shift(client_rows, args.shift_at),
                )
    return rows, infos


def render_markdown(
    table: list[dict], args: argparse.Namespace, weights: str, clients: int, head: str
) -> str:
    """shift.md: the settings in words and the summary table (`head`: command and machine)."""
    columns = [("strategy", "strategy", "")] + [
        (k, k, ".1f" if k.endswith("size") else ".1%") for k in table[0] if k != "strategy"
    ]
    return "\n".join(
        [
            "# Robustness to distribution shift: on-device datastore updates",
            "",
            head,
            "",
            f"{weights}; {args.encoder} ONNX encoder; datastore {args.recipe}"
            f"{f' (capacity {args.capacity})' if args.capacity else ''}; lambda "
            f"{'chosen on each client validation split' if args.lam == 'val' else args.lam}. "
            f"{clients} client runs ({args.clients} clients x {args.seeds} seeds), T = "
            f"{args.steps} steps of {args.batch} test images, shift at t0 = {args.shift_at} "
            f"({args.shift}"
            f"{f', alpha {args.alpha}' if args.shift == 'dirichlet' else ''}). Mean accuracy on "
            "the arriving batch, predicted before it is added:",
            "",
            C.markdown_table(table, columns),
            "",
            "![accuracy vs time](shift.png)",
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started, machine = C.start_benchmark(args.out, args.threads)
    run = global_run(args)
    weights = f"global model: {'run ' + str(args.run) if args.run else 'FedAvg trained here'}"
    rows, infos = measure(run, args)
    points = curve(rows, args.steps)
    plot(points, args, args.out / "shift.png", weights, run.dataset.name)
    head = (
        f"Command: `{C.command_line()}`\n\n"
        f"Machine: {C.machine_line(machine)}. Took {time.time() - started:.0f} s."
    )
    text = render_markdown(summary(rows, args), args, weights, len(infos), head)
    C.write_results(
        args,
        started,
        text,
        report="shift.md",
        record="run.json",
        tables={
            "steps.csv": (rows, STEP_COLUMNS),
            "curve.csv": (points, CURVE_COLUMNS),
            "clients.csv": (infos, CLIENT_COLUMNS),
        },
        machine=machine,
        weights=weights,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
