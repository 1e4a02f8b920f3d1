"""Thread counts for the runtime's numpy BLAS calls (the datastore scans).

OpenBLAS uses every core by default and busy-waits between calls; at batch 1 on a loaded device
that made a 10k-key scan about 8x slower than one thread. The runtime runs its BLAS calls under
`BlasThreads(n)`, which sets the count for the duration of the call and restores the caller's
afterwards, so an application that embeds the runtime keeps its own setting.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

from threadpoolctl import ThreadpoolController

# Fastest at batch 1 on the machines measured (benchmarks/results/runtime/latency.md).
DEFAULT_THREADS = 1


@functools.cache
def _blas_controller():
    """The process's BLAS libraries, found once (scanning the loaded libraries takes ms)."""
    return ThreadpoolController().select(user_api="blas")


class BlasThreads:
    """Context manager factory: `with blas_threads(): ...` runs with `threads` BLAS threads and
    puts back the libraries' own counts after; threads=None leaves them alone. Only libraries
    whose count differs are touched (threadpoolctl's own limit context costs ~10 us a call)."""

    def __init__(self, threads: int | None = DEFAULT_THREADS) -> None:
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"blas threads must be a positive integer or None, got {threads!r}")
        self.threads = threads
        self._libraries = _blas_controller().lib_controllers if threads is not None else []

    @contextmanager
    def __call__(self) -> Iterator[None]:
        changed = []
        for library in self._libraries:
            current = library.get_num_threads()
            if current != self.threads:
                library.set_num_threads(self.threads)
                changed.append((library, current))
        try:
            yield
        finally:
            for library, current in changed:
                library.set_num_threads(current)
