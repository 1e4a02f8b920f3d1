"""Writers go first (edge_runtime.locking): readers locking a bundle in tight loops must not
keep a writer out, the turnstile beside the bundle refuses links, and writers leave no
turnstile of their temporaries behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from edge_runtime.locking import LinkRefused, LockTimeout, directory_lock, turnstile_path
from tests.helpers.bundles import REPO

pytest.importorskip("fcntl")

READERS = 10
HOLD_SECONDS = 0.02  # what a reader holds its shared lock for: about one bundle load
WRITER_BOUND_SECONDS = 1.5  # the readers already inside take HOLD_SECONDS; slack for 2 cores

_READER = textwrap.dedent("""
    import os, sys, time
    from edge_runtime.locking import directory_lock
    directory, stop, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
    print("ready", flush=True)
    while not os.path.exists(stop):
        with directory_lock(directory, exclusive=False):
            time.sleep(hold)
""")


def test_a_writer_is_not_starved_by_readers_in_tight_loops(tmp_path):
    bundle, stop = tmp_path / "bundle", tmp_path / "stop"
    bundle.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", _READER, str(bundle), str(stop), str(HOLD_SECONDS)],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for _ in range(READERS)
    ]
    try:
        for reader in readers:
            assert reader.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # all of them looping
        waits = []
        for _ in range(3):
            start = time.monotonic()
            try:
                with directory_lock(bundle, exclusive=True, timeout=5.0):
                    waits.append(time.monotonic() - start)
            except LockTimeout:
                waits.append(float("inf"))
            time.sleep(0.2)
        assert max(waits) < WRITER_BOUND_SECONDS, waits
    finally:
        stop.touch()
        for reader in readers:
            try:
                reader.wait(timeout=10)
            except subprocess.TimeoutExpired:
                reader.kill()
                reader.wait(timeout=10)
    assert all(reader.returncode == 0 for reader in readers)


def test_a_turnstile_that_is_a_link_is_refused_not_followed(tmp_path):
    bundle, elsewhere = tmp_path / "bundle", tmp_path / "elsewhere"
    bundle.mkdir()
    elsewhere.write_text("")
    os.symlink(elsewhere, turnstile_path(bundle))
    with pytest.raises(LinkRefused), directory_lock(bundle, exclusive=False):
        pass
    os.unlink(turnstile_path(bundle))
    os.link(elsewhere, turnstile_path(bundle))  # a hard link: two names, refused too
    with pytest.raises(LinkRefused), directory_lock(bundle, exclusive=True):
        pass
    assert elsewhere.read_text() == ""


@pytest.mark.parametrize("exclusive", [False, True])
def test_a_turnstile_that_is_a_socket_is_refused_as_such(tmp_path, exclusive):
    """Opening a socket fails with ENXIO: the line said 'No such device or address'."""
    import socket

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    with socket.socket(socket.AF_UNIX) as planted:
        planted.bind(turnstile_path(bundle))
        with pytest.raises(LinkRefused, match="is not a plain lock file"):
            with directory_lock(bundle, exclusive=exclusive):
                pass


def test_the_turnstile_is_a_hidden_sibling_and_the_bundle_stays_clean(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    with directory_lock(bundle, exclusive=True):
        pass
    assert Path(turnstile_path(bundle)) == tmp_path / ".bundle.lock"
    assert (tmp_path / ".bundle.lock").is_file() and not any(bundle.iterdir())


def test_without_a_writable_parent_the_directory_lock_alone_orders(tmp_path, monkeypatch):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    real_open = os.open

    def read_only_parent(path, flags, *args):  # as root, chmod would not stop the creation
        if os.fspath(path) == turnstile_path(bundle) and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only_parent)
    with directory_lock(bundle, exclusive=True):
        with pytest.raises(LockTimeout), directory_lock(bundle, exclusive=False, timeout=0.05):
            pass
    assert not os.path.exists(turnstile_path(bundle))


def test_a_reader_writes_nothing_beside_the_bundle(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    with directory_lock(bundle, exclusive=False):
        pass
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]
