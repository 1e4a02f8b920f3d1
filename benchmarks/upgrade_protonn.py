"""Accuracy of ProtoNN bundles across a model update: the release's reverse map folded into the
projection (what `knnper-edge upgrade` does) against the alternatives, at digits scale.

    python benchmarks/upgrade_protonn.py --out benchmarks/results/upgrade_protonn [--seeds 0 1 2]
    python benchmarks/upgrade_protonn.py --smoke --out OUT     # one seed, one gap, 3 clients

For each seed: a pretraining on digits keeping a server split (the only data the key map sees),
a first training and export with `--backend protonn` (v1), and for each gap a second training
from the same partition and its export with `--upgrade-from v1` (v2):
- continued: `knnper train --continue-from v1` (3 more rounds);
- retrained: another training from the same pretraining (learning rate 0.05, 2 local epochs).
Each client's device is its v1 bundle after `knnper-edge add` of its validation split (what it
learned on the device goes into the ProtoNN buffer, fifo). On the client's test split:
- old-noadd: the v1 bundle as exported, before the device added anything;
- old: the device before the upgrade (old encoder, old prototypes);
- stale: the new encoder's queries scored against the old prototypes and buffer (no fold), with
  the release's encoder, head and lambda, i.e. what an upgrade that only swapped the encoder
  would give;
- folded: `knnper-edge upgrade` (the server's reverse ridge map folded into the projection);
- folded-pinv: the same with the pseudo-inverse of the forward map as the reverse (what a device
  could compute itself from an older release's map);
- folded-noadd: `upgrade` of the v1 bundle as exported (no additions): the old prototypes
  folded, against the fresh ones below on the same footing;
- fresh: the release's own ProtoNN bundle for the client (trained on the new encoder; the
  device's additions are lost);
- fresh+readd: the release's bundle with the validation split added again (needs the raw
  samples, which a device does not keep with ProtoNN: a reference, not an option).
Two accuracies each: the bundle's prediction (kNN-Per: lambda x ProtoNN + (1 - lambda) x the
global or linear base) and the ProtoNN datastore's alone (argmax of p_local). Means are over the
clients of a seed; intervals over seeds (t, 95%) of the paired per-seed differences, "inconclusive"
when the interval holds 0.

Outputs in OUT: results.json (per client, per seed, summary) and upgrade_protonn.md (tables,
command, machine).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edge_runtime._io import write_text_atomic  # noqa: E402
from edge_runtime.cli import main as edge  # noqa: E402
from edge_runtime.keymap import KeyMap, load_key_map  # noqa: E402
from edge_runtime.knn import softmax  # noqa: E402
from edge_runtime.personal_head import PersonalHead  # noqa: E402
from edge_runtime.runtime import Runtime  # noqa: E402
from experiments.benchmark_support import machine_info, machine_line  # noqa: E402
from knnper_cli.main import main as knnper  # noqa: E402

PATHS = tuple("old-noadd old stale folded folded-pinv folded-noadd fresh fresh+readd".split())
COMPARISONS = (
    ("folded", "stale"),
    ("old", "old-noadd"),
    ("folded", "folded-pinv"),
    ("folded", "old"),
    ("folded", "fresh"),
    ("folded-noadd", "fresh"),
)
GAPS = {
    "continued": ["--rounds", "3"],  # with --continue-from v1
    "retrained": ["--rounds", "3", "--lr", "0.05", "--local-epochs", "2"],  # with --init pre
}
CLIENTS, SMOKE_CLIENTS = 5, 3  # --smoke: fewer clients, each exported ProtoNN a grid search
BUDGET = "200kB"
# two-sided 95% t quantiles by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def run(*argv: str) -> None:
    if knnper(["--threads", "1", "--no-progress", *argv]) != 0:
        raise SystemExit(f"knnper {' '.join(argv)} failed")


def export(run_dir: Path, out: Path, *extra: str) -> None:
    run(
        "export",
        str(run_dir),
        "--out",
        str(out),
        "--budget",
        BUDGET,
        "--device-extras",
        "none",
        "--workers",
        "1",
        "--backend",
        "protonn",
        *extra,
    )


def pinv_map(key_map: Path, out: Path) -> Path:
    """The release's map with the pseudo-inverse of its forward map as the reverse:
    z_new = z_old A + a  ->  z_old = (z_new - a) A+."""
    m = load_key_map(key_map)
    inverse = np.linalg.pinv(m.weight.astype(np.float64))
    KeyMap(
        m.weight,
        m.bias,
        m.from_version,
        m.to_version,
        m.advice,
        m.evidence,
        inverse.astype(np.float32),
        (-m.bias.astype(np.float64) @ inverse).astype(np.float32),
    ).save(out)
    return out


def accuracies(rt: Runtime, x: np.ndarray, y: np.ndarray, datastore=None) -> tuple[float, float]:
    """(the bundle's accuracy, its ProtoNN datastore's alone); `datastore`: score this one
    instead of the bundle's (stale keys), with the bundle's encoder and lambda."""
    z, logits = rt.embed(x)
    head = rt.head if datastore is None else PersonalHead.fitted(rt.num_classes, datastore, rt.lam)
    bundle = head.predict_proba(z, softmax(logits)).argmax(1)
    local = head.local_proba(z).argmax(1)
    return float((bundle == y).mean()), float((local == y).mean())


def upgraded(device: Path, release: Path, work: Path, key_map: Path | None) -> Runtime:
    target = work / "upgraded"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(device, target)
    argv = ["upgrade", str(target), "--to", str(release), "--force"]
    if edge(argv + ([] if key_map is None else ["--map", str(key_map)])) != 0:
        raise SystemExit(f"knnper-edge {' '.join(argv)} failed")
    return Runtime.load(target, intra_op_threads=1)


def one_client(client: int, v1: Path, v2: Path, runs: Path, work: Path, pinv: Path) -> dict:
    name = f"client_{client:04d}"
    data = work / f"data_{client}"
    if not data.exists():
        run("client-data", str(runs), "--client", str(client), "--out", str(data))
    val, test = (np.load(data / f"{s}.npz") for s in ("val", "test"))
    x, y = test["x"], test["y"]
    device = work / "device"
    shutil.rmtree(device, ignore_errors=True)
    shutil.copytree(v1 / name, device)
    before = Runtime.load(device, intra_op_threads=1)
    row = {"client": client, "test": len(y), "old-noadd": accuracies(before, x, y)}
    before.add(val["x"], val["y"])
    row["buffered"] = len(before.datastore.buffer_labels_)
    row["old"] = accuracies(before, x, y)
    folded = upgraded(device, v2 / name, work, None)
    row["stale"] = accuracies(folded, x, y, datastore=before.datastore)
    row["folded"] = accuracies(folded, x, y)
    row["folded-pinv"] = accuracies(upgraded(device, v2 / name, work, pinv), x, y)
    row["folded-noadd"] = accuracies(upgraded(v1 / name, v2 / name, work, None), x, y)
    fresh = Runtime.load(v2 / name, intra_op_threads=1)
    row["fresh"] = accuracies(fresh, x, y)
    readd = work / "readd"
    shutil.rmtree(readd, ignore_errors=True)
    shutil.copytree(v2 / name, readd)
    again = Runtime.load(readd, intra_op_threads=1)
    again.add(val["x"], val["y"])
    row["fresh+readd"] = accuracies(again, x, y)
    return row


def one_seed(seed: int, gaps: list[str], work: Path, clients: int) -> dict:
    s = str(seed)
    root = work / f"seed{seed}"
    root.mkdir(parents=True, exist_ok=True)
    pre, v1 = root / "pre", root / "v1"
    run("pretrain", "--dataset", "digits", "--server-fraction", "0.2", "--epochs", "3",
        "--seed", s, "--out", str(pre))  # fmt: skip
    run("train", "--init", str(pre), "--clients", str(clients), "--rounds", "3", "--seed", s,
        "--out", str(v1))  # fmt: skip
    export(v1, root / "b1")
    out = {}
    for gap in gaps:
        v2 = root / f"v2-{gap}"
        start = ["--continue-from", str(v1)] if gap == "continued" else ["--init", str(pre)]
        run("train", *start, "--clients", str(clients), "--seed", s, *GAPS[gap], "--out", str(v2))
        b2 = root / f"b2-{gap}"
        export(v2, b2, "--upgrade-from", str(root / "b1"))
        (key_map,) = (b2 / "upgrades").glob("from-*.npz")
        evidence = json.loads(key_map.with_suffix(".json").read_text())
        pinv = pinv_map(key_map, root / f"pinv-{gap}.npz")
        rows = [
            one_client(c, root / "b1", b2, v1, root / f"work-{gap}", pinv) for c in range(clients)
        ]
        out[gap] = {
            "advice": evidence["advice"],
            "server_evidence": evidence["evidence_knn_accuracy"],
            "reverse_evidence": evidence["reverse"],
            "clients": rows,
            "mean": {p: [float(np.mean([r[p][i] for r in rows])) for i in (0, 1)] for p in PATHS},
        }
    return out


def interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the t 95% interval of the mean (the mean alone for one value)."""
    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, mean, mean
    half = T95.get(len(values) - 1, 1.96) * float(np.std(values, ddof=1)) / np.sqrt(len(values))
    return mean, mean - half, mean + half


