"""What the benchmark scripts and the experiments share: machine description, thread limits, the
global model and its embeddings, ONNX encoder export, benchmark datastores and bundles, and the
CSV / markdown / JSON writers of every report. The scripts under benchmarks/ are thin callers of
this package (installed, or the source tree with `pip install -e .`); nothing imports them.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime

from edge_runtime._io import csv_text, write_text_atomic
from edge_runtime.arg_types import positive_int
from edge_runtime.bundle import write_bundle
from edge_runtime.datastores import (
    BACKENDS,
    TYPICAL_RECIPES,
    make_datastore,
    parse_recipe,
    recipe_without,
)
from edge_runtime.encoder import Encoder, optimize_encoder
from edge_runtime.knn import DEFAULT_K, DEFAULT_SIGMA, softmax
from edge_runtime.knn_provenance import KNNProvenance
from edge_runtime.manifest import BundleFields, Manifest
from edge_runtime.preprocess import InputSpec, prepare_input

# the source checkout this module sits in (its default paths for results and data)
REPO = Path(__file__).resolve().parents[1]

log = logging.getLogger("benchmarks")

# Thread-count environment variables read by BLAS / OpenMP runtimes when a process starts.
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


# ----------------------------------------------------------------------------- reporting


def command_line() -> str:
    """The command that ran this script, quoted so it can be pasted back into a shell."""
    return shlex.join([Path(sys.executable).name, *sys.argv])


# The instruction sets the integer and float kernels' speed depends on, by /proc/cpuinfo flag:
# timings from CPUs that differ here are not comparable.
CPU_FEATURES = {
    "AVX2": ("avx2",),
    "AVX-512 VNNI": ("avx512_vnni",),
    "AVX-VNNI": ("avx_vnni",),
    "AMX": ("amx_int8", "amx_tile"),
}


def machine_info() -> dict[str, Any]:
    """CPU model, its vector instruction sets (CPU_FEATURES), core counts (from lscpu), load
    average, library versions (onnxruntime always: the runtime's kernels are its)."""
    info: dict[str, Any] = {
        "cpu_model": platform.processor() or platform.machine(),
        "cpus_online": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    if fields.get("Model name"):
        info["cpu_model"] = fields["Model name"]
    for key, name in (
        ("CPU(s)", "lscpu_cpus"),
        ("Core(s) per socket", "cores_per_socket"),
        ("Socket(s)", "sockets"),
        ("Thread(s) per core", "threads_per_core"),
        ("CPU max MHz", "max_mhz"),
        ("Hypervisor vendor", "hypervisor"),
    ):
        if fields.get(key):
            info[name] = fields[key]
    flags = set(fields.get("Flags", "").split())
    info["cpu_features"] = (
        {name: any(f in flags for f in names) for name, names in CPU_FEATURES.items()}
        if flags
        else None
    )
    if hasattr(os, "getloadavg"):
        info["loadavg_1_5_15"] = [round(v, 2) for v in os.getloadavg()]
    info["onnxruntime"] = onnxruntime.__version__
    for module in ("numpy", "torch", "hnswlib"):
        mod = sys.modules.get(module)
        if mod is not None:
            info[module] = getattr(mod, "__version__", "?")
    return info


def machine_line(info: dict[str, Any]) -> str:
    cores = info.get("lscpu_cpus", info.get("cpus_online"))
    load = info.get("loadavg_1_5_15")
    return (
        f"{info['cpu_model']}, {cores} CPUs ({info.get('cpus_usable')} usable)"
        + (f", load average {load[0]} / {load[1]} / {load[2]}" if load else "")
        + f"; {cpu_features_line(info)}; onnxruntime {info.get('onnxruntime', '?')}"
        + f"; Python {info['python']}"
    )


def cpu_features_line(info: dict[str, Any]) -> str:
    """'AVX2 yes, AVX-512 VNNI yes, AVX-VNNI no, AMX no' (or that they are unknown)."""
    features = info.get("cpu_features")
    if not features:
        return "instruction sets unknown (no lscpu flags)"
    return ", ".join(f"{name} {'yes' if has else 'no'}" for name, has in features.items())


def report_head(title: str, start: dict[str, Any], end: dict[str, Any], note: str) -> list[str]:
    """The lines a benchmark report opens with: its title, the exact command, and the machine
    with its load at the start and at the end (the machine is shared: both bound the timings)."""
    return [
        f"# {title}",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Machine: {machine_line(start)} (at the start; load average at the end "
        f"{end.get('loadavg_1_5_15')}). {note}",
    ]


def report_text(head: list[str], *blocks: str) -> str:
    """A report's markdown: report_head's lines, then each block (a paragraph, a table) after a
    blank line; it ends with a newline."""
    return "\n\n".join(["\n".join(head), *blocks]) + "\n"


def start_benchmark(out: Path, threads: int) -> tuple[float, dict[str, Any]]:
    """A benchmark's first steps: logging, one thread count (limit_threads), its output folder.
    Returns the start time and the machine as it was then (report_head states the load both at
    the start and at the end)."""
    setup_logging()
    limit_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    return time.time(), machine_info()


def run_record(args: argparse.Namespace, started: float, **fields: Any) -> dict[str, Any]:
    """A benchmark's run.json: the command, `fields` (the machine, the weights...), the flags it
    ran with (paths as text) and the seconds since `started`."""
    return {
        "command": command_line(),
        **fields,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seconds": time.time() - started,
    }


def write_results(
    args: argparse.Namespace,
    started: float,
    text: str,
    *,
    report: str,
    record: str,
    tables: dict[str, tuple[Sequence[dict[str, Any]], Sequence[Any] | None]],
    **fields: Any,
) -> None:
    """A benchmark's outputs in args.out, all written at its end: each CSV table (file name:
    rows and write_csv's columns), the markdown report `text` (also
    printed) and its run record (run_record with `fields`)."""
    for name, (rows, columns) in tables.items():
        write_csv(args.out / name, rows, columns)
    write_text_atomic(args.out / report, text)
    write_json(args.out / record, run_record(args, started, **fields))
    print(text)


def write_csv(
    path: Path,
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str | tuple[str, str, str]] | None = None,
) -> None:
    """`rows` as CSV, floats to 6 significant digits; `columns`: names, or markdown_table's
    (key, header, format) triples (a table's CSV and markdown then have one declaration); by
    default every key of the rows, in the order they first appear (the row literal is then the
    one declaration of the file)."""
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    columns = [c if isinstance(c, str) else c[0] for c in columns]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(
        path, csv_text(({k: _csv_value(row.get(k)) for k in columns} for row in rows), columns)
    )


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else value


def read_csv(path: Path, text_columns: Sequence[str] = ()) -> list[dict[str, Any]]:
    """write_csv's rows back with their types: "" is None, True / False, ints, floats, other
    text as it is; `text_columns` stay text (labels such as alpha "0.3" or "iid")."""
    with open(path, newline="") as f:
        return [
            {k: v if k in text_columns else _typed(v) for k, v in r.items()}
            for r in csv.DictReader(f)
        ]


def _typed(text: str) -> Any:
    if text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec such as ".2f" or ""); missing values print as '-'."""
    lines = [
        "| " + " | ".join(h for _, h, _ in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            cells.append("-" if value is None or value == "" else format(value, fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fresh_dir(path: Path) -> Path:
    """`path` as an empty folder (what an earlier run left there is removed)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    # onnxruntime's quantizer advises pre-processing on the root logger at every call.
    logging.getLogger().addFilter(
        lambda r: "pre-processing" not in r.getMessage() and "pre-process" not in r.getMessage()
    )


# ----------------------------------------------------------------------------- threads


def limit_threads(threads: int) -> None:
    """One thread count for torch, numpy's BLAS and OpenMP, and for child processes (through the
    environment). onnxruntime and hnswlib get theirs per session / per query."""
    for name in THREAD_ENV:
        os.environ[name] = str(threads)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # without it, BLAS keeps the count it started with
        log.warning("threadpoolctl is not installed: numpy's BLAS thread count is not limited")
    else:
        threadpool_limits(limits=threads)
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- model and data


@dataclass
class GlobalModel:
    """The small CNN (trained weights from a run, or random) and the data set it reads."""

    model: Any  # fed_train.models.EmbedHeadModel (torch is imported lazily)
    dataset: Any  # fed_train.data.Dataset
    source: str  # "run RUN" or "random weights (seed S)"
    run: Any = None  # fed_train.run.LoadedRun when loaded from a run

    @property
    def spec(self) -> dict:
        return self.dataset.input_spec

    @property
    def num_classes(self) -> int:
        return int(self.dataset.num_classes)


def load_global_model(
    run: str | None, *, seed: int = 0, max_train: int | None = None
) -> GlobalModel:
    """From RUN (its dataset and final global model) or, without a run, Fashion-MNIST from the
    data loader's default location and a small CNN with seeded random weights."""
    import torch

    from fed_train.data import load_dataset
    from fed_train.models import build_model

    if run is not None:
        from fed_train.run import load_run

        loaded = load_run(run)
        if loaded.model_name != "small-cnn":
            log.warning("run %s holds a %s, not the small CNN", run, loaded.model_name)
        loaded.model.eval()
        return GlobalModel(loaded.model, loaded.dataset, f"run {run}", loaded)
    dataset = load_dataset("fashion-mnist", max_train=max_train, seed=seed)
    torch.manual_seed(seed)
    model = build_model("small-cnn", dataset.num_classes, dataset.input_spec).eval()
    return GlobalModel(model, dataset, f"random weights (seed {seed})")


def torch_embed(
    model: Any, x: np.ndarray, spec: dict, batch_size: int = 512
) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings, logits) of raw inputs with the float32 torch model, in batches."""
    import torch

    zs, ls = [], []
    with torch.inference_mode():
        for start in range(0, len(x), batch_size):
            xp = torch.from_numpy(prepare_input(x[start : start + batch_size], spec))
            z = model.embed(xp)
            zs.append(z.numpy().copy())
            ls.append(model.head(z).numpy().copy())
    return np.concatenate(zs), np.concatenate(ls)


def export_encoder(
    model: Any, calibration: np.ndarray, out_dir: Path, *, encoder: str = "int8"
) -> Path:
    """The bundle's encoder.onnx through the exporter: float32 ONNX (checked against torch),
    then int8 QDQ calibrated on `calibration` (prepared inputs) unless encoder == "fp32"."""
    from export.onnx_export import export_onnx
    from export.quantize import quantize_int8

    if encoder not in ("int8", "fp32"):
        raise ValueError(f"encoder must be 'int8' or 'fp32', got {encoder!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    fp32, int8 = out_dir / "encoder_fp32.onnx", out_dir / "encoder_int8.onnx"
    export_onnx(model, calibration[:8], fp32)  # raises unless it matches torch
    if encoder == "fp32":
        return fp32
    quantize_int8(fp32, int8, calibration)
    return int8


def shipped_encoder(exported: Path) -> Path:
    """`exported` saved optimized beside it (encoder_optimized.onnx), as `knnper export` ships
    its encoder (edge_runtime.encoder.optimize_encoder)."""
    shipped = exported.with_name("encoder_optimized.onnx")
    shipped.write_bytes(optimize_encoder(exported.read_bytes()))
    return shipped


# ----------------------------------------------------------------------------- keys


def key_pool_indices(dataset: Any, queries: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(pool, query) indices into concat(x_train, x_test): queries are the last `queries` test
    images in a seeded order and never stored as keys; the pool is everything else, shuffled."""
    n_train, n_test = len(dataset.y_train), len(dataset.y_test)
    rng = np.random.default_rng(seed)
    test_order = n_train + rng.permutation(n_test)
    query_idx = test_order[n_test - queries :]
    pool_idx = np.concatenate([np.arange(n_train), test_order[: n_test - queries]])
    return rng.permutation(pool_idx), np.sort(query_idx)


