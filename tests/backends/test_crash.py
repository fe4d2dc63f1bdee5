"""Crashes heal themselves: a SIGKILLed lock holder, a writer that exits without closing.

No bound on how long healing takes (a loaded machine only makes it slower): a dead
holder's kernel lock is free the moment the holder is reaped, and a dead holder's lease is
free one period after the waiter saw its last renewal, on the waiter's monotonic clock (the
holder and the waiter share a wall clock here, so its last record's expiry is a bound too).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from store_worker import RaceEvent
from worker_pool import Workers

from vllm_neuron.backends import KernelLock, LeaseLock, LockTimeout, open_store
from vllm_neuron.backends.testing import HANG, lease_record

LEASE = 3.0  # seconds; the holder renews every LEASE / 3


@pytest.mark.timeout(2 * HANG)
def test_killed_kernel_lock_holder_frees_the_lock_at_once(
    tmp_path: Path, workers: Workers
) -> None:
    url = str(tmp_path / "store")
    store = open_store(url, profile="local")
    holder = workers.start("hold", url, {"profile": "local"}, name="compile/abc")
    assert holder.message()["ready"] is True
    lock = store.lock("compile/abc")
    assert isinstance(lock, KernelLock)
    with pytest.raises(LockTimeout):
        lock.acquire(timeout=0.2)  # really held by the other process
    holder.kill()  # returns once the holder is reaped: the kernel has closed its files
    lock.acquire(timeout=0)  # one try: free at once, no waiting
    lock.release()


def _lease_takeover_after_kill(url: str, options: dict[str, str], workers: Workers) -> None:
    store = open_store(url, **options)
    holder = workers.start("hold", url, options, name="compile/abc", lease_duration=LEASE)
    ready = holder.message()
    lock = store.lock("compile/abc", lease_duration=LEASE)
    assert isinstance(lock, LeaseLock)
    # The holder's heartbeat keeps it alive: refused until after its first expiry (every
    # look sees a renewal within a period of the one before).
    first = lease_record(lock)
    assert first["generation"] == ready["generation"]
    while True:
        now = time.time()
        with pytest.raises(LockTimeout):
            lock.acquire(timeout=0)
        if now > first["expires"]:
            break
        time.sleep(LEASE / 20)
    holder.kill()
    killed = time.time()
    last = lease_record(lock)  # the dead holder's final renewal
    assert last["generation"] == ready["generation"] and last["expires"] > first["expires"]
    lock.acquire(timeout=HANG)
    try:
        # Free one period after the waiter saw the last renewal: not before that renewal's
        # expiry (it was seen after it was written), at most about a lease after the kill.
        assert last["expires"] <= killed + LEASE
        assert time.time() >= last["expires"], "taken over before the lease ran out"
        assert lock.generation == ready["generation"] + 1
        lock.check()
    finally:
        lock.release()


@pytest.mark.timeout(2 * HANG)
def test_killed_lease_holder_expires_within_one_lease_nfs_profile(
    tmp_path: Path, workers: Workers
) -> None:
    _lease_takeover_after_kill(str(tmp_path / "store"), {"profile": "nfs"}, workers)


@pytest.mark.timeout(2 * HANG)
def test_killed_lease_holder_expires_within_one_lease_s3(
    s3_env: str, s3_store_url: str, workers: Workers
) -> None:
    _lease_takeover_after_kill(s3_store_url, {}, workers)


@pytest.mark.timeout(2 * HANG)
@pytest.mark.parametrize("kind", ["local", "nfs", "s3"])
def test_event_log_lines_survive_os_exit(
    kind: str, tmp_path: Path, workers: Workers, request: pytest.FixtureRequest
) -> None:
    if kind == "s3":
        request.getfixturevalue("s3_env")
        url, options, count = request.getfixturevalue("s3_store_url"), {}, 20
    else:
        url, options, count = str(tmp_path / "store"), {"profile": kind}, 2000
    writers = [
        workers.start("log_and_exit", url, options, id=i, stream="ev", count=count)
        for i in range(2)
    ]
    segments = [w.message()["segment"] for w in writers]
    for writer in writers:
        writer.proc.wait(timeout=HANG)
        assert writer.proc.returncode == 0
    log = open_store(url, **options).log("ev")
    assert sorted(log.segments()) == sorted(segments)
    decoded = log.read([RaceEvent])
    assert decoded.skipped == 0, decoded.errors
    for i in range(2):
        mine = [r for r in decoded.records if r.writer == i]
        assert [r.seq for r in mine] == list(range(count))
        assert all(r.payload == "x" * (r.seq % 50) for r in mine)
