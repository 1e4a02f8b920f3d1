"""The ProtoNN grid (`knnper experiment protonn-grid`) and, around it, what a memory budget costs
in kNN-Per accuracy: the exporter's choices on a finished run.

    python benchmarks/protonn_grid.py RUN --out OUT
    python benchmarks/protonn_grid.py --smoke --out OUT    # trains a tiny digits run first

Three measurements, all on the clients' test splits (choices are made on validation splits only):
1. Encoder: int8 (static QDQ) versus fp32 ONNX encoder: file sizes, and kNN-Per mean accuracy
   with the full float32 flat datastore (every train sample, lambda chosen on validation).
2. Budget curve: each client's datastore budget is a fraction (1/32 .. 1) of the bytes of its
   own full float32 flat datastore, on top of the int8 encoder. Per backend (flat, hnsw,
   protonn: the best of that backend's configurations on validation) and `auto` (the exporter's
   choice over all of them), the mean test accuracy of kNN-Per through the chosen datastore.
   At --check-fraction the `auto` bundles are also written with `export_run` and evaluated
   through the device runtime (Runtime.load + predict on raw images); the two must agree.
3. The paper's ProtoNN grid: projection dimension x prototype fraction, trained per client on
   its int8-encoder embeddings; accuracy and bytes relative to the full float32 datastore.

Accuracies are means over clients weighted by test size (the evaluation's convention). Clients
whose budget holds no configuration of a backend are left out of that point, and counted.

Outputs in OUT: encoder.csv, budget_curve.csv, protonn_grid.csv, clients.csv (per client and
point), budget_curve.png, protonn_grid.png, results.md (tables, command line, machine),
run.json; the exported check bundles in OUT/bundles.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime._io import write_text_atomic
from edge_runtime.budget import Budget
from edge_runtime.datastores import FlatDatastore
from edge_runtime.encoder import Encoder
from edge_runtime.personal_head import PersonalHead
from experiments import benchmark_support as C
from experiments.report import finish_axes, fit_y, pyplot
from export.errors import BudgetInvalid
from export.evaluation import evaluate_export, reference_accuracy, weighted_mean
from export.exporter import (
    ExportSettings,
    build_encoder,
    client_embeddings,
    export_run,
    select_clients,
)
from export.sizing import BACKENDS, DatastoreSizer, SearchSpace, measure_nbytes, selection_key
from fed_train.knn_setting import KNNChoice, KNNConfig
from protonn.training import ProtoNNClassifier

log = logging.getLogger("benchmarks.export")

FRACTIONS = ("1/32", "1/16", "1/8", "1/4", "1/2", "1")
GRID_DIMS = (8, 16, 32, 64)
GRID_FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.5)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("run", nargs="?", help="run directory from `knnper train`")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="train a tiny digits run into OUT/run and use small grids",
    )
    p.add_argument("--clients", default="all", help="all, seen, unseen or ids (0,3,7)")
    p.add_argument(
        "--fractions",
        default=",".join(FRACTIONS),
        help="datastore budgets as fractions of the full float32 flat datastore",
    )
    p.add_argument(
        "--check-fraction",
        default="1/4",
        help="fraction at which auto bundles are written and run through Runtime "
        "('none' skips the check)",
    )
    p.add_argument("--protonn-steps", type=C.positive_int, default=SearchSpace.protonn_steps)
    p.add_argument("--grid-dims", default=",".join(map(str, GRID_DIMS)))
    p.add_argument("--grid-fractions", default=",".join(map(str, GRID_FRACTIONS)))
    p.add_argument(
        "--grid-clients",
        type=C.positive_int,
        default=None,
        help="ProtoNN grid on a seeded subset of this many clients (default: all)",
    )
    p.add_argument("--k", type=C.positive_int, default=10)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--threads", type=C.positive_int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.run is None and not args.smoke:
        p.error("give a RUN directory, or --smoke")
    return args


def _fraction(text: str) -> float:
    return float(Fraction(text.strip()))


def train_smoke_run(out: Path) -> Path:
    from fed_train.algorithms.base import TrainingConfig
    from fed_train.run import RunConfig, train

    path = out / "run"
    config = RunConfig(
        dataset="digits",
        clients=8,
        seed=0,
        training=TrainingConfig(rounds=5, epochs=1, batch_size=16, lr=0.05, momentum=0.9),
    )
    train(config, path, progress=False)
    return path


# ----------------------------------------------------------------------------- measurements


class ClientCase:
    """One client's splits through the int8 encoder (train, validation, test) and the bytes of
    its full float32 flat datastore."""

    def __init__(
        self, encoder: Encoder, client: Any, num_classes: int, k: int, sigma: float
    ) -> None:
        self.client = client
        self.data = client_embeddings(encoder, client, test=True)
        self.head = PersonalHead(num_classes, k=k, sigma=sigma)
        self.full = FlatDatastore(num_classes, k=k, sigma=sigma).fit(
            self.data.z_train, self.data.y_train
        )
        self.full_bytes = measure_nbytes(self.full)

    def test_accuracy(self, datastore: Any, lam: float) -> float:
        return self._accuracy(datastore, lam, "test")

    def val_accuracy(self, datastore: Any, lam: float) -> float:
        return self._accuracy(datastore, lam, "val")

    def _accuracy(self, datastore: Any, lam: float, split: str) -> float:
        head = PersonalHead.fitted(self.head.num_classes, datastore, lam)
        acc = head.accuracy(
            getattr(self.data, f"z_{split}"),
            getattr(self.data, f"p_{split}"),
            getattr(self.data, f"y_{split}"),
        )
        return float("nan") if acc is None else acc

    def lambda_on_validation(self, datastore: Any) -> float:
        return self.head.fit(self.data, datastore=datastore).lambda_


def budget_curve(
    cases: list[ClientCase],
    fractions: list[str],
    space: SearchSpace,
    num_classes: int,
    k: int,
    sigma: float,
    seed: int,
) -> tuple[list[dict], list[dict]]:
    """Per fraction and backend: mean test accuracy of the best-on-validation choice."""
    sizer = DatastoreSizer(
        num_classes, knn=KNNChoice(KNNConfig(k, sigma)), space=space, seed=seed, reuse_protonn=True
    )
    client_rows: list[dict] = []
    for text in fractions:
        started = time.perf_counter()
        for case in cases:
            client_rows += _client_choices(sizer, case, text)
        log.info(
            "budget %s of the full datastore: %d clients in %.1f s",
            text,
            len(cases),
            time.perf_counter() - started,
        )
    curve = [
        _curve_point(client_rows, text, backend)
        for text in fractions
        for backend in (*BACKENDS, "auto")
    ]
    return curve, client_rows


def _client_choices(sizer: DatastoreSizer, case: ClientCase, text: str) -> list[dict]:
    """One client's rows at budget fraction `text`: per backend and `auto`, the configuration
    the sizer chooses on validation and its test accuracy, or `fits` False where none fits."""
    room = int(math.floor(_fraction(text) * case.full_bytes))
    base = {
        "fraction": text,
        "client_id": case.client.client_id,
        "unseen": case.client.unseen,
        "test_samples": int(len(case.data.y_test)),
        "room_bytes": room,
        "full_bytes": case.full_bytes,
    }
    picks = {}
    try:
        sizer.fit(case.data, Budget(room, encoder=0))
    except BudgetInvalid:
        pass
    else:
        picks["auto"] = (sizer.best_, sizer.datastore_)
        for backend in BACKENDS:
            mine = [cd for cd in sizer.fitted_ if cd[0].backend == backend]
            if mine:
                picks[backend] = min(mine, key=lambda cd: selection_key(cd[0]))
    rows = []
    for backend in (*BACKENDS, "auto"):
        if backend not in picks:
            rows.append({**base, "backend": backend, "fits": False})
            continue
        cand, ds = picks[backend]
        rows.append(
            {
                **base,
                "backend": backend,
                "fits": True,
                "recipe": cand.recipe,
                "bytes": cand.nbytes,
                "lambda": cand.lam,
                "val_accuracy": cand.val_accuracy,
                "test_accuracy": case.test_accuracy(ds, cand.lam),
            }
        )
    return rows


def _curve_point(client_rows: list[dict], text: str, backend: str) -> dict:
    """One point of the curve: `backend`'s mean over the clients it fits at fraction `text`."""
    rows = [r for r in client_rows if r["fraction"] == text and r["backend"] == backend]
    fit = [r for r in rows if r["fits"]]
    return {
        "fraction": text,
        "fraction_value": _fraction(text),
        "backend": backend,
        "clients": len(rows),
        "clients_fitting": len(fit),
        "mean_accuracy": weighted_mean(fit) if fit else None,
        "bytes_ratio": (
            float(np.mean([r["bytes"] / r["full_bytes"] for r in fit])) if fit else None
        ),
        "recipes": C.recipe_counts(fit, top=3),
    }


