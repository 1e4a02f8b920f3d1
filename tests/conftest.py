"""Test-wide settings: one torch thread, and no accelerator unless the run selects `-m gpu`.

One thread: the models here are tiny, and on a 2-core machine shared with other work, intra-op
threads cost more in contention than they save. No accelerator: `--device auto` would take a GPU
where there is one, and the bit-exact checks (resume with atol=0, stepping within 1e-5) pin the
CPU's arithmetic; the GPU's is compared with it, within stated tolerances, in test_gpu.py."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the CLI subprocesses

try:  # the device tests also run where only the runtime is installed (.ci/device_pythons)
    import torch  # noqa: E402
except ModuleNotFoundError:
    torch = None
else:
    torch.set_num_threads(1)


def selects_gpu(markexpr: str) -> bool:
    """Whether a `-m` expression asks for the gpu tests (`-m gpu`, `-m "gpu or slow"`), as
    opposed to leaving them out (`-m "not gpu"`) or not naming them."""
    words = markexpr.replace("(", " ").replace(")", " ").split()
    return any(w == "gpu" and (i == 0 or words[i - 1] != "not") for i, w in enumerate(words))


def pytest_configure(config: pytest.Config) -> None:
    # before anything initialises CUDA (torch reads the variable then); subprocesses inherit it
    if not selects_gpu(config.getoption("markexpr") or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
