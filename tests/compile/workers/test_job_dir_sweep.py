"""The sweep of dead compile jobs (workers/job_dirs.py `sweep_dead_jobs`) runs in a
temporary directory every user of the node shares: it never opens another user's files,
never follows a link, never blocks on what someone planted there (a FIFO as a job's owner
file would hold its open, and with it the upkeep's tier-wide lock, for good), and never
removes what is not its own.

The other user is real: entries are given to uid 65534 (``nobody``) with ``os.chown`` (the
tests run as root). The sweep runs in a thread that says when it is done; the test waits for
that, bounded, and fails rather than hangs (a blocked open is then released by the test).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from pathlib import Path

import pytest
from cache_workers import SAFETY

from vllm_neuron.compile.workers import job_dirs

OTHER_UID = 65534  # nobody
BOUND = 60.0  # seconds: a sweep of a handful of entries that takes this long is blocked

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user "
                                "(chown) needs root")  # fmt: skip


def _job(root: Path, name: str, owner: str, uid: int | None = None) -> Path:
    """A job directory `name` whose owner file is `owner` ("file", "fifo", "link", "none"),
    given with its contents to `uid` when set; old enough to be swept when ownerless."""
    job = root / f"{job_dirs.JOB_PREFIX}{name}"
    job.mkdir(mode=0o700)
    path = job / job_dirs.OWNER
    if owner == "file":
        path.write_bytes(b"")  # unlocked: its process would be gone
    elif owner == "fifo":
        os.mkfifo(path)
    elif owner == "link":
        path.symlink_to(root / "bait")
    if uid is not None:
        for item in (path, job) if owner != "none" else (job,):
            os.chown(item, uid, uid, follow_symlinks=False)
    old = time.time() - 2 * job_dirs.ORPHAN_AGE
    os.utime(job, (old, old))
    return job


def _sweep_bounded() -> None:
    """`sweep_dead_jobs` in a thread, its end waited for at most `BOUND` seconds."""
    done = threading.Event()

    def sweep() -> None:
        job_dirs.sweep_dead_jobs()
        done.set()

    threading.Thread(target=sweep, daemon=True, name="test-sweep").start()
    assert done.wait(BOUND), f"the sweep did not finish within {BOUND:.0f} s: it blocked"


def _release_fifos(*fifos: Path) -> None:
    """Open each FIFO's write end once: a reader blocked in its open (a sweep without the
    protection) returns, so a failed test leaves no thread stuck."""
    for fifo in fifos:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_the_sweep_never_opens_blocks_on_or_removes_what_is_not_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(job_dirs, "_swept", False)
    (tmp_path / "bait").write_bytes(b"")  # a file of ours a link points at
    fifo_ours = _job(tmp_path, "1_fifo", "fifo")  # our directory, a FIFO planted as owner
    fifo_theirs = _job(tmp_path, "2_fifo", "fifo", OTHER_UID)
    theirs_dead = _job(tmp_path, "3_dead", "file", OTHER_UID)  # unlocked: looks dead
    theirs_old = _job(tmp_path, "4_old", "none", OTHER_UID)  # ownerless and old
    linked = _job(tmp_path, "5_link", "link")  # owner a link to a file of ours
    ours_dead = _job(tmp_path, "6_dead", "file")  # a dead job of ours: swept
    try:
        _sweep_bounded()
    finally:
        _release_fifos(fifo_ours / job_dirs.OWNER, fifo_theirs / job_dirs.OWNER)
    for kept in (fifo_ours, fifo_theirs, theirs_dead, theirs_old, linked):
        assert kept.exists(), kept
    assert not ours_dead.exists()


def test_a_fifo_in_a_job_directory_does_not_stall_the_upkeep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compile_fn
) -> None:
    """The upkeep pass sweeps while it holds the tier's upkeep lock: it finishes (and a
    later pass can take the lock) with a FIFO planted where a job's owner file would be."""
    from vllm_neuron.compile.flow.cache import TwoTierCache

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    fifos = [_job(temp, "7_fifo", "fifo", OTHER_UID) / job_dirs.OWNER,
             _job(temp, "8_fifo", "fifo") / job_dirs.OWNER]  # fmt: skip
    monkeypatch.setattr(job_dirs, "_swept", False)
    key = "cd" * 16
    cache = TwoTierCache(str(tmp_path / "local"))
    try:
        cache.get_or_compile(key, compile_fn(key))
        assert cache.wait_for_upkeep(timeout=min(SAFETY, BOUND)), "the upkeep pass blocked"
    finally:
        _release_fifos(*fifos)
    assert all(fifo.parent.exists() for fifo in fifos)