def protonn_grid(
    cases: list[ClientCase],
    dims: list[int],
    fractions: list[float],
    num_classes: int,
    steps: int,
    k: int,
    sigma: float,
    seed: int,
) -> list[dict]:
    """Every (d, m) point: test accuracy, validation accuracy (the only one a choice among
    points may use) and bytes, as means and per client."""
    rows = []
    for d in dims:
        for m in fractions:
            started = time.perf_counter()
            per_client = []
            for case in cases:
                clf = ProtoNNClassifier(
                    num_classes, projection_dim=d, prototype_fraction=m, steps=steps, seed=seed
                )
                clf.fit(case.data.z_train, case.data.y_train)
                ds = clf.to_datastore(k=k, sigma=sigma, m=m)
                lam = case.lambda_on_validation(ds)
                per_client.append(
                    {
                        "client_id": case.client.client_id,
                        "test_accuracy": case.test_accuracy(ds, lam),
                        "test_samples": int(len(case.data.y_test)),
                        "val_accuracy": case.val_accuracy(ds, lam),
                        "val_samples": int(len(case.data.y_val)),
                        "ratio": measure_nbytes(ds) / case.full_bytes,
                    }
                )
            val = [r for r in per_client if r["val_samples"]]
            rows.append(
                {
                    "projection_dim": d,
                    "prototype_fraction": m,
                    "mean_accuracy": weighted_mean(per_client),
                    "val_accuracy": float(
                        np.average(
                            [r["val_accuracy"] for r in val],
                            weights=[r["val_samples"] for r in val],
                        )
                    )
                    if val
                    else None,
                    "bytes_ratio": float(np.mean([r["ratio"] for r in per_client])),
                    "clients": per_client,
                    "seconds": time.perf_counter() - started,
                }
            )
            log.info("protonn d=%d m=%g: accuracy %.4f", d, m, rows[-1]["mean_accuracy"])
    return rows


