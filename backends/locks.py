"""Named locks: a kernel lock where the kernel can be trusted, a fenced lease elsewhere.

Correctness never rests on a lock alone (publication is first-writer-wins anyway); the lock
saves duplicate work, and it must never need a human: a dead holder's kernel lock is
dropped by the kernel at once, and a dead holder's lease expires after `lease_duration`.

A lease is a sequence of generation records ``<dir>/<generation>``, each created with
create-if-absent, so taking over an expired or released lease is a race that exactly one
taker wins on every backend (O_EXCL/link on POSIX, If-None-Match on S3). The generation is
the fencing token: a holder whose lease was taken over sees a newer generation and gets
`LeaseLost` from `check()`, so it can refuse to commit. A generation record is a
`LeaseRecord`; one written before records were tagged reads as its version 1.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import filelock

from .errors import LeaseLost, LockTimeout
from .faults import fault_point
from .keys import join
from .records import LEASE_RECORDS, LeaseRecord, RecordError, encode

if TYPE_CHECKING:
    from .base import StoreBase


class Lock(ABC):
    """A named lock. Use as a context manager or with `acquire`/`release`."""

    name: str
    default_timeout: float | None = None

    @abstractmethod
    def acquire(self, timeout: float | None = None) -> None:
        """Block until held; `timeout` seconds (None: forever, 0: one try) or `LockTimeout`."""

    @abstractmethod
    def release(self) -> None: ...

    @property
    @abstractmethod
    def held(self) -> bool: ...

    @property
    def generation(self) -> int:
        """Fencing token: strictly increases with every new holder (0 for kernel locks)."""
        return 0

    @property
    def took_over_from(self) -> str | None:
        """The previous holder whose lease had expired unreleased when this one took it
        (a holder that died); None when the lock was free. Kernel locks cannot tell."""
        return None

    def seconds_until_free(self) -> float:
        """After a failed `acquire`: how long the holder seen then is sure to hold on (its
        lease's expiry), so a waiter need not ask again sooner. 0 when it cannot tell (a
        kernel lock: asking again is one local system call)."""
        return 0.0

    def busy(self) -> bool:
        """Whether another holder has the lock now, found without taking it for long: a
        kernel lock is tried and let go at once (one local system call)."""
        try:
            self.acquire(timeout=0)
        except LockTimeout:
            return True
        self.release()
        return False

    def check(self) -> None:  # noqa: B027 - kernel locks cannot be lost while held
        """Raise `LeaseLost` if this holder no longer owns the lock."""

    def __enter__(self) -> Lock:
        self.acquire(self.default_timeout)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class KernelLock(Lock):
    """`flock(2)` through filelock: dropped by the kernel the moment the holder dies."""

    def __init__(self, path: str, *, name: str, timeout: float | None = None) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.name = name
        self.path = path
        self.default_timeout = timeout
        self._lock = filelock.FileLock(path, thread_local=False)

    def acquire(self, timeout: float | None = None) -> None:
        try:
            self._lock.acquire(timeout=-1 if timeout is None else timeout, poll_interval=0.02)
        except filelock.Timeout as exc:
            raise LockTimeout(f"lock {self.name!r} not acquired within {timeout} s") from exc

    def release(self) -> None:
        if self._lock.is_locked:
            self._lock.release()

    @property
    def held(self) -> bool:
        return bool(self._lock.is_locked)


class LeaseLock(Lock):
    """A lease with expiry, heartbeat and fencing generation, over any store."""

    def __init__(
        self,
        store: StoreBase,
        directory: str,
        *,
        lease_duration: float = 30.0,
        timeout: float | None = None,
        poll_interval: float = 0.05,
    ) -> None:
        if lease_duration <= 0:
            raise ValueError(f"lease_duration must be > 0, got {lease_duration!r}")
        self.store = store
        self.directory = directory
        self.name = directory.rsplit("/", 1)[-1]
        self.lease_duration = lease_duration
        self.default_timeout = timeout
        self.poll_interval = poll_interval
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._generation = 0
        self._held = False
        self._lost = False
        self._took_over_from: str | None = None
        self._seen_expires = 0.0  # the holder's expiry seen by the last failed try
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # ------------------------------------------------------------- records
    def _key(self, generation: int) -> str:
        return join(self.directory, f"{generation:012d}")

    def _record(self, generation: int, *, released: bool = False) -> bytes:
        expires = 0.0 if released else time.time() + self.lease_duration
        return encode(LeaseRecord(owner=self.owner, generation=generation, expires=expires,
                                  released=released))  # fmt: skip

    def _latest(self) -> tuple[int, LeaseRecord | None]:
        generations = [int(n) for n in self.store.list_dir(self.directory) if n.isdigit()]
        if not generations:
            return 0, None
        latest = max(generations)
        try:
            return latest, LEASE_RECORDS.read(self.store, self._key(latest))
        except RecordError:
            # A torn or foreign record cannot be trusted to be live; treat as expired.
            return latest, LeaseRecord(owner="", generation=latest, expires=0.0)

    # ------------------------------------------------------------ protocol
    def acquire(self, timeout: float | None = None) -> None:
        if self._held:
            raise RuntimeError(f"lease {self.name!r} is already held by this object")
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = self.poll_interval
        while True:
            latest, record = self._latest()
            free = latest == 0 or (record is not None and record.free(time.time()))
            self._seen_expires = 0.0 if record is None or record.released else record.expires
            if free and self.store.create(self._key(latest + 1), self._record(latest + 1)):
                self._took_over_from = None
                if record is not None and not record.released:  # expired, not let go
                    self._took_over_from = record.owner or "an unreadable lease"
                self._on_acquired(latest + 1)
                fault_point("lease.acquired")
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise LockTimeout(
                    f"lease {self.name!r} on {self.store.url} not acquired within {timeout} s"
                )
            sleep = delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic()))
            time.sleep(sleep)
            delay = min(delay * 1.5, 0.5, self.lease_duration / 4)

    def _on_acquired(self, generation: int) -> None:
        self._generation = generation
        self._held = True
        self._lost = False
        self._stop.clear()
        for old in self.store.list_dir(self.directory):
            if old.isdigit() and int(old) < generation - 1:
                self.store.delete(join(self.directory, old))
        self._heartbeat = threading.Thread(
            target=self._beat, name=f"lease-heartbeat-{self.name}", daemon=True
        )
        self._heartbeat.start()

    def _beat(self) -> None:
        interval = self.lease_duration / 3
        while not self._stop.wait(interval):
            try:
                latest, _ = self._latest()
                if latest != self._generation:
                    self._lost = True
                    return
                self.store.write(self._key(self._generation), self._record(self._generation))
                fault_point("lease.renewed")
            except Exception:  # noqa: BLE001 - a missed beat only shortens the lease
                continue

    def check(self) -> None:
        if not self._held:
            raise LeaseLost(f"lease {self.name!r} is not held")
        latest, record = self._latest()
        if self._lost or latest != self._generation:
            self._lost = True
            raise LeaseLost(
                f"lease {self.name!r} generation {self._generation} was taken over "
                f"(now generation {latest})"
            )
        if record is not None and record.owner != self.owner:
            self._lost = True
            raise LeaseLost(f"lease {self.name!r} is owned by {record.owner}")

    def release(self) -> None:
        if not self._held:
            return
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        self._held = False
        latest, _ = self._latest()
        if latest == self._generation:
            released = self._record(self._generation, released=True)
            self.store.write(self._key(self._generation), released)

    @property
    def held(self) -> bool:
        return self._held and not self._lost

    def busy(self) -> bool:
        """Whether a live lease is held now (by anyone), read without creating a record: a
        process that must never take the lease can still wait for its holder."""
        latest, record = self._latest()
        return latest != 0 and record is not None and not record.free(time.time())

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def took_over_from(self) -> str | None:
        return self._took_over_from

    def seconds_until_free(self) -> float:
        # A holder renews its lease every third of it, so a holder that is alive never
        # lets the expiry seen here pass; one that died is found free right after it.
        return max(0.0, min(self._seen_expires - time.time(), self.lease_duration))
