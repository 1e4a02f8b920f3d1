"""Test-wide settings: one torch thread. The models here are tiny, and on a 2-core machine
shared with other work, intra-op threads cost more in contention than they save."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the CLI subprocesses

import torch  # noqa: E402

torch.set_num_threads(1)