@dataclass
class KeyPool:
    """What the device benchmarks build datastores and queries from: the torch model's
    embeddings `z` and labels `y` of the first pool images (`pool_idx`, for calibration too),
    and the query images, never stored as keys, with their labels."""

    z: np.ndarray
    y: np.ndarray
    pool_idx: np.ndarray
    queries: np.ndarray
    query_labels: np.ndarray


def key_pool(gm: GlobalModel, queries: int, most_keys: int, seed: int) -> KeyPool:
    """`key_pool_indices`' split, with up to `most_keys` pool images embedded."""
    pool_idx, query_idx = key_pool_indices(gm.dataset, queries, seed)
    n_real = min(most_keys, len(pool_idx))
    log.info("embedding %d key images with the torch model (%s)", n_real, gm.source)
    z, _ = torch_embed(gm.model, images(gm.dataset, pool_idx[:n_real]), gm.spec)
    return KeyPool(
        z,
        labels(gm.dataset, pool_idx[:n_real]),
        pool_idx,
        images(gm.dataset, query_idx),
        labels(gm.dataset, query_idx),
    )


def start_device_benchmark(
    args: argparse.Namespace, *, threads: int, queries: int, smoke_train: int
) -> tuple[float, dict[str, Any], GlobalModel, KeyPool]:
    """The device benchmarks' first steps (flags --out, --run, --seed, --sizes, --smoke):
    start_benchmark, the global model (its data set cut to `smoke_train` training images
    under --smoke, to keep the check quick) and a key pool for the largest size."""
    started, machine = start_benchmark(args.out, threads)
    gm = load_global_model(args.run, seed=args.seed, max_train=smoke_train if args.smoke else None)
    return started, machine, gm, key_pool(gm, queries, max(args.sizes), args.seed)