def summarize(seeds: dict[int, dict], gaps: list[str]) -> dict:
    summary = {}
    for gap in gaps:
        per = {p: [seeds[s][gap]["mean"][p] for s in seeds] for p in PATHS}
        entry = {"paths": {}, "differences": {}}
        for which, i in (("bundle", 0), ("protonn", 1)):
            entry["paths"][which] = {p: interval([v[i] for v in per[p]]) for p in PATHS}
            entry["differences"][which] = {}
            for first, second in COMPARISONS:
                diff = [a[i] - b[i] for a, b in zip(per[first], per[second], strict=True)]
                mean, low, high = interval(diff)
                verdict = "inconclusive" if low <= 0 <= high or len(diff) < 2 else (
                    f"{first} better" if low > 0 else f"{first} worse"
                )  # fmt: skip
                entry["differences"][which][f"{first} - {second}"] = [mean, low, high, verdict]
        summary[gap] = entry
    return summary


def render(results: dict, command: str) -> str:
    lines = [
        "# ProtoNN bundles across a model update (digits)",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {results['machine']}",
        "",
        f"Seeds {results['seeds']}, {results['clients']} clients each, budget {BUDGET}; mean test "
        "accuracy (%) over the clients of a seed, then mean [95% t interval] over seeds.",
    ]
    for gap, entry in results["summary"].items():
        for which, title in (("bundle", "the bundle (kNN-Per)"), ("protonn", "ProtoNN alone")):
            lines += ["", f"## {gap}: {title}", "", "| " + " | ".join(PATHS) + " |"]
            lines.append("|" + "---|" * len(PATHS))
            cells = [
                f"{100 * m:.2f} [{100 * lo:.2f}, {100 * hi:.2f}]"
                for m, lo, hi in (entry["paths"][which][p] for p in PATHS)
            ]
            lines.append("| " + " | ".join(cells) + " |")
            lines += [
                "",
                "| difference | mean (pp) | 95% interval | verdict |",
                "|---|---|---|---|",
            ]
            for label, (m, lo, hi, verdict) in entry["differences"][which].items():
                lines.append(f"| {label} | {100 * m:+.2f} | [{100 * lo:+.2f}, {100 * hi:+.2f}] "
                             f"| {verdict} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: tmp)")
    parser.add_argument(
        "--smoke", action="store_true", help=f"one seed, the continued gap, {SMOKE_CLIENTS} clients"
    )
    args = parser.parse_args()
    seeds, gaps = (args.seeds[:1], ["continued"]) if args.smoke else (args.seeds, list(GAPS))
    clients = SMOKE_CLIENTS if args.smoke else CLIENTS
    work = args.work or Path(tempfile.mkdtemp(prefix="knnper-upgrade-protonn-"))
    try:
        per_seed = {s: one_seed(s, gaps, work, clients) for s in seeds}
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    results = {
        "machine": machine_line(machine_info()),
        "seeds": seeds,
        "clients": clients,
        "gaps": {g: GAPS[g] for g in gaps},
        "per_seed": per_seed,
        "summary": summarize(per_seed, gaps),
    }
    command = "python benchmarks/upgrade_protonn.py " + " ".join(sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "results.json", json.dumps(results, indent=2) + "\n")
    write_text_atomic(args.out / "upgrade_protonn.md", render(results, command))
    print(render(results, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
