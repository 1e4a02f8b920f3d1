"""A script run as `python SCRIPT ARGS` runs it, in the test's process: torch and the project are
imported once for every script a test module runs, not once a script (about 4 CPU seconds)."""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from threadpoolctl import threadpool_limits


def run_as_main(script: Path, args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`python SCRIPT ARGS` from CWD with OMP_NUM_THREADS=1, in this process; its exit code.
    The process-wide settings a script may change (the environment, e.g. the thread counts
    benchmark_support.limit_threads exports; torch's threads; the SIGTERM and SIGINT handlers)
    are put back after it."""
    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(script.parent))  # what `python SCRIPT` puts first
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    environment = dict(os.environ)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):  # numpy's BLAS too, as OMP_NUM_THREADS=1 at its start
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exited:
        return exited.code
    finally:
        os.environ.clear()
        os.environ.update(environment)
        torch.set_num_threads(threads)
        for number, handler in handlers.items():
            signal.signal(number, handler)
    return 0