def images(dataset: Any, idx: np.ndarray) -> np.ndarray:
    n_train = len(dataset.y_train)
    train = idx < n_train
    out = np.empty((len(idx), *dataset.x_train.shape[1:]), dtype=dataset.x_train.dtype)
    out[train] = dataset.x_train[idx[train]]
    out[~train] = dataset.x_test[idx[~train] - n_train]
    return out


def labels(dataset: Any, idx: np.ndarray) -> np.ndarray:
    n_train = len(dataset.y_train)
    return np.where(
        idx < n_train,
        dataset.y_train[np.minimum(idx, n_train - 1)],
        dataset.y_test[np.maximum(idx - n_train, 0)],
    ).astype(np.int64)


def replicate_keys(
    z: np.ndarray, y: np.ndarray, n: int, *, noise: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """The first n keys; past the real ones, copies of them plus Gaussian noise of `noise` times
    each dimension's standard deviation (so no two keys coincide)."""
    if n <= len(z):
        return z[:n], y[:n]
    rng = np.random.default_rng(seed)
    reps = -(-n // len(z))
    zz = np.tile(z, (reps, 1))[:n].copy()
    yy = np.tile(y, reps)[:n].copy()
    scale = (noise * z.std(axis=0)).astype(np.float32)
    zz[len(z) :] += rng.standard_normal((n - len(z), z.shape[1])).astype(np.float32) * scale
    return zz, yy


# ----------------------------------------------------------------------------- datastores


def _protonn_gamma(z: np.ndarray, d: int, m: float, seed: int) -> float:
    """edgeml's median-heuristic gamma on a subsample: protonn.training computes it over all
    samples x all prototypes at once (memory n * m * d * 8 bytes), too much past a few thousand."""
    from protonn.training import median_heuristic_gamma, pca_projection

    rng = np.random.default_rng(seed)
    sub = z[rng.choice(len(z), size=min(len(z), 500), replace=False)].astype(np.float64)
    W = pca_projection(sub, d, rng)
    zp = sub @ W.T
    protos = zp[
        rng.choice(len(zp), size=max(1, min(len(zp), round(m * len(zp)), 150)), replace=False)
    ]
    return median_heuristic_gamma(zp, protos)


def build_datastore(
    recipe: str,
    z: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    *,
    seed: int = 0,
    protonn_steps: int = 50,
    k: int = DEFAULT_K,
    sigma: float = DEFAULT_SIGMA,
) -> Any:
    """A fitted datastore for a recipe. ProtoNN is trained with the protonn package (random
    prototype initialisation, `protonn_steps` Adam steps, gamma from a subsample), which keeps
    100k keys affordable; the shapes, not the trained values, set its cost."""
    name, params = parse_recipe(recipe)
    if not BACKENDS[name].TRAINED:
        return make_datastore(recipe, num_classes, k=k, sigma=sigma, seed=seed).fit(z, y)
    from protonn.training import ProtoNNClassifier

    d, m = int(params.get("d", 32)), float(params.get("m", 0.3))
    # edgeml's forward holds a [batch, d, prototypes] float32 tensor (and its gradient): keep it
    # near 128 MiB, i.e. batch 34 for 30k prototypes instead of 128 (about 500 MiB).
    prototypes = max(1, round(m * len(z)))
    batch = max(8, min(128, (1 << 27) // (4 * d * prototypes)))
    clf = ProtoNNClassifier(
        num_classes,
        projection_dim=d,
        prototype_fraction=m,
        init="random",
        steps=protonn_steps,
        batch_size=batch,
        seed=seed,
    )
    # the classifier's own gamma (its scale x the heuristic), the heuristic taken on a subsample
    clf.gamma = getattr(clf, "gamma_scale", 1.0) * _protonn_gamma(z, d, m, seed)
    return clf.fit(z, y).to_datastore(k=k, sigma=sigma, m=m, n=params.get("n"))


def write_benchmark_bundle(
    out_dir: Path,
    encoder: Path,
    datastore: Any,
    spec: dict,
    *,
    lam: float = 0.5,
    client_id: int = 0,
    budget_bytes: int | None = None,
    update_strategy: str | None = None,
    knn_choice: KNNProvenance | None = None,
) -> Manifest:
    """A bundle through edge_runtime.bundle.write_bundle; the budget defaults to what the files
    take with ample room (benchmarks measure speed and memory, not budget enforcement).
    `knn_choice`: the record of how the kNN setting was chosen, where the bundle keeps one."""
    if budget_bytes is None:
        budget_bytes = encoder.stat().st_size + 2 * int(datastore.nbytes) + (1 << 20)
    fields = BundleFields(
        client_id, InputSpec(spec), float(lam), int(budget_bytes), update_strategy, knn_choice
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return write_bundle(out_dir, fields, encoder, datastore)


def recipe_label(recipe: str) -> str:
    return parse_recipe(recipe)[0]


def recipe_counts(rows: Sequence[dict[str, Any]], top: int | None = None) -> str:
    """The chosen recipes' shapes (their key counts dropped), most frequent first, with how
    many rows chose each, e.g. "flat:int8 x12" (the `top` most frequent only)."""
    counts: dict[str, int] = {}
    for r in rows:
        shape = recipe_without(r["recipe"], "n")
        counts[shape] = counts.get(shape, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return "; ".join(f"{name} x{n}" for name, n in ranked)


def script_parser(
    doc: str, formatter: type[argparse.HelpFormatter] = argparse.ArgumentDefaultsHelpFormatter
) -> argparse.ArgumentParser:
    """A benchmark script's parser: its docstring's first line as the description."""
    return argparse.ArgumentParser(description=doc.splitlines()[0], formatter_class=formatter)


def device_parser(
    doc: str,
    formatter: type[argparse.HelpFormatter] = argparse.ArgumentDefaultsHelpFormatter,
    smoke: str = "tiny settings to check the pipeline",
) -> argparse.ArgumentParser:
    """The flags every device benchmark opens with: where to write, which model
    (load_global_model), the seed, and --smoke (whose `smoke` settings each script sets);
    each script adds its own."""
    p = script_parser(doc, formatter)
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument(
        "--run",
        default=None,
        help="run directory with a trained small CNN (default: random weights)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help=smoke)
    return p


def datastore_sizes_parser(doc: str, smoke: str) -> argparse.ArgumentParser:
    """The flags the latency and memory benchmarks share: device_parser's, which datastores at
    which sizes, the encoder and the keys; each script adds its own."""
    p = device_parser(doc, argparse.RawDescriptionHelpFormatter, smoke)
    p.add_argument(
        "--sizes",
        type=positive_int,
        nargs="+",
        default=[1000, 10_000, 100_000],
        help="datastore sizes (keys)",
    )
    p.add_argument(
        "--recipes",
        nargs="+",
        default=list(TYPICAL_RECIPES),
        help="datastore recipes, one per backend",
    )
    p.add_argument(
        "--encoder", choices=("int8", "fp32"), default="int8", help="the bundle's ONNX encoder"
    )
    p.add_argument(
        "--noise",
        type=float,
        default=0.01,
        help="noise (x per-dimension std) on keys replicated past the real images",
    )
    p.add_argument("--protonn-steps", type=positive_int, default=50)
    return p


def flower_parser(doc: str) -> argparse.ArgumentParser:
    """The parser of flower_rounds.py and flower_floor.py, with the configuration flags they
    share (the same rounds: trained by knnper's ClientApp, or echoed by the floor's empty one);
    the docstring's first paragraph is its description."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--tag", required=True, help="name of this configuration in the results")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--data", default=None)
    p.add_argument("--max-train", type=int, default=None)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--unseen-fraction", type=float, default=0.2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--round-timeout", type=float, default=600.0)
    p.add_argument(
        "--work",
        type=Path,
        default=Path("runs/flower_bench"),
        help="run directories (not committed)",
    )
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results" / "flower")
    return p


def flower_run_config(args: argparse.Namespace) -> Any:
    """The fed_train.run.RunConfig of add_flower_arguments' flags."""
    from fed_train.algorithms.base import TrainingConfig
    from fed_train.run import RunConfig

    return RunConfig(
        dataset=args.dataset,
        data=args.data,
        max_train=args.max_train,
        clients=args.clients,
        unseen_fraction=args.unseen_fraction,
        seed=args.seed,
        checkpoint_every=1,
        training=TrainingConfig(
            rounds=args.rounds,
            epochs=args.local_epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            momentum=args.momentum,
            milestones=(0.75,),
        ),
    )


def load_average() -> float:
    """The last minute's load average: how busy the machine was around a timing."""
    return os.getloadavg()[0]


def run_child(
    code: str,
    args: Sequence[str],
    *,
    threads: int,
    parse: Callable[[str], Any] = json.loads,
    timeout: float = 600,
) -> Any:
    """Run `python -c code args...` in a fresh process with `threads` BLAS/OpenMP threads and the
    repository on PYTHONPATH; returns parse(last line of its stdout)."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=child_env(threads),
        timeout=timeout,
    )
    _check_child(proc.returncode, proc.stderr)
    return parse(proc.stdout.strip().splitlines()[-1])


def child_env(threads: int) -> dict[str, str]:
    """A child process's environment: `threads` BLAS/OpenMP threads, the repository on
    PYTHONPATH."""
    env = dict(os.environ)
    for name in THREAD_ENV:
        env[name] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _check_child(returncode: int, stderr: str) -> None:
    if returncode != 0:
        last = (stderr.strip().splitlines() or ["no output on stderr"])[-1]
        raise RuntimeError(f"child process failed with exit code {returncode}: {last}")


def run_sampled(code: str, args: Sequence[str], threads: int) -> dict[str, Any]:
    """run_child, with the child's RssAnon sampled by this process about every millisecond
    while it runs: its result gains peak_private_kib."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args], stdout=out, stderr=err, env=child_env(threads)
        )
        peak, status = 0, Path(f"/proc/{proc.pid}/status")
        while proc.poll() is None:
            try:
                peak = max(peak, int(status.read_text().split("RssAnon:")[1].split()[0]))
            except (OSError, IndexError, ValueError):
                pass  # the process is starting or gone
            time.sleep(0.001)
        out.seek(0)
        err.seek(0)
        _check_child(proc.returncode, err.read())
        result = json.loads(out.read().strip().splitlines()[-1])
    # on a loaded machine this process may not be scheduled for tens of milliseconds and miss
    # the child's last moments: a child that reports its own RssAnon as it ends ("anon_kib")
    # bounds the peak from below (benchmarks/runtime_memory.py's children do)
    return {**result, "peak_private_kib": max(peak, int(result.get("anon_kib") or 0))}


def interleaved_times(
    paths: dict[str, Callable[[Any], Any]], inputs: Sequence[Any], reps: int, warmup: int
) -> dict[str, np.ndarray]:
    """Seconds of each call of each path on the same input, the paths alternating call by call
    (and which goes first, round by round), after `warmup` untimed rounds, with the garbage
    collector off: what one path pays, the others pay in the same seconds of a shared, noisy
    machine, so their ratio is fair."""
    names = list(paths)
    for i in range(warmup):
        for name in names:
            paths[name](inputs[i % len(inputs)])
    times = {name: np.empty(reps) for name in names}
    gc.collect()
    gc.disable()
    try:
        for i in range(reps):
            x = inputs[i % len(inputs)]
            for name in names if i % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                paths[name](x)
                times[name][i] = time.perf_counter() - start
    finally:
        gc.enable()
    return times


def encoder_alone(encoder: Path | str, spec: InputSpec, threads: int | None) -> Callable:
    """Raw inputs -> the encoder's own probabilities (lambda = 0), as the runtime loads an
    encoder without a datastore: what batch-1 ratios divide by (a bundle's session holds its
    kNN head too, so it would not time the encoder alone)."""
    session = Encoder(encoder, intra_op_threads=threads)
    return lambda x: softmax(session.run(prepare_input(x, spec))[1])


def interleaved_medians(
    paths: dict[str, Callable[[Any], Any]], inputs: Sequence[Any], reps: int, warmup: int
) -> dict[str, float]:
    """The median of each path's `interleaved_times`."""
    return {
        name: float(np.median(t))
        for name, t in interleaved_times(paths, inputs, reps, warmup).items()
    }