# ----------------------------------------------------------------------------- plots


def plot_curve(curve: list[dict], reference: float, path: Path, scale: str) -> None:
    fig, ax = pyplot().subplots(figsize=(6.4, 4.2))
    shown = [reference]
    for backend, style in zip((*BACKENDS, "auto"), ("o-", "s-", "^-", "k*-"), strict=True):
        pts = [
            (r["fraction_value"], r["mean_accuracy"])
            for r in curve
            if r["backend"] == backend and r["mean_accuracy"] is not None
        ]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(
                xs,
                ys,
                style,
                label=backend if backend != "auto" else "auto (best of all)",
                alpha=0.9 if backend == "auto" else 0.7,
            )
            shown += ys
    ax.set_xscale("log", base=2)
    ax.set_title(f"Accuracy of the chosen datastores at each budget\n{scale}", fontsize=9)
    _finish(
        fig,
        ax,
        reference,
        "datastore budget / bytes of the full float32 flat datastore",
        path,
        shown,
    )


def plot_grid(
    grid: list[dict], reference: float, path: Path, *, scale: str, cost_pp: float = 1.0
) -> None:
    """Accuracy against bytes (the claim is about memory): the full datastore's accuracy, the
    claim's cost bound below it, and the 1/4-of-the-bytes line; the y axis fitted to them."""
    fig, ax = pyplot().subplots(figsize=(6.4, 4.2))
    shown = [reference, reference - cost_pp / 100]
    for d in sorted({r["projection_dim"] for r in grid}):
        pts = sorted(
            (r["bytes_ratio"], r["mean_accuracy"]) for r in grid if r["projection_dim"] == d
        )
        xs, ys = zip(*pts, strict=True)
        ax.plot(
            xs, ys, "o-", label=f"ProtoNN, projection d = {d} (prototypes m rising to the right)"
        )
        shown += ys
    ax.axhline(
        reference - cost_pp / 100,
        color="tab:red",
        ls=":",
        label=f"full datastore - {cost_pp:g} pp (the cost bound)",
    )
    ax.axvline(0.25, color="black", lw=0.8, ls="-.", label="1/4 of the bytes")
    ax.set_xscale("log", base=2)
    ax.set_xlim(right=1.2)  # the full datastore (1.0) stays in view
    ax.set_title(f"ProtoNN: accuracy at a fraction of the datastore's bytes\n{scale}", fontsize=9)
    _finish(
        fig,
        ax,
        reference,
        "bytes / bytes of the full float32 flat datastore (log scale)",
        path,
        shown,
    )


