"""Ctrl-C, once or again and again: worker processes never outlive their command, and the
command's own cleanup is not cut short by a second Ctrl-C."""

from __future__ import annotations

import io
import os
import signal
import time

import pytest

from fed_train.workers import CLEAR_LINE, OwnLines, ignoring_ctrl_c, worker_pool


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_ctrl_c_in_a_worker_pool_terminates_every_worker_at_once():
    pids: list[int] = []
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), worker_pool(2) as pool:
        futures = [pool.submit(time.sleep, 600) for _ in range(4)]
        while len(pool._processes) < 2 or any(not p.pid for p in pool._processes.values()):
            time.sleep(0.05)
        pids = [p.pid for p in pool._processes.values()]
        time.sleep(1.0)  # the workers are inside their 600 s job
        raise KeyboardInterrupt
    assert time.monotonic() - started < 120
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)
    assert all(f.cancelled() or f.done() for f in futures)


def test_workers_ignore_ctrl_c_sent_to_the_process_group():
    with worker_pool(1) as pool:
        pid = pool.submit(os.getpid).result()
        os.kill(pid, signal.SIGINT)  # what a terminal's Ctrl-C does to every process in it
        time.sleep(0.5)
        assert _alive(pid)
        assert pool.submit(sum, [1, 2]).result() == 3


def test_a_second_ctrl_c_does_not_cut_cleanup_short():
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest runs as a background job
    finished = False
    with ignoring_ctrl_c():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        finished = True
    assert finished
    assert signal.getsignal(signal.SIGINT) is before


def test_a_worker_line_on_a_terminal_clears_the_bar_it_lands_on():
    terminal = io.StringIO()
    lines = OwnLines(terminal)
    lines.write("WARNING one\nhalf")
    lines.write(" done\n")
    lines.write("two\n")
    assert terminal.getvalue() == (
        f"{CLEAR_LINE}WARNING one\n{CLEAR_LINE}half done\n{CLEAR_LINE}two\n"
    )
