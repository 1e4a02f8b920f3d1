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
from dataclasses import replace
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
from experiments.report import fit_y
from export.errors import BudgetInvalid
from export.evaluation import evaluate_export, reference_accuracy, weighted_mean
from export.exporter import (
    ExportSettings,
    build_encoder,
    client_embeddings,
    export_run,
    select_clients,
)
from export.sizing import (
    BACKENDS,
    DatastoreSizer,
    SearchSpace,
    measure_nbytes,
    selection_key,
)
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
        full = FlatDatastore(num_classes, k=k, sigma=sigma).fit(
            self.data.z_train, self.data.y_train
        )
        self.full_bytes = measure_nbytes(full)

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
        f = _fraction(text)
        started = time.perf_counter()
        for case in cases:
            room = int(math.floor(f * case.full_bytes))
            base = {
                "fraction": text,
                "client_id": case.client.client_id,
                "unseen": case.client.unseen,
                "test_samples": int(len(case.data.y_test)),
                "room_bytes": room,
                "full_bytes": case.full_bytes,
            }
            try:
                sizer.fit(case.data, Budget(room, encoder=0))
            except BudgetInvalid:
                for backend in (*BACKENDS, "auto"):
                    client_rows.append({**base, "backend": backend, "fits": False})
                continue
            picks = {"auto": (sizer.best_, sizer.datastore_)}
            for backend in BACKENDS:
                mine = [cd for cd in sizer.fitted_ if cd[0].backend == backend]
                if mine:
                    picks[backend] = min(mine, key=lambda cd: selection_key(cd[0]))
            for backend in (*BACKENDS, "auto"):
                if backend not in picks:
                    client_rows.append({**base, "backend": backend, "fits": False})
                    continue
                cand, ds = picks[backend]
                client_rows.append(
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
        log.info(
            "budget %s of the full datastore: %d clients in %.1f s",
            text,
            len(cases),
            time.perf_counter() - started,
        )
    curve = []
    for text in fractions:
        for backend in (*BACKENDS, "auto"):
            rows = [r for r in client_rows if r["fraction"] == text and r["backend"] == backend]
            fit = [r for r in rows if r["fits"]]
            curve.append(
                {
                    "fraction": text,
                    "fraction_value": _fraction(text),
                    "backend": backend,
                    "clients": len(rows),
                    "clients_fitting": len(fit),
                    "mean_accuracy": weighted_mean(fit) if fit else None,
                    "bytes_ratio": (
                        float(np.mean([r["bytes"] / r["full_bytes"] for r in fit])) if fit else None
                    ),
                    "recipes": _top_recipes(fit),
                }
            )
    return curve, client_rows


def _top_recipes(rows: list[dict], top: int = 3) -> str:
    """The most frequent chosen recipe shapes (counts dropped), e.g. "flat:int8 x12"."""
    counts: dict[str, int] = {}
    for r in rows:
        shape = ":".join(
            t for t in r["recipe"].split(":") if not t[:1] == "n" or not t[1:].isdigit()
        )
        counts[shape] = counts.get(shape, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return "; ".join(f"{name} x{n}" for name, n in ranked)


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
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
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    ax.axhline(reference, color="grey", ls="--", label="full float32 flat datastore")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("kNN-Per mean test accuracy (%)")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    fit_y(ax, list(shown))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    C.setup_logging()
    C.limit_threads(args.threads)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    from fed_train.run import load_run

    run_path = Path(args.run) if args.run else train_smoke_run(out)
    run = load_run(run_path)
    num_classes = run.dataset.num_classes
    fractions = [t.strip() for t in args.fractions.split(",") if t.strip()]
    dims = [int(t) for t in args.grid_dims.split(",")]
    grid_fractions = [float(t) for t in args.grid_fractions.split(",")]
    space = SearchSpace(protonn_steps=args.protonn_steps)
    if args.smoke:
        fractions = ["1/16", "1/4", "1"]
        dims, grid_fractions = [8, 16], [0.1, 0.3]
        space = SearchSpace(
            count_fractions=(1.0, 0.25),
            hnsw_M=(8,),
            protonn_dims=(8, 16),
            protonn_fractions=(0.3,),
            protonn_steps=50,
        )

    # 1. encoders
    settings = ExportSettings(
        knn=KNNChoice(KNNConfig(args.k, args.sigma)), seed=args.seed, space=space
    )
    every_client = run.clients()
    enc = build_encoder(run, _fresh(out / "encoders"), settings, every_client)
    clients = select_clients(every_client, args.clients)
    clients = [c for c in clients if c.num_train > 0]
    ref = {}
    for name, path in (("int8", enc.path), ("fp32", enc.fp32_path)):
        ref[name] = weighted_mean(
            reference_accuracy(path, clients, num_classes=num_classes, k=args.k, sigma=args.sigma)
        )
    encoder_rows = [
        {"encoder": "fp32", "bytes": enc.fp32_nbytes, "knnper_accuracy": ref["fp32"]},
        {
            "encoder": "int8",
            "bytes": enc.nbytes,
            "knnper_accuracy": ref["int8"],
            **{f"vs_fp32_{k}": v for k, v in enc.int8_vs_fp32.items()},
        },
    ]
    size_ratio = enc.fp32_nbytes / enc.nbytes
    accuracy_cost_pp = 100 * (ref["fp32"] - ref["int8"])
    log.info(
        "encoder int8 %d bytes, fp32 %d (x%.2f); kNN-Per %.4f vs %.4f",
        enc.nbytes,
        enc.fp32_nbytes,
        size_ratio,
        ref["int8"],
        ref["fp32"],
    )

    # 2. budget curve (int8 encoder)
    session = Encoder(enc.path, intra_op_threads=1)
    cases = [ClientCase(session, c, num_classes, args.k, args.sigma) for c in clients]
    curve, client_rows = budget_curve(
        cases, fractions, space, num_classes, args.k, args.sigma, args.seed
    )

    # Device check: the auto bundles at --check-fraction, evaluated through Runtime.
    check = None
    if args.check_fraction in fractions:
        f = _fraction(args.check_fraction)
        budgets = {
            c.client.client_id: enc.nbytes + int(math.floor(f * c.full_bytes)) for c in cases
        }
        ids = ",".join(str(cid) for cid in budgets)
        try:
            # the curve sizes datastores as they are exported: the check's bundles must not
            # reserve room for on-device learning (a protonn buffer), which the curve leaves out
            export_run(
                run,
                _fresh(out / "bundles"),
                budgets,
                replace(settings, update_strategy="fixed"),
                clients=ids,
                encoder=enc,
                progress=False,
            )
            device = weighted_mean(evaluate_export(run, out / "bundles"))
            inproc = next(
                r["mean_accuracy"]
                for r in curve
                if r["fraction"] == args.check_fraction and r["backend"] == "auto"
            )
            check = {
                "fraction": args.check_fraction,
                "runtime_accuracy": device,
                "benchmark_accuracy": inproc,
            }
        except BudgetInvalid as err:
            check = {"fraction": args.check_fraction, "error": str(err)}

    # 3. ProtoNN grid
    grid_cases = cases
    if args.grid_clients and args.grid_clients < len(cases):
        pick = np.random.default_rng(args.seed).choice(len(cases), args.grid_clients, replace=False)
        grid_cases = [cases[i] for i in sorted(pick)]
    grid = protonn_grid(
        grid_cases,
        dims,
        grid_fractions,
        num_classes,
        space.protonn_steps,
        args.k,
        args.sigma,
        args.seed,
    )
    grid_reference = weighted_mean(
        [
            {
                "test_accuracy": c.test_accuracy(full, c.lambda_on_validation(full)),
                "test_samples": len(c.data.y_test),
            }
            for c in grid_cases
            for full in [
                FlatDatastore(num_classes, k=args.k, sigma=args.sigma).fit(
                    c.data.z_train, c.data.y_train
                )
            ]
        ]
    )

    # outputs
    C.write_csv(
        out / "encoder.csv",
        encoder_rows,
        [
            "encoder",
            "bytes",
            "knnper_accuracy",
            "vs_fp32_embedding_cosine_min",
            "vs_fp32_embedding_cosine_mean",
            "vs_fp32_logits_max_abs_diff",
            "vs_fp32_argmax_agreement",
        ],
    )
    C.write_csv(
        out / "budget_curve.csv",
        curve,
        [
            "fraction",
            "backend",
            "clients",
            "clients_fitting",
            "mean_accuracy",
            "bytes_ratio",
            "recipes",
        ],
    )
    C.write_csv(
        out / "clients.csv",
        client_rows,
        [
            "fraction",
            "backend",
            "client_id",
            "unseen",
            "fits",
            "recipe",
            "bytes",
            "room_bytes",
            "full_bytes",
            "lambda",
            "val_accuracy",
            "test_accuracy",
            "test_samples",
        ],
    )
    C.write_csv(
        out / "protonn_grid.csv",
        grid,
        [
            "projection_dim",
            "prototype_fraction",
            "mean_accuracy",
            "val_accuracy",
            "bytes_ratio",
            "seconds",
        ],
    )
    scale = f"run {Path(run_path).name}, {len(cases)} clients ({len(grid_cases)} in the grid)"
    plot_curve(curve, ref["int8"], out / "budget_curve.png", scale)
    plot_grid(grid, grid_reference, out / "protonn_grid.png", scale=scale)
    info = C.machine_info()
    md = render_markdown(
        run_path,
        encoder_rows,
        size_ratio,
        accuracy_cost_pp,
        curve,
        ref,
        check,
        grid,
        grid_reference,
        len(cases),
        len(grid_cases),
        info,
        time.perf_counter() - started,
    )
    write_text_atomic(out / "results.md", md + "\n")
    C.write_json(
        out / "run.json",
        {
            "command": C.command_line(),
            "machine": info,
            "run": str(run_path),
            "encoder": encoder_rows,
            "reference": ref,
            "check": check,
            "space": space.__dict__,
            "seconds": time.perf_counter() - started,
        },
    )
    print(md)
    return 0


def _fresh(path: Path) -> Path:
    import shutil

    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def render_markdown(
    run_path: Path,
    encoder_rows: list[dict],
    size_ratio: float,
    cost_pp: float,
    curve: list[dict],
    ref: dict,
    check: dict | None,
    grid: list[dict],
    grid_reference: float,
    n_clients: int,
    n_grid: int,
    info: dict,
    seconds: float,
) -> str:
    parts = [f"## Export: budgets and accuracy ({run_path})", ""]
    parts.append(
        f"Encoder (kNN-Per mean test accuracy with the full float32 flat datastore, "
        f"{n_clients} clients): int8 is {size_ratio:.2f}x smaller than fp32 and costs "
        f"{cost_pp:+.2f} pp."
    )
    parts.append("")
    parts.append(
        C.markdown_table(
            encoder_rows,
            [
                ("encoder", "encoder", ""),
                ("bytes", "bytes", ""),
                ("knnper_accuracy", "kNN-Per acc", ".2%"),
                ("vs_fp32_embedding_cosine_min", "min cos to fp32", ".5f"),
                ("vs_fp32_argmax_agreement", "argmax agreement", ".2%"),
            ],
        )
    )
    parts += [
        "",
        "Accuracy versus datastore budget (fraction of each client's full float32 "
        f"flat datastore, on top of the int8 encoder); full datastore: {ref['int8']:.2%}.",
        "",
    ]
    parts.append(
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
        )
    )
    if check:
        if "error" in check:
            parts += ["", f"Device check at {check['fraction']}: {check['error']}"]
        else:
            parts += [
                "",
                f"Device check at {check['fraction']}: auto bundles written with "
                f"export_run and run through Runtime: {check['runtime_accuracy']:.2%} "
                f"(benchmark: {check['benchmark_accuracy']:.2%}).",
            ]
    parts += [
        "",
        f"ProtoNN grid ({n_grid} clients; full float32 flat datastore {grid_reference:.2%}):",
        "",
    ]
    parts.append(
        C.markdown_table(
            grid,
            [
                ("projection_dim", "d", ""),
                ("prototype_fraction", "m", ""),
                ("mean_accuracy", "mean acc", ".2%"),
                ("bytes_ratio", "bytes / full", ".3f"),
            ],
        )
    )
    parts += [
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
