"""Peak memory of a fresh device process that loads one bundle and predicts, for
flat, hnsw and protonn datastores, with torch processes measured alongside for reference: peak
RSS, and peak private (anonymous) memory above the fixed floor, the memory a bundle costs.

    python benchmarks/runtime_memory.py --out OUT [--run RUN] [--threads 1]
    python benchmarks/runtime_memory.py --smoke --out OUT          # tiny sizes: checks the pipeline

Bundles are built as in runtime_latency.py (small CNN, int8 ONNX encoder, keys = embeddings of
Fashion-MNIST images, copies plus noise past the real images). Each measurement is a new
`python -c` process, so nothing the parent imported counts:
- runtime: imports numpy and edge_runtime only, Runtime.load(bundle), predict_proba on one
  batch of uint8 images, then reports its peak RSS and which server-side packages (torch,
  sklearn, edgeml, ...) ended up imported (none should). The peak is VmHWM from
  /proc/self/status: getrusage's ru_maxrss would also hold the parent's peak, which Linux
  carries into a child over fork + exec (it is still recorded, in memory.csv).
- references: a bare interpreter; numpy + onnxruntime imported; torch imported; the torch
  float32 small CNN built and run on the same batch (random weights: memory does not depend
  on their values).

Peak private memory: RssAnon of /proc/<pid>/status (anonymous pages: heaps, arenas, arrays;
not the file-backed code pages of the shared libraries, which the kernel can drop and share),
sampled by the parent about every millisecond while the child runs (a shorter spike can be
missed). The floor: a process with Python, numpy, onnxruntime and the runtime's modules
imported and one onnxruntime session of a one-node model made, the fixed cost of any bundle.

Targets: at most 80 MB (80e6 bytes) for the small CNN; for flat and ProtoNN
bundles the peak private memory above the floor stays within the bundle's budget_bytes + 2 MiB
(each bundle written with the tightest budget the exporter's memory model gives it: the encoder
plus the datastore's estimate_nbytes, which counts its files, what the search holds beside them
and its intermediates past the 2 MiB; the budget bounds memory as well as files), and an HNSW
bundle's load peaks at most 1.2x its files. Outputs in OUT:
memory.csv, memory.md (table, command line, machine), run.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime.preprocess import prepare_input
from experiments import benchmark_support as C
from export.sizing import measure_nbytes

log = logging.getLogger("benchmarks.memory")

SERVER_SIDE = ("torch", "sklearn", "edgeml", "fed_train", "export", "protonn", "scipy")

# Children print one JSON line. ru_maxrss (KiB on Linux) is not used as the measure: Linux
# carries the parent's peak RSS over fork/vfork + exec into the child's ru_maxrss (a bare
# `python -c` child of a process holding 400 MB reports 400 MB), so the child reads its own
# peak, VmHWM of /proc/self/status, which starts afresh at exec. ru_maxrss is kept in the CSV,
# and is the fallback where /proc is missing.
_REPORT = """
import json, resource, sys
def status_kib(field):
    try:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith(field)).split()[1])
    except (OSError, StopIteration, ValueError):
        return None
def report(**extra):
    heavy = sorted(m for m in SERVER_SIDE if m in sys.modules)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"vmhwm_kib": status_kib("VmHWM:"), "maxrss_kib": maxrss,
                      "anon_kib": status_kib("RssAnon:"),
                      "server_side_imported": heavy, **extra}))
""".replace("SERVER_SIDE", repr(SERVER_SIDE))

CHILD_BARE = _REPORT + "report()\n"
CHILD_NUMPY_ORT = _REPORT + "import numpy, onnxruntime\nreport()\n"
CHILD_TORCH_IMPORT = _REPORT + "import torch\nreport()\n"
# onnxruntime's first session costs about 9 MiB whatever the model (kernel registries and library
# pages touched): measured with a one-node model, so the rows can be read without it too.
_ONE_SESSION = """
options = ort.SessionOptions()
options.intra_op_num_threads = 1
ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
report()
"""
CHILD_ORT_SESSION = _REPORT + "\nimport numpy, onnxruntime as ort" + _ONE_SESSION
# The fixed floor: everything a bundle needs before its own bytes (the runtime's modules, which
# import hashlib/OpenSSL among others, and onnxruntime's first session).
CHILD_FLOOR = (
    _REPORT
    + "\nimport numpy, onnxruntime as ort\nimport edge_runtime.runtime, edge_runtime.cli"
    + _ONE_SESSION
)

CHILD_RUNTIME = (
    _REPORT
    + """
