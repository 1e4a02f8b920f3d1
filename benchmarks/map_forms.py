"""Which key map form the server's cross-validation favours, on the releases of `knnper
experiment model-update` (export.map_forms: ridge, standardised ridge, low-rank, per-class; and a
small MLP on the ridge map's residual, fitted here with torch, the form measured and left out).

    python benchmarks/map_forms.py EXPERIMENT_DIR --out OUT

EXPERIMENT_DIR is the experiment's model-update folder (seed_*/ with v1, b1 and, for each of
its gaps, the successor run GAP and its release b-GAP). For each seed and gap, on the whole
server split (at most 10,000 samples; the release cross-validates on its 60% fitting part),
embedded by v1's encoder and the gap's: the 5-fold cross-validated kNN accuracy of every
candidate (leave-own-out, the gap's k and sigma), its mean squared error, and the seconds each
form's cross-validation took. Everything here is server data: no client's samples are read.
Outputs in OUT: forms.json and forms.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edge_runtime._io import write_text_atomic  # noqa: E402
from edge_runtime.encoder import Encoder  # noqa: E402
from edge_runtime.preprocess import prepare_input  # noqa: E402
from experiments.benchmark_support import machine_info, machine_line, write_json  # noqa: E402
from experiments.model_update import GAPS  # noqa: E402
from export import map_forms as mf  # noqa: E402
from export.upgrade_map import MAP_FORMS, MAX_SERVER_SAMPLES, server_data  # noqa: E402
from fed_train.run import load_run  # noqa: E402

MLP_SHAPES = ((64, 1e-4), (64, 1e-2))  # (hidden width, L2 strength)
MLP_STEPS, MLP_LR = 300, 1e-2


@dataclass(frozen=True)
class MLPCandidate(mf.Candidate):
    l2: float = 0.0

    def name(self) -> str:
        return f"mlp alpha {self.alpha:g} hidden {int(self.size)} l2 {self.l2:g}"


def fit_mlp(c: mf.Candidate, x, y, labels, classes) -> mf.FittedMap:
    """The ridge map plus relu(x W1 + b1) W2 + b2 fitted on its residual (Adam, full batch,
    L2 `c.l2`; inputs standardised), as a function of the old embedding."""
    if c.form != "mlp":
        return mf.fit_candidate(c, x, y, labels, classes)
    import torch

    torch.manual_seed(0)
    w, b = mf.ridge(x, y, c.alpha)
    mx, sd = x.mean(0), np.where(x.std(0) > 1e-8, x.std(0), 1.0)
    xs = torch.from_numpy(((x - mx) / sd).astype(np.float32))
    target = torch.from_numpy((y - (x @ w + b)).astype(np.float32))
    w1 = (torch.randn(x.shape[1], int(c.size)) / np.sqrt(x.shape[1])).requires_grad_()
    b1 = torch.zeros(int(c.size), requires_grad=True)
    w2 = torch.zeros(int(c.size), y.shape[1], requires_grad=True)  # starts at the ridge map
    b2 = torch.zeros(y.shape[1], requires_grad=True)
    opt = torch.optim.Adam([w1, b1, w2, b2], lr=MLP_LR)
    for _ in range(MLP_STEPS):
        opt.zero_grad()
        out = torch.relu(xs @ w1 + b1) @ w2 + b2
        loss = ((out - target) ** 2).sum(1).mean() + c.l2 * ((w1**2).sum() + (w2**2).sum())
        loss.backward()
        opt.step()
    params = [t.detach().numpy() for t in (w1, b1, w2, b2)]
    return _MLPMap("mlp", w, b, dict(zip(("w1", "b1", "w2", "b2"), params, strict=True)), mx, sd)


class _MLPMap(mf.FittedMap):
    def __init__(self, form, weight, bias, extra, mx, sd):
        super().__init__(form, weight, bias, extra)
        self.mx, self.sd = mx, sd

    def apply(self, z, labels=None):
        e = self.extra
        hidden = np.maximum(((z - self.mx) / self.sd) @ e["w1"] + e["b1"], 0)
        return (z @ self.weight + self.bias + hidden @ e["w2"] + e["b2"]).astype(np.float32)


def _knn_config(run_dir: Path) -> dict:
    choices = json.loads((run_dir / "knn_config.json").read_text())["choices"]
    return next(iter(choices.values()))["config"]


def measure(seed_dir: Path) -> dict:
    v1 = load_run(seed_dir / "v1")
    out = {}
    for gap in GAPS:
        x, y = server_data(load_run(seed_dir / gap), None)
        keep = np.sort(
            np.random.default_rng([v1.config.seed, 0x3A7]).choice(
                len(y), min(len(y), MAX_SERVER_SAMPLES), replace=False
            )
        )
        x, y = x[keep], np.asarray(y)[keep]
        xp = prepare_input(x, v1.dataset.input_spec)
        z_old = Encoder(seed_dir / "b1" / "encoder.onnx", intra_op_threads=1).run(xp)[0]
        z_new = Encoder(seed_dir / f"b-{gap}" / "encoder.onnx", intra_op_threads=1).run(xp)[0]
        cfg = _knn_config(seed_dir / gap)
        common = {"k": cfg["k"], "sigma": cfg["sigma"], "seed": v1.config.seed}
        classes = v1.dataset.num_classes
        scores, seconds = {}, {}
        start = time.perf_counter()
        scores.update(mf.cross_validate(mf.candidates(0.0, ()), z_old, z_new, y, classes, **common))
        seconds["ridge"] = time.perf_counter() - start
        alpha = mf.best_alpha(scores)
        for form in MAP_FORMS:
            start = time.perf_counter()
            cands = mf.candidates(alpha, (form,))[len(mf.RIDGE_ALPHAS) :]
            scores.update(mf.cross_validate(cands, z_old, z_new, y, classes, **common))
            seconds[form] = time.perf_counter() - start
        start = time.perf_counter()
        mlps = [MLPCandidate("mlp", alpha, w, l2) for w, l2 in MLP_SHAPES]
        scores.update(mf.cross_validate(mlps, z_old, z_new, y, classes, fit=fit_mlp, **common))
        seconds["mlp"] = time.perf_counter() - start
        chosen = mf.choose({c: s for c, s in scores.items() if c.form != "mlp"})
        by_mse = min(
            (c for c in scores if c.form == "ridge"), key=lambda c: (scores[c]["mse"], -c.alpha)
        )
        out[gap] = {
            "samples": len(y),
            "knn_config": cfg,
            "chosen": chosen.name(),
            "ridge_by_mse": by_mse.name(),
            "seconds": seconds,
            "cv": {
                (
                    c.name()
                    if c.form != "mlp"
                    else f"mlp alpha {c.alpha:g} hidden {int(c.size)} l2 {c.l2:g}"
                ): s
                for c, s in scores.items()
            },
        }
    return out


def render(results: dict, command: str, cpu: str) -> str:
    lines = [
        "Key map forms by 5-fold cross-validated kNN accuracy (%) on the server split "
        f"(leave-own-out, each release's k and sigma). CPU: {cpu}.",
        "",
        "| seed | gap | samples | ridge (alpha by MSE) | ridge (alpha by kNN CV) | best "
        "standardised | best low-rank | best per-class | best mlp | chosen here (mlp aside) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for seed, gaps in results.items():
        for gap, r in gaps.items():
            cv = r["cv"]

            def best(prefix: str, cv=cv) -> str:
                name = max(
                    (n for n in cv if n.startswith(prefix)), key=lambda n: cv[n]["knn_accuracy"]
                )
                return f"{100 * cv[name]['knn_accuracy']:.2f}"

            best_ridge = max(
                (n for n in cv if n.startswith("ridge alpha")), key=lambda n: cv[n]["knn_accuracy"]
            )
            by_mse, by_knn = cv[r["ridge_by_mse"]], cv[best_ridge]
            lines.append(
                f"| {seed} | {gap} | {r['samples']} | {100 * by_mse['knn_accuracy']:.2f} "
                f"({r['ridge_by_mse']}) | {100 * by_knn['knn_accuracy']:.2f} ({best_ridge}) | "
                f"{best('ridge standardised')} | {best('low-rank')} | {best('per-class')} | "
                f"{best('mlp')} | {r['chosen']} |"
            )
    lines += ["", *gains(results), "", f"Command: `{command}`", ""]
    return "\n".join(lines)


FAMILIES = (
    ("ridge, alpha by kNN CV", "ridge alpha"),
    ("standardised", "ridge standardised"),
    ("low-rank", "low-rank"),
    ("per-class", "per-class"),
    ("mlp", "mlp"),
)


def gains(results: dict) -> list[str]:
    """Each family's best candidate minus the ridge map by squared error, over every (seed,
    gap): the best is picked on the same folds it is scored on, so a family of more candidates
    is favoured (optimistic by selection; the release's own choice is scored the same way)."""
    diffs: dict[str, list[float]] = {name: [] for name, _ in FAMILIES}
    for gaps in results.values():
        for r in gaps.values():
            cv = r["cv"]
            base = cv[r["ridge_by_mse"]]["knn_accuracy"]
            for name, prefix in FAMILIES:
                best = max(v["knn_accuracy"] for n, v in cv.items() if n.startswith(prefix))
                diffs[name].append(100 * (best - base))
    pairs = len(next(iter(diffs.values())))
    lines = [
        f"Best of each family minus ridge with alpha by squared error, pp, over {pairs} "
        "(seed, gap) pairs (in-CV best: optimistic by selection):",
        "",
        "| family | mean | min | max | pairs ahead |",
        "|---|---|---|---|---|",
    ]
    for name, d in diffs.items():
        a = np.asarray(d)
        lines.append(
            f"| {name} | {a.mean():+.2f} | {a.min():+.2f} | {a.max():+.2f} | "
            f"{int((a > 0).sum())} of {len(a)} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("experiment", help="the model-update folder of `knnper experiment model-update`")
    p.add_argument("--out", required=True, help="results directory")
    args = p.parse_args(argv)
    seeds = sorted(Path(args.experiment).glob("seed_*"))
    ready = [s for s in seeds if all((s / f"b-{g}" / "encoder.onnx").is_file() for g in GAPS)]
    if not ready:
        print(f"{args.experiment}: no seed_*/ with its releases", file=sys.stderr)
        return 2
    results = {s.name: measure(s) for s in ready}
    cpu = machine_line(machine_info())
    command = " ".join(["python", "benchmarks/map_forms.py", *(argv or sys.argv[1:])])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "forms.json", {"command": command, "cpu": cpu, "seeds": results})
    table = render(results, command, cpu)
    write_text_atomic(out / "forms.md", table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
