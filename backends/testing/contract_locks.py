"""The store contract for locks and leases: mutual exclusion, wake-up, lease expiry and
takeover, and a stale holder never freeing a new one.

Lease tests run on every store: where `store.lock()` gives a kernel lock they drive a
`LeaseLock` over the same store, since the lease protocol only needs create-if-absent.
Waiting is by handshake and by the lease's own record (:mod:`.handshakes`), never by sleep;
a lease's expiry is the waiter's own monotonic clock's (backends/locks.py).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from .. import locks as locks_module
from ..errors import LeaseLost, LockTimeout
from ..keys import join
from ..locks import KernelLock, LeaseLock
from ..store import Store
from .handshakes import HANG, lease_record, wait_until_blocked


class LockContractTests:
    """Locks a `Store` hands out, kernel or lease. Subclasses supply a ``store`` fixture."""

    lease_duration = 0.6
    """Seconds; short so lease tests are quick, long enough for a slow S3 peer to beat."""

    # ------------------------------------------------------------ helpers
    def lease(self, store: Store, name: str, **kw: Any) -> LeaseLock:
        """A lease on `store` (through `store.lock` where the store chooses leases)."""
        kw.setdefault("lease_duration", self.lease_duration)
        if store.capabilities.kernel_locks:
            return LeaseLock(store, join(".leases", name), **kw)
        lock = store.lock(name, **kw)
        assert isinstance(lock, LeaseLock)
        return lock

    @staticmethod
    def freeze(lease: LeaseLock) -> None:
        """Stop a holder's heartbeat, as if its process hung: its lease will expire."""
        lease._stop.set()
        if lease._heartbeat is not None:
            lease._heartbeat.join(timeout=HANG)
            assert not lease._heartbeat.is_alive()

    # ------------------------------------------------------------- locks
    def test_lock_kind_follows_capabilities(self, store: Store) -> None:
        lock = store.lock("n")
        if store.capabilities.kernel_locks:
            assert isinstance(lock, KernelLock)
            assert lock.generation == 0
        else:
            assert isinstance(lock, LeaseLock)

    def test_lock_acquire_release(self, store: Store) -> None:
        first = store.lock("n", timeout=5)
        with first:
            assert first.held
            first.check()
        assert not first.held
        second = store.lock("n")
        second.acquire(timeout=0)
        assert second.held
        second.release()

    def test_lock_timeout(self, store: Store) -> None:
        holder = store.lock("n")
        holder.acquire(timeout=5)
        try:
            waiter = store.lock("n")
            start = time.monotonic()
            with pytest.raises(LockTimeout, match="'n'"):
                waiter.acquire(timeout=0.3)
            assert time.monotonic() - start >= 0.25  # it did wait (a busy machine: longer)
            assert not waiter.held
            with pytest.raises(LockTimeout), store.lock("n", timeout=0.1):
                pass  # pragma: no cover
        finally:
            holder.release()
        store.lock("n").acquire(timeout=0)  # free again after release

    def test_lock_release_wakes_a_waiter(self, store: Store) -> None:
        holder = store.lock("n")
        holder.acquire(timeout=5)
        first_try: list[str] = []
        tried = threading.Event()
        acquired: list[float] = []

        def wait() -> None:
            lock = store.lock("n")
            try:
                lock.acquire(timeout=0)
            except LockTimeout:
                first_try.append("refused")
            else:  # pragma: no cover - a failure, reported below
                first_try.append("granted")
                lock.release()
                return
            finally:
                tried.set()
            lock.acquire(timeout=HANG)  # blocks until the holder lets go
            acquired.append(time.monotonic())
            lock.release()

        thread = threading.Thread(target=wait)
        thread.start()
        try:
            assert tried.wait(HANG)
            assert first_try == ["refused"]  # really held: the waiter has to wait
            wait_until_blocked(thread)  # ...and now it does, inside acquire
            assert acquired == []
            released = time.monotonic()
        finally:
            holder.release()
        thread.join(timeout=HANG)
        assert not thread.is_alive()
        assert len(acquired) == 1 and acquired[0] >= released

    def test_locks_with_different_names_are_independent(self, store: Store) -> None:
        with store.lock("a", timeout=5), store.lock("b", timeout=5) as b:
            assert b.held

    def test_lock_kind_follows_the_capabilities_and_lives_in_the_store(
        self, store: Store
    ) -> None:
        lock = store.lock("dir/n", timeout=5)
        if store.capabilities.kernel_locks:
            assert isinstance(lock, KernelLock)
            assert lock.path == store.local_path(join(".locks", "dir/n.lock"))
            with lock:
                assert os.path.exists(lock.path)
        else:
            assert isinstance(lock, LeaseLock)
            with lock:
                # the lease is a generation record inside the store itself
                assert store.list_dir(join(".locks", "dir/n")) == [f"{lock.generation:012d}"]

    # ------------------------------------------------------------- leases
    def test_lease_generation_increases(self, store: Store) -> None:
        generations = []
        for _ in range(3):
            lease = self.lease(store, "gen")
            lease.acquire(timeout=5)
            lease.check()
            generations.append(lease.generation)
            lease.release()
        assert generations[0] >= 1
        assert generations == sorted(set(generations))

    def test_lease_heartbeat_keeps_it(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        # At least 2 s, so a heartbeat delayed by a loaded machine does not look like a
        # crash. The waiter's wall clock runs an hour ahead (every record it reads says
        # "expired an hour ago"), the holder's heartbeat thread keeps the true one: refused
        # for two periods on the waiter's own monotonic clock, only renewals can have kept
        # the lease.
        duration = max(self.lease_duration, 2.0)
        holder = self.lease(store, "hb", lease_duration=duration)
        holder.acquire(timeout=5)
        waiter_thread = threading.get_ident()

        class SkewedClock:
            monotonic = staticmethod(time.monotonic)
            sleep = staticmethod(time.sleep)

            @staticmethod
            def time() -> float:
                skew = 3600.0 if threading.get_ident() == waiter_thread else 0.0
                return time.time() + skew

        monkeypatch.setattr(locks_module, "time", SkewedClock)
        try:
            first = lease_record(holder)
            other = self.lease(store, "hb", lease_duration=duration)
            start = time.monotonic()
            while True:
                with pytest.raises(LockTimeout):
                    other.acquire(timeout=0)
                if time.monotonic() - start > 2 * duration:
                    break
                time.sleep(duration / 20)
            renewed = lease_record(holder)
            assert renewed["generation"] == first["generation"] == holder.generation
            assert renewed["renewal"] > first["renewal"]
            holder.check()
            assert holder.held
        finally:
            holder.release()

    def test_expired_lease_is_taken_over(self, store: Store) -> None:
        first = self.lease(store, "exp")
        first.acquire(timeout=5)
        self.freeze(first)  # the holder hangs: no more heartbeats
        second = self.lease(store, "exp")
        start = time.monotonic()  # before the waiter's first look
        second.acquire(timeout=HANG)
        try:
            # Taken over one period after the waiter first saw the frozen record, on its
            # own monotonic clock, not before.
            assert time.monotonic() - start >= first.lease_duration
            assert second.generation == first.generation + 1
            assert second.took_over_from == first.owner
            with pytest.raises(LeaseLost):
                first.check()
            assert not first.held
            second.check()
        finally:
            second.release()
            first.release()
        # The stale holder's release must not free the new holder's lease; after both
        # released, a third taker gets the next generation at once.
        third = self.lease(store, "exp")
        third.acquire(timeout=0)
        assert third.generation == second.generation + 1
        third.release()

    def test_stale_release_does_not_free_a_new_holder(self, store: Store) -> None:
        first = self.lease(store, "stale")
        first.acquire(timeout=5)
        self.freeze(first)
        # The new holder's own lease outlasts the test: only the stale release could free it.
        second = self.lease(store, "stale", lease_duration=HANG)
        second.acquire(timeout=HANG)
        try:
            first.release()
            with pytest.raises(LockTimeout):
                self.lease(store, "stale").acquire(timeout=0)
            second.check()
        finally:
            second.release()

    def test_lease_acquire_timeout(self, store: Store) -> None:
        holder = self.lease(store, "to")
        holder.acquire(timeout=5)
        try:
            start = time.monotonic()
            with pytest.raises(LockTimeout):
                self.lease(store, "to").acquire(timeout=0.2)
            assert time.monotonic() - start >= 0.2  # it did wait (a busy machine: longer)
        finally:
            holder.release()
