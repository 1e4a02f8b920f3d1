"""Progress in a log file: plain lines (no carriage returns), one at least every interval even
while a single unit runs long, and a time left that is the measured time per unit of work times
the work left."""

from __future__ import annotations

import io
import time

import pytest

from fed_train import progress as progress_module
from fed_train.progress import Progress, duration, track


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_a_log_gets_lines_while_one_slow_unit_runs():
    stream = io.StringIO()
    with Progress(3, desc="train", unit="round", every_s=0.2, stream=stream):
        time.sleep(1.0)  # the first round, running long
    text = stream.getvalue()
    lines = text.splitlines()
    assert "\r" not in text
    assert len(lines) >= 2
    assert all(
        line.startswith("train: 0/3 rounds done") and "no estimate until the first round" in line
        for line in lines
    )


def test_time_left_is_measured_time_per_work_times_work_left(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(progress_module, "time", clock)
    stream = io.StringIO()
    work = [1, 1, 1, 5]
    bar = Progress(
        4, desc="export", unit="client", stream=stream, every_s=3600, total_work=sum(work)
    )
    for share in work[:3]:
        clock.now += 10.0
        bar.update(share)
    assert bar.line() == (
        "export: 3/4 clients done, 30s elapsed, about 50s left (measured 10s per client over 3)"
    )
    clock.now += 50.0
    bar.update(work[3])
    bar.close()
    assert stream.getvalue().splitlines()[-1] == "export: 4/4 clients done in 1m20s"


def test_a_resumed_command_estimates_from_this_call_only(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(progress_module, "time", clock)
    bar = Progress(10, desc="train", unit="round", initial=6, stream=io.StringIO(), every_s=3600)
    clock.now += 4.0
    bar.update()
    assert "7/10 rounds done" in bar.line() and "about 12s left" in bar.line()
    bar.close()


def test_track_yields_every_item_and_disabled_prints_nothing(capsys):
    assert list(track(range(3), total=3, desc="eval", unit="client", enabled=False)) == [0, 1, 2]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("seconds,text", [(7.2, "7s"), (90, "1m30s"), (4000, "1h06m40s")])
def test_duration(seconds, text):
    assert duration(seconds) == text


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_estimates_from_this_calls_units_not_the_ones_read_back(monkeypatch):
    # a resumed table: 3 jobs read back at once, then one job of this call takes a minute;
    # tqdm's own rate would time the 3 read-back jobs too and promise a few minutes for 31 jobs
    clock = FakeClock()
    monkeypatch.setattr(progress_module, "time", clock)
    terminal = _Terminal()
    bar = Progress(35, desc="bench table", unit="job", stream=terminal)
    assert "no estimate until the first job finishes" in terminal.getvalue()
    for _ in range(3):
        bar.update(measured=False)
    clock.now += 60.0
    bar.update()
    bar.close()
    assert terminal.getvalue().rstrip().endswith("4/35 [00:00, about 31m00s left]")