def _finish(fig, ax, reference: float, xlabel: str, path: Path, shown: Sequence[float]) -> None:
    """What both plots share: the full-datastore reference line, labels, a y axis fitted to
    what is `shown`, the legend beside the axes (never over the data), and saving as PNG."""
    ax.axhline(reference, color="grey", ls="--", label="full float32 flat datastore")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("kNN-Per mean test accuracy (%)")
    fit_y(ax, list(shown))
    finish_axes(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    pyplot().close(fig)


# ----------------------------------------------------------------------------- main


@dataclass(frozen=True)
class Grids:
    """What is measured: the budget fractions, the ProtoNN grid's projection dimensions and
    prototype fractions, and the exporter's search space (small ones under --smoke)."""

    fractions: list[str]
    dims: list[int]
    prototype_fractions: list[float]
    space: SearchSpace

    @classmethod
    def of(cls, args: argparse.Namespace) -> Grids:
        if args.smoke:
            space = SearchSpace(
                count_fractions=(1.0, 0.25),
                hnsw_M=(8,),
                protonn_dims=(8, 16),
                protonn_fractions=(0.3,),
                protonn_steps=50,
            )
            return cls(["1/16", "1/4", "1"], [8, 16], [0.1, 0.3], space)
        return cls(
            [t.strip() for t in args.fractions.split(",") if t.strip()],
            [int(t) for t in args.grid_dims.split(",")],
            [float(t) for t in args.grid_fractions.split(",")],
            SearchSpace(protonn_steps=args.protonn_steps),
        )


@dataclass(frozen=True)
class EncoderReport:
    """Measurement 1: the int8 and fp32 encoders' rows (bytes, kNN-Per accuracy, agreement),
    the kNN-Per accuracy of each with the full datastore (`reference`), and the two headlines."""

    rows: list[dict]
    reference: dict[str, float]
    size_ratio: float
    cost_pp: float


@dataclass(frozen=True)
class Results:
    """Everything results.md reports, measured on `n_clients` clients (`n_grid` of them in the
    ProtoNN grid, whose full float32 flat datastore scores `grid_reference`)."""

    run_path: Path
    encoders: EncoderReport
    curve: list[dict]
    check: dict | None
    grid: list[dict]
    grid_reference: float
    n_clients: int
    n_grid: int


def measure_encoders(
    enc: Any, clients: list[Any], num_classes: int, k: int, sigma: float
) -> EncoderReport:
    """Measurement 1: int8 against fp32, kNN-Per with every client's full datastore."""
    ref = {
        name: weighted_mean(
            reference_accuracy(path, clients, num_classes=num_classes, k=k, sigma=sigma)
        )
        for name, path in (("int8", enc.path), ("fp32", enc.fp32_path))
    }
    rows = [
        {"encoder": "fp32", "bytes": enc.fp32_nbytes, "knnper_accuracy": ref["fp32"]},
        {
            "encoder": "int8",
            "bytes": enc.nbytes,
            "knnper_accuracy": ref["int8"],
            **{f"vs_fp32_{k}": v for k, v in enc.int8_vs_fp32.items()},
        },
    ]
    report = EncoderReport(
        rows, ref, enc.fp32_nbytes / enc.nbytes, 100 * (ref["fp32"] - ref["int8"])
    )
    log.info(
        "encoder int8 %d bytes, fp32 %d (x%.2f); kNN-Per %.4f vs %.4f",
        enc.nbytes,
        enc.fp32_nbytes,
        report.size_ratio,
        ref["int8"],
        ref["fp32"],
    )
    return report


def device_check(
    run: Any,
    folder: Path,
    enc: Any,
    cases: list[ClientCase],
    settings: ExportSettings,
    curve: list[dict],
    fraction: str,
) -> dict:
    """The `auto` bundles at budget `fraction`, written with `export_run` into `folder` and
    evaluated through the device runtime, beside the curve's own accuracy at that point."""
    f = _fraction(fraction)
    budgets = {c.client.client_id: enc.nbytes + int(math.floor(f * c.full_bytes)) for c in cases}
    try:
        # the curve sizes datastores as they are exported: the check's bundles must not
        # reserve room for on-device learning (a protonn buffer), which the curve leaves out
        export_run(
            run,
            C.fresh_dir(folder),
            budgets,
            replace(settings, update_strategy="fixed"),
            clients=",".join(str(cid) for cid in budgets),
            encoder=enc,
            progress=False,
        )
        device = weighted_mean(evaluate_export(run, folder))
    except BudgetInvalid as err:
        return {"fraction": fraction, "error": str(err)}
    inproc = next(
        r["mean_accuracy"] for r in curve if r["fraction"] == fraction and r["backend"] == "auto"
    )
    return {"fraction": fraction, "runtime_accuracy": device, "benchmark_accuracy": inproc}


def grid_subset(cases: list[ClientCase], most: int | None, seed: int) -> list[ClientCase]:
    """The clients the ProtoNN grid trains on: a seeded subset of `most` of them, or all."""
    if not most or most >= len(cases):
        return cases
    pick = np.random.default_rng(seed).choice(len(cases), most, replace=False)
    return [cases[i] for i in sorted(pick)]


def full_accuracy(cases: list[ClientCase]) -> float:
    """kNN-Per's mean test accuracy over `cases` with each one's full float32 flat datastore."""
    return weighted_mean(
        [
            {
                "test_accuracy": c.test_accuracy(c.full, c.lambda_on_validation(c.full)),
                "test_samples": len(c.data.y_test),
            }
            for c in cases
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out
    started, _ = C.start_benchmark(out, args.threads)
    from fed_train.run import load_run

    run_path = Path(args.run) if args.run else train_smoke_run(out)
    run = load_run(run_path)
    num_classes = run.dataset.num_classes
    grids = Grids.of(args)
    settings = ExportSettings(
        knn=KNNChoice(KNNConfig(args.k, args.sigma)), seed=args.seed, space=grids.space
    )
    every_client = run.clients()
    enc = build_encoder(run, C.fresh_dir(out / "encoders"), settings, every_client)
    clients = [c for c in select_clients(every_client, args.clients) if c.num_train > 0]
    encoders = measure_encoders(enc, clients, num_classes, args.k, args.sigma)

    session = Encoder(enc.path, intra_op_threads=1)
    cases = [ClientCase(session, c, num_classes, args.k, args.sigma) for c in clients]
    curve, client_rows = budget_curve(
        cases, grids.fractions, grids.space, num_classes, args.k, args.sigma, args.seed
    )
    check = None
    if args.check_fraction in grids.fractions:
        check = device_check(run, out / "bundles", enc, cases, settings, curve, args.check_fraction)

    grid_cases = grid_subset(cases, args.grid_clients, args.seed)
    grid = protonn_grid(
        grid_cases,
        grids.dims,
        grids.prototype_fractions,
        num_classes,
        grids.space.protonn_steps,
        args.k,
        args.sigma,
        args.seed,
    )
    results = Results(
        run_path,
        encoders,
        curve,
        check,
        grid,
        full_accuracy(grid_cases),
        len(cases),
        len(grid_cases),
    )
    write_outputs(out, results, client_rows, grids.space, started)
    return 0


ENCODER_COLUMNS = (
    "encoder bytes knnper_accuracy vs_fp32_embedding_cosine_min vs_fp32_embedding_cosine_mean "
    "vs_fp32_logits_max_abs_diff vs_fp32_argmax_agreement"
).split()
CURVE_COLUMNS = "fraction backend clients clients_fitting mean_accuracy bytes_ratio recipes".split()
CLIENT_COLUMNS = (
    "fraction backend client_id unseen fits recipe bytes room_bytes full_bytes lambda val_accuracy "
    "test_accuracy test_samples"
).split()
GRID_COLUMNS = (
    "projection_dim prototype_fraction mean_accuracy val_accuracy bytes_ratio seconds".split()
)


def write_outputs(
    out: Path, results: Results, client_rows: list[dict], space: SearchSpace, started: float
) -> None:
    """The CSV tables, both plots, results.md (also printed) and run.json, into `out`."""
    C.write_csv(out / "encoder.csv", results.encoders.rows, ENCODER_COLUMNS)
    C.write_csv(out / "budget_curve.csv", results.curve, CURVE_COLUMNS)
    C.write_csv(out / "clients.csv", client_rows, CLIENT_COLUMNS)
    C.write_csv(out / "protonn_grid.csv", results.grid, GRID_COLUMNS)
    scale = (
        f"run {Path(results.run_path).name}, {results.n_clients} clients "
        f"({results.n_grid} in the grid)"
    )
    reference = results.encoders.reference
    plot_curve(results.curve, reference["int8"], out / "budget_curve.png", scale)
    plot_grid(results.grid, results.grid_reference, out / "protonn_grid.png", scale=scale)
    info = C.machine_info()
    md = render_markdown(results, info, time.time() - started)
    write_text_atomic(out / "results.md", md + "\n")
    C.write_json(
        out / "run.json",
        {
            "command": C.command_line(),
            "machine": info,
            "run": str(results.run_path),
            "encoder": results.encoders.rows,
            "reference": reference,
            "check": results.check,
            "space": space.__dict__,
            "seconds": time.time() - started,
        },
    )
    print(md)


def _check_line(check: dict) -> str:
    """The device check's sentence: the runtime's accuracy beside the benchmark's, or why the
    bundles could not be written."""
    if "error" in check:
        return f"Device check at {check['fraction']}: {check['error']}"
    return (
        f"Device check at {check['fraction']}: auto bundles written with "
        f"export_run and run through Runtime: {check['runtime_accuracy']:.2%} "
        f"(benchmark: {check['benchmark_accuracy']:.2%})."
    )


def render_markdown(results: Results, info: dict, seconds: float) -> str:
    """results.md: the three measurements' tables, the device check, command and machine."""
    encoders = results.encoders
    encoder_rows, curve, grid = encoders.rows, results.curve, results.grid
    parts = [
        f"## Export: budgets and accuracy ({results.run_path})",
        "",
        f"Encoder (kNN-Per mean test accuracy with the full float32 flat datastore, "
        f"{results.n_clients} clients): int8 is {encoders.size_ratio:.2f}x smaller than fp32 "
        f"and costs {encoders.cost_pp:+.2f} pp.",
        "",
        C.markdown_table(
            encoder_rows,
            [
                ("encoder", "encoder", ""),
                ("bytes", "bytes", ""),
                ("knnper_accuracy", "kNN-Per acc", ".2%"),
                ("vs_fp32_embedding_cosine_min", "min cos to fp32", ".5f"),
                ("vs_fp32_argmax_agreement", "argmax agreement", ".2%"),
            ],
        ),
        "",
        "Accuracy versus datastore budget (fraction of each client's full float32 "
        f"flat datastore, on top of the int8 encoder); full datastore: "
        f"{encoders.reference['int8']:.2%}.",
        "",
        C.markdown_table(
            curve,
            [
                ("fraction", "budget", ""),
                ("backend", "backend", ""),
                ("clients_fitting", "clients fitting", ""),
                ("mean_accuracy", "mean acc", ".2%"),
                ("bytes_ratio", "bytes / full", ".3f"),
                ("recipes", "most chosen", ""),
            ],
        ),
    ]
    if results.check:
        parts += ["", _check_line(results.check)]
    parts += [
        "",
        f"ProtoNN grid ({results.n_grid} clients; full float32 flat datastore "
        f"{results.grid_reference:.2%}):",
        "",
        C.markdown_table(
            grid,
            [
                ("projection_dim", "d", ""),
                ("prototype_fraction", "m", ""),
                ("mean_accuracy", "mean acc", ".2%"),
                ("bytes_ratio", "bytes / full", ".3f"),
            ],
        ),
        "",
        f"Command: `{C.command_line()}`",
        "",
        f"Machine: {C.machine_line(info)}",
        "",
        f"Took {seconds:.0f} s.",
    ]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
