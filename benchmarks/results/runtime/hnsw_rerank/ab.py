"""Batch-1 and batch-256 predict_proba of an HNSW datastore, interleaved in one process: 67ee0d0's
kneighbors (hnswlib's k best, measured again), 304e762's (2k candidates, all measured again) and
the working tree's (2k candidates, those near the k-th measured again).

    python benchmarks/results/runtime/hnsw_rerank/ab.py      # from the repository's root
"""

import importlib.util
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, ".")
import edge_runtime.datastores.hnsw as now


def load(rev):
    source = subprocess.run(
        ["git", "show", f"{rev}:edge_runtime/datastores/hnsw.py"], capture_output=True, check=True
    ).stdout
    path = tempfile.NamedTemporaryFile(suffix=".py", delete=False)
    path.write(source)
    path.close()
    spec = importlib.util.spec_from_file_location(f"edge_runtime.datastores.h{rev}", path.name)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


variants = {"67ee0d0": load("67ee0d0"), "304e762": load("304e762"), "now": now}
rng = np.random.default_rng(0)
print(platform.processor() or open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0])
for n in (1000, 20000):
    z = rng.normal(size=(n, 128)).astype(np.float32)
    y = rng.integers(0, 10, n)
    ds = {k: m.HNSWDatastore(10, k=10).fit(z, y) for k, m in variants.items()}
    qs = rng.normal(size=(500, 128)).astype(np.float32)
    for batch in (1, 256):
        t = {k: [] for k in ds}
        reps = 500 if batch == 1 else 6
        for r in range(reps):
            q = qs[r : r + 1] if batch == 1 else qs[:256]
            names = list(ds)[r % 3 :] + list(ds)[: r % 3]
            for name in names:
                t0 = time.perf_counter()
                ds[name].predict_proba(q)
                t[name].append(time.perf_counter() - t0)
        med = {k: np.median(v) * 1e3 for k, v in t.items()}
        print(
            f"n={n} batch={batch}: "
            + ", ".join(f"{k} {v:.3f} ms ({v / med['67ee0d0']:.2f})" for k, v in med.items())
        )
print("load", open("/proc/loadavg").read().split()[:3])