import time
import numpy as np
from edge_runtime.runtime import Runtime
bundle, inputs, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
t0 = time.perf_counter()
rt = Runtime.load(bundle, intra_op_threads=threads)
load_s = time.perf_counter() - t0
x = np.load(inputs, allow_pickle=False)
t0 = time.perf_counter()
p = rt.predict_proba(x)
report(load_s=load_s, predict_s=time.perf_counter() - t0, shape=list(p.shape))
"""
)

CHILD_TORCH_MODEL = (
    _REPORT
    + """
import numpy as np
import torch
from edge_runtime.preprocess import prepare_input
from fed_train.models import build_model
spec, inputs, threads = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
torch.set_num_threads(threads)
model = build_model("small-cnn", int(sys.argv[4]), spec).eval()
x = np.load(inputs, allow_pickle=False)
with torch.inference_mode():
    logits = model.head(model.embed(torch.from_numpy(prepare_input(x, spec))))
report(shape=list(logits.shape))
"""
)

BUDGET_SLACK_MIB = 8  # target: peak RSS above the bare process <= budget + 8 MiB
PRIVATE_SLACK_MIB = 2  # target: peak private memory above the floor <= budget + 2 MiB
HNSW_LOAD_OVER_FILE = 1.2  # target: an HNSW bundle's load peak <= 1.2x its files

COLUMNS = (
    "process backend recipe keys stored batch peak_rss_mib peak_rss_mb within_target "
    "above_bare_mib budget_bytes budget_mib within_budget above_session_mib "
    "within_budget_past_session peak_private_mib private_above_floor_mib "
    "within_budget_private private_over_files peak_source ru_maxrss_mib server_side_imported "
    "load_s predict_s encoder_bytes datastore_bytes bundle_bytes"
).split()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = C.datastore_sizes_parser(
        __doc__, "tiny settings (200 keys, batch 1) to check the pipeline end to end"
    )
    p.add_argument(
        "--batches",
        type=C.positive_int,
        nargs="+",
        default=[1, 256],
        help="batch sizes of the one prediction each child makes",
    )
    p.add_argument("--threads", type=C.positive_int, default=1)
    p.add_argument(
        "--target-mb", type=float, default=80.0, help="peak RSS target in MB (1e6 bytes)"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.sizes, args.batches, args.protonn_steps = [200], [1], 5
    return args


def rss_row(result: dict[str, Any], target_mb: float, **fields: Any) -> dict[str, Any]:
    kib = int(result["vmhwm_kib"] if result.get("vmhwm_kib") else result["maxrss_kib"])
    mb = kib * 1024 / 1e6
    return {
        **fields,
        "peak_rss_mib": kib / 1024,
        "peak_rss_mb": mb,
        "peak_source": "VmHWM" if result.get("vmhwm_kib") else "ru_maxrss",
        "ru_maxrss_mib": int(result["maxrss_kib"]) / 1024,
        "within_target": "yes" if mb <= target_mb else "no",
        "server_side_imported": " ".join(result.get("server_side_imported", [])) or "none",
        "peak_private_mib": result["peak_private_kib"] / 1024
        if result.get("peak_private_kib")
        else None,
        "load_s": result.get("load_s"),
        "predict_s": result.get("predict_s"),
    }


def _against_budget(
    peak_mib: float, bare_mib: float, session_mib: float, budget: int
) -> dict[str, Any]:
    limit = budget / 2**20 + BUDGET_SLACK_MIB
    above, past_session = peak_mib - bare_mib, peak_mib - session_mib
    return {
        "above_bare_mib": above,
        "budget_bytes": budget,
        "budget_mib": budget / 2**20,
        "within_budget": "yes" if above <= limit else "no",
        "above_session_mib": past_session,
        "within_budget_past_session": "yes" if past_session <= limit else "no",
    }


def _private(
    peak_mib: float, floor_mib: float, budget: int, files: int, backend: str
) -> dict[str, Any]:
    above = peak_mib - floor_mib
    if backend == "hnsw":
        ratio = above * 2**20 / files
        ok = ratio <= HNSW_LOAD_OVER_FILE
    else:
        ratio, ok = None, above <= budget / 2**20 + PRIVATE_SLACK_MIB
    return {
        "private_above_floor_mib": above,
        "within_budget_private": "yes" if ok else "no",
        "private_over_files": ratio,
    }


def _one_node_model(work: Path) -> Path:
    from onnx import TensorProto, helper, save

    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "one",
        [value],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    work.mkdir(parents=True, exist_ok=True)
    save(model, work / "one_node.onnx")
    return work / "one_node.onnx"


def reference_rows(
    args: argparse.Namespace, work: Path, inputs: dict[int, Path], gm: Any
) -> tuple[list[dict[str, Any]], tuple[float, float, float]]:
    """The processes a bundle's is measured against: bare Python and its imports, one
    onnxruntime session, the runtime's floor, and the torch model predicting; and the three
    baselines (numpy + onnxruntime RSS, one session's RSS, the floor's private MiB)."""
    target, rows = args.target_mb, []
    references = [
        ("python (bare)", CHILD_BARE),
        ("python + numpy + onnxruntime imported", CHILD_NUMPY_ORT),
    ]
    if not args.smoke:  # the torch model row below imports torch too
        references.append(("python + torch imported", CHILD_TORCH_IMPORT))
    for name, code in references:
        rows.append(rss_row(C.run_sampled(code, [], threads=args.threads), target, process=name))
        log.info("%s: %.1f MiB", name, rows[-1]["peak_rss_mib"])
    bare_mib = rows[1]["peak_rss_mib"]  # numpy + onnxruntime imported
    one_node = [str(_one_node_model(work))]
    for code, process in (
        (CHILD_ORT_SESSION, "python + numpy + onnxruntime + one one-node session"),
        (
            CHILD_FLOOR,
            "floor: python + numpy + onnxruntime + runtime modules + one one-node session",
        ),
    ):
        result = C.run_sampled(code, one_node, threads=args.threads)
        rows.append(rss_row(result, target, process=process))
    session_mib, floor_mib = rows[-2]["peak_rss_mib"], rows[-1]["peak_private_mib"]
    log.info("floor: %.1f MiB private, %.1f MiB RSS", floor_mib, rows[-1]["peak_rss_mib"])
    for b in args.batches:
        child_args = [json.dumps(gm.spec), str(inputs[b]), str(args.threads), str(gm.num_classes)]
        result = C.run_sampled(CHILD_TORCH_MODEL, child_args, threads=args.threads)
        process = "torch small CNN (float32) predicts"
        rows.append(rss_row(result, target, process=process, batch=b))
        log.info("torch model, batch %d: %.1f MiB", b, rows[-1]["peak_rss_mib"])
    return rows, (bare_mib, session_mib, floor_mib)


def bundle_rows(
    recipe: str,
    keys: tuple[np.ndarray, np.ndarray],
    encoder: Path,
    work: Path,
    inputs: dict[int, Path],
    gm: Any,
    args: argparse.Namespace,
    baselines: tuple[float, float, float],
) -> list[dict[str, Any]]:
    """A bundle of `recipe` over `keys` at the tightest budget the exporter's memory model
    gives it, loaded and predicting in a fresh process at every batch size."""
    (z, y), (bare_mib, session_mib, floor_mib) = keys, baselines
    backend = C.recipe_label(recipe)
    ds = C.build_datastore(
        recipe, z, y, gm.num_classes, seed=args.seed, protonn_steps=args.protonn_steps
    )
    path = work / "bundles" / f"{backend}-{len(z)}"
    # the tightest budget the exporter's memory model (estimate_nbytes) gives it,
    # and at least its files (an estimate for hnsw)
    budget = encoder.stat().st_size + max(measure_nbytes(ds), ds.nbytes)
    manifest = C.write_benchmark_bundle(path, encoder, ds, gm.spec, budget_bytes=budget)
    fp, rows = manifest.footprint, []
    for b in args.batches:
        result = C.run_sampled(
            CHILD_RUNTIME, [str(path), str(inputs[b]), str(args.threads)], threads=args.threads
        )
        peak = rss_row(result, args.target_mb)["peak_rss_mib"]
        private = result["peak_private_kib"] / 1024
        rows.append(
            rss_row(
                result,
                args.target_mb,
                process="edge runtime loads bundle and predicts",
                backend=backend,
                recipe=manifest.recipe,
                keys=len(z),
                stored=len(ds),
                batch=b,
                encoder_bytes=fp.encoder,
                datastore_bytes=fp.datastore,
                bundle_bytes=fp.total,
                **_against_budget(peak, bare_mib, session_mib, budget),
                **_private(private, floor_mib, budget, fp.total, backend),
            )
        )
        log.info(
            "%s x %d, batch %d: %.1f MiB (server-side imports: %s)",
            recipe,
            len(z),
            b,
            rows[-1]["peak_rss_mib"],
            rows[-1]["server_side_imported"],
        )
    shutil.rmtree(path, ignore_errors=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started, machine, gm, pool = C.start_device_benchmark(
        args, threads=args.threads, queries=max(args.batches), smoke_train=1000
    )
    with tempfile.TemporaryDirectory(prefix="knnper-memory-", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        inputs = {b: work / f"inputs_{b}.npy" for b in args.batches}
        for b, path in inputs.items():
            np.save(path, pool.queries[:b], allow_pickle=False)
        rows, baselines = reference_rows(args, work, inputs, gm)
        calib_idx = pool.pool_idx[: 64 if args.smoke else 256]
        calib = prepare_input(C.images(gm.dataset, calib_idx), gm.spec)
        encoder = C.export_encoder(gm.model, calib, work / "encoder", encoder=args.encoder)
        shipped = C.shipped_encoder(encoder)
        for size in args.sizes:
            keys = C.replicate_keys(pool.z, pool.y, size, noise=args.noise, seed=args.seed)
            for recipe in args.recipes:
                rows += bundle_rows(recipe, keys, shipped, work, inputs, gm, args, baselines)

    text = report(rows, args, gm.source, machine, time.time() - started)
    C.write_results(
        args,
        started,
        text,
        report="memory.md",
        record="run.json",
        tables={"memory.csv": (rows, COLUMNS)},
        machine=machine,
        weights=gm.source,
    )
    bad = [r for r in rows if r.get("backend") and r["server_side_imported"] != "none"]
    if bad:
        log.error("the edge runtime imported server-side packages: %s", bad[0])
        return 1
    return 0


def report(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    weights: str,
    machine: dict,
    seconds: float,
) -> str:
    table = C.markdown_table(
        rows,
        [
            ("process", "process", ""),
            ("recipe", "recipe", ""),
            ("keys", "keys", ","),
            ("batch", "batch", ""),
            ("peak_rss_mib", "peak RSS MiB", ".1f"),
            ("peak_rss_mb", "peak RSS MB", ".1f"),
            ("within_target", f"<= {args.target_mb:g} MB", ""),
            ("above_bare_mib", "above numpy+ort MiB", ".1f"),
            ("budget_mib", "budget MiB", ".2f"),
            ("within_budget", f"<= budget + {BUDGET_SLACK_MIB} MiB", ""),
            ("above_session_mib", "above one session MiB", ".1f"),
            ("within_budget_past_session", "<= budget + 8 MiB past one session", ""),
            ("peak_private_mib", "peak private MiB", ".1f"),
            ("private_above_floor_mib", "private above floor MiB", ".2f"),
            ("private_over_files", "hnsw: above floor / files", ".2f"),
            ("within_budget_private", "<= budget + 2 MiB (hnsw: <= 1.2x files)", ""),
            ("server_side_imported", "server-side imports", ""),
            ("bundle_bytes", "bundle bytes", ","),
        ],
    )
    return "\n".join(
        [
            "# Edge runtime peak memory: one fresh process per row",
            "",
            f"Command: `{C.command_line()}`",
            "",
            f"Machine: {C.machine_line(machine)}. Threads: {args.threads}. Took {seconds:.0f} s.",
            "",
            f"Weights: {weights}. Encoder: {args.encoder} ONNX. Peak RSS = the child process's "
            "VmHWM (/proc/self/status), its own peak since exec; its ru_maxrss (in memory.csv) "
            "also holds the parent's peak, which Linux carries over fork + exec. MiB = 2^20 "
            "bytes, MB = 10^6 bytes. Above numpy+ort = peak RSS minus that of a bare process with "
            "numpy and onnxruntime imported; above one session = minus that of a process that has "
            "also made one onnxruntime session of a one-node model (onnxruntime's fixed cost of a "
            "first session). Peak private = the child's RssAnon (anonymous memory), sampled by the "
            "parent about every millisecond; above floor = minus that of the floor process "
            "(python + numpy + onnxruntime + the runtime's modules + one one-node session). "
            "Each bundle's budget is the tightest "
            "the exporter's memory model gives it (encoder file + the datastore's estimate_nbytes: "
            "files, what the search holds beside them, intermediates past the 2 MiB); flat keys "
            "stay in their stored dtype in memory.",
            "",
            table,
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
