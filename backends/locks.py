"""Named locks: a kernel lock where the kernel can be trusted, a fenced lease elsewhere.

Correctness never rests on a lock alone (publication is first-writer-wins anyway); the lock
saves duplicate work, and it must never need a human: a dead holder's kernel lock is
dropped by the kernel at once, and a dead holder's lease expires after one lease period.

A lease is a sequence of generation records ``<dir>/<generation>``, each created with
create-if-absent, so taking over an expired or released lease is a race that exactly one
taker wins on every backend (O_EXCL/link on POSIX, If-None-Match on S3). The generation is
the fencing token: a holder whose lease was taken over sees a newer generation and gets
`LeaseLost` from `check()`, so it can refuse to commit. A generation record is a
`LeaseRecord`; one written before records were tagged reads as its version 1.

**No wall clock is trusted.** The holder rewrites its record every third of its lease
period (`_beat`), and every renewal changes the record's bytes (its `renewal` counter goes
up, whatever the holder's clock says). A waiter judges expiry on its *own monotonic clock*:
the lease is expired once this process has seen the same latest generation with the same
record bytes for one lease period (the holder's `duration`, as its record says; a record
without one, by a version before it: this lock's `lease_duration`) - never longer than this
lock's own `lease_duration`, whatever the record says: a record claiming a ten-year period
(anyone who can write the store can write one) costs a waiter one of its own periods past
the last change it saw. The record's `expires`
(the holder's wall clock) is still written, for readers that predate this rule and for
`cache gc` (`debris.py`), but no waiter reads it: a node whose clock is minutes off neither
takes over a live lease nor waits on a dead one for longer than a period after the last
renewal it saw (plus the time between two of its looks).

What a process saw is remembered per store URL and lease name (`_SIGHTINGS`), shared by
every `LeaseLock` of the process, so a new lock object for a lease already watched (the
fleet makes one per wait) does not start over. A waiter that has seen nothing yet waits one
full period from its first look, even for a lease whose holder died long ago (a cold start
that finds a dead holder's lease pays one period). No lease, or a released one, is free at
once. While the record stays as seen, a look is one read of it (`_glance`); a listing is
added only when it changed, went, or ran out.

**A malformed lease is held by an unknown owner, for one period.** A lease directory holds
only records named by their generation (`generation_of`: twelve to eighteen ASCII digits,
as `_key` writes them). A name that is none (a stray file, ``"²"``, ``"1e9"``, a 5,000-digit
number) is ignored while a record with a generation is there; a directory holding only such
names, or a latest record that is not there to read (a directory in its place) is "busy,
held by an unknown owner" - watched like a record that does not decode, and taken over (the
next generation created on top) after one of this lock's own periods. Nothing in a lease
directory makes a look raise: what a writer of the store left there costs a waiter at most
one period, never the store (a caller that sets the whole store aside on an error would
otherwise lose every key for one name in one directory). A lease directory that is no
directory (a file planted at ``.locks/<name>`` on a folder store: no record can be created
there) is the same "busy, unknown owner" for one period, after which `acquire` raises
`LeaseUnusable`: the caller goes on without this lease, and only this one.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import threading
import time
import uuid
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple

import filelock

from .errors import LeaseLost, LeaseUnusable, LockTimeout
from .faults import fault_point
from .keys import join
from .records import LEASE_RECORDS, RECORD_MAX_BYTES, LeaseRecord, RecordError, encode
from .regular import inside_root

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
        """After a failed `acquire`: how long the lease seen then stays held if it does not
        change, on this process's monotonic clock (a lease: its period, counted from when
        this process first saw its record as it is). A live holder renews before then, so
        a waiter that must see a dead holder's lease run out in time looks again meanwhile.
        0 when it cannot tell (a kernel lock: asking again is one local system call)."""
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


class _Sighting(NamedTuple):
    """A lease's latest record as this process first saw it."""

    generation: int
    data: bytes
    since: float  # time.monotonic() of the first look that found these bytes
    period: float  # the holder's lease period: unchanged for this long, it expired


_GENERATION_NAME = re.compile(r"[0-9]{12,15}")
"""A generation record's name: `LeaseLock._key` writes at least twelve digits."""

MAX_GENERATION = 10**15 - 1
"""The highest generation a record may name (a million acquisitions a second for thirty
years stay below it). A name above it is junk, not the key's latest lease: a writer who
planted ``999999999999999999`` would otherwise push the next taker's generation past any
name a generation may have, and the key could never be leased again."""

_UNKNOWN_OWNER = b""
"""The bytes a sighting of a malformed lease holds (nothing read, or nothing to read): the
same whatever the junk, so new junk does not restart the period."""


def generation_of(name: str) -> int | None:
    """The generation a lease record named `name` holds; None when `name` is no generation
    record's name (not ASCII digits, not as `LeaseLock._key` writes it, or 0)."""
    if not _GENERATION_NAME.fullmatch(name):
        return None
    generation = int(name)
    ok = 0 < generation <= MAX_GENERATION and f"{generation:012d}" == name
    return generation if ok else None


LEASE_MAX_NAMES = 100
"""The most names a look lists in a lease folder (it holds one or two records; junk beside
them is tolerated up to this). A fuller one is unusable (`LeaseLock._listing`): listing a
folder of millions a writer without the lease planted would stall every waiter."""

_BLOCKED: dict[tuple[str, str], float] = {}
"""(store URL, lease directory) -> time.monotonic() when this process first found that no
record can be created in it (the directory is a file): one period later, `LeaseUnusable`."""

_SIGHTINGS: dict[tuple[str, str], _Sighting] = {}
"""(store URL, lease directory) -> what this process saw last. Plain dict operations (atomic
under the GIL, no lock a fork could inherit held): two threads racing on one entry can only
leave the later first sight, which makes a waiter wait longer, never shorter."""


class LeaseLock(Lock):
    """A lease with heartbeat, fencing generation and expiry judged on the waiter's own
    monotonic clock (see the module doc), over any store."""

    def __init__(
        self,
        store: StoreBase,
        directory: str,
        *,
        lease_duration: float = 30.0,
        timeout: float | None = None,
        poll_interval: float = 0.05,
    ) -> None:
        if not lease_duration > 0 or not math.isfinite(lease_duration):
            raise ValueError(f"lease_duration must be > 0 and finite, got {lease_duration!r}")
        self.store = store
        self.directory = directory
        self.name = directory.rsplit("/", 1)[-1]
        self.lease_duration = lease_duration
        self.default_timeout = timeout
        self.poll_interval = poll_interval
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._generation = 0
        self._renewal = 0  # bumped by every record written: each renewal changes the bytes
        self._held = False
        self._lost = False
        self._took_over_from: str | None = None
        self._free_at = 0.0  # monotonic: when the lease seen by the last failed try runs out
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.unusable: RecordError | None = None
        """Why the lease folder, as last looked at, cannot be used (`_listing`), or None."""

    # ------------------------------------------------------------- records
    def _key(self, generation: int) -> str:
        return join(self.directory, f"{generation:012d}")

    def _record(self, generation: int, *, released: bool = False) -> bytes:
        self._renewal += 1
        expires = 0.0 if released else time.time() + self.lease_duration
        return encode(LeaseRecord(owner=self.owner, generation=generation, expires=expires,
                                  released=released, renewal=self._renewal,
                                  duration=self.lease_duration))  # fmt: skip

    def _listing(self) -> tuple[int, bool]:
        """The latest generation in the store (one listing; 0 when there is none), and
        whether the directory holds a name that is no generation record's.

        A lease folder that cannot be used - more than `LEASE_MAX_NAMES` names (listed no
        further), or on a folder store a link leading out of the store, where our records
        would be written and deleted - reads as junk only (held one period by an unknown
        owner), and `unusable` says why: `acquire` then raises it instead of writing."""
        self.unusable = None
        try:
            if not self._inside_store():
                raise RecordError(f"{self.store.url}/{self.directory}", "leads out of the "
                                  "store (a symbolic link); never written")  # fmt: skip
            names = self.store.list_dir(self.directory, max_names=LEASE_MAX_NAMES)
        except RecordError as exc:
            self.unusable = exc
            return 0, True
        latest, odd = 0, False
        for name in names:
            generation = generation_of(name)
            if generation is None:
                odd = True
            elif generation > latest:
                latest = generation
        return latest, odd

    def _inside_store(self) -> bool:
        """Whether the lease folder resolves inside the store (a store without local paths:
        always). A few system calls per look at a lease, never on a hit's path."""
        path = self.store.local_path(self.directory)
        root = self.store.local_path("")
        return path is None or root is None or inside_root(root, path)

    def _newest(self) -> int:
        """The latest generation in the store (one listing); 0 when there is none."""
        return self._listing()[0]

    def _look(self) -> tuple[int, bytes | None, bool]:
        """The latest generation, its record's bytes (None: gone since the listing), and
        whether the directory holds a name that is no record's."""
        latest, odd = self._listing()
        return latest, None if latest == 0 else self._read(latest), odd

    def _read(self, generation: int) -> bytes | None:
        """One generation's record, bounded (`RECORD_MAX_BYTES`); one that is too large or
        not a regular file reads as empty bytes: a torn record, judged as such (`_decode`)."""
        try:
            return self.store.read(self._key(generation), max_size=RECORD_MAX_BYTES)
        except RecordError:
            return b""

    def _decode(self, generation: int, data: bytes) -> LeaseRecord:
        try:
            return LEASE_RECORDS.decode(data, source=f"{self.store.url}/{self._key(generation)}")
        except (RecordError, ValueError, RecursionError):
            # A torn or foreign record (or a newer version's): never trusted to be held for
            # longer than this lock's own period, and watched like any other.
            return LeaseRecord(owner="", generation=generation, expires=0.0)

    def _latest(self) -> tuple[int, LeaseRecord | None]:
        latest, data, _ = self._look()
        return latest, None if data is None else self._decode(latest, data)

    # ----------------------------------------------------------- judgement
    def _judge(self, generation: int, data: bytes | None, odd: bool = False
               ) -> tuple[float, LeaseRecord | None]:  # fmt: skip
        """How long the lease as read stays held on this process's monotonic clock (0: free
        now), and its record: no record or a released one is free at once; any other is
        held for one period from the first look that found these very bytes - the holder's
        period as its record says, never longer than this lock's own. A malformed lease
        (`odd` names and no record; a latest record not there to read) is held by an
        unknown owner (a record without one) for this lock's own period."""
        where = (self.store.url, self.directory)
        if generation == 0 and not odd:
            _SIGHTINGS.pop(where, None)
            return 0.0, None
        if generation == 0 or data is None:  # junk only; a directory in a record's place;
            # or removed since the listing (a collector: the next look finds it free)
            unknown = LeaseRecord(owner="", generation=generation, expires=0.0)
            return self._held_for(where, generation, _UNKNOWN_OWNER, self.lease_duration), unknown
        record = self._decode(generation, data)
        if record.released:
            _SIGHTINGS.pop(where, None)
            return 0.0, record
        period = record.duration
        if not 0 < period <= self.lease_duration:  # NaN fails too
            period = self.lease_duration  # none (a version before `duration`), or too long
        return self._held_for(where, generation, data, period), record

    def _held_for(self, where: tuple[str, str], generation: int, data: bytes,
                  period: float) -> float:  # fmt: skip
        """Seconds the lease seen as (`generation`, `data`) stays held on this process's
        monotonic clock: `period` from the first look that found it so."""
        now = time.monotonic()
        seen = _SIGHTINGS.get(where)
        if seen is None or seen.generation != generation or seen.data != data:
            seen = _SIGHTINGS[where] = _Sighting(generation, data, now, period)
        return max(0.0, seen.since + seen.period - now)

    def _glance(self) -> tuple[float, LeaseRecord | None] | None:
        """The judgement from one read of the record this process watches, while that is
        enough: it is still there, not released, and unchanged within its period or
        renewed. None when only a full look (listing, then read) can tell."""
        seen = _SIGHTINGS.get((self.store.url, self.directory))
        if seen is None or seen.data == _UNKNOWN_OWNER \
                or time.monotonic() >= seen.since + seen.period:  # fmt: skip
            return None  # a malformed lease is looked at whole: it may have been taken
        data = self._read(seen.generation)
        if data is None:
            return None
        remaining, record = self._judge(seen.generation, data)
        return (remaining, record) if remaining > 0 else None

    def _watch(self) -> tuple[int, float, LeaseRecord | None]:
        """(the latest generation, or -1 when a glance sufficed; seconds held; record)."""
        glanced = self._glance()
        if glanced is not None:
            return -1, *glanced
        latest, data, odd = self._look()
        return latest, *self._judge(latest, data, odd)

    # ------------------------------------------------------------ protocol
    def acquire(self, timeout: float | None = None) -> None:
        if self._held:
            raise RuntimeError(f"lease {self.name!r} is already held by this object")
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = self.poll_interval
        while True:
            latest, remaining, record = self._watch()
            if self.unusable is not None and remaining <= 0:
                raise self.unusable  # held its one period: the key's lease is unusable
            if latest >= 0 and remaining <= 0:
                created, remaining = self._create(latest + 1)
            else:
                created = False
            self._free_at = time.monotonic() + remaining
            if created:
                self._took_over_from = None
                if record is not None and not record.released:  # ran out, not let go
                    self._took_over_from = record.owner or "an unreadable lease"
                _SIGHTINGS.pop((self.store.url, self.directory), None)
                self._on_acquired(latest + 1)
                fault_point("lease.acquired")
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise LockTimeout(
                    f"lease {self.name!r} on {self.store.url} not acquired within {timeout} s"
                )
            sleep = delay if remaining <= 0 else min(delay, remaining)  # look when it runs out
            if deadline is not None:
                sleep = min(sleep, max(0.0, deadline - time.monotonic()))
            time.sleep(sleep)
            delay = min(delay * 1.5, 0.5, self.lease_duration / 4)

    def _create(self, generation: int) -> tuple[bool, float]:
        """Create `generation`'s record: (created, seconds the lease stays busy if not). A
        lease directory that is a file is held by an unknown owner for one of this lock's
        periods from the first try that found it so, then `LeaseUnusable`."""
        where = (self.store.url, self.directory)
        try:
            created = self.store.create(self._key(generation), self._record(generation))
        except (NotADirectoryError, FileExistsError) as exc:  # a file on the way (memory:
            now = time.monotonic()  # FileExistsError)
            since = _BLOCKED.setdefault(where, now)
            if now - since >= self.lease_duration:
                raise LeaseUnusable(
                    f"lease {self.name!r} on {self.store.url} cannot be taken: "
                    f"{self.directory} is not a directory ({exc.strerror})") from None
            return False, since + self.lease_duration - now
        _BLOCKED.pop(where, None)
        return created, 0.0

    def _on_acquired(self, generation: int) -> None:
        self._generation = generation
        self._held = True
        self._lost = False
        self._stop.clear()
        with contextlib.suppress(RecordError):  # filled up since the look: left as it is
            for old in self.store.list_dir(self.directory, max_names=LEASE_MAX_NAMES):
                older = generation_of(old)
                if older is not None and older < generation - 1:
                    self.store.delete(join(self.directory, old))
        self._heartbeat = threading.Thread(
            target=self._beat, name=f"lease-heartbeat-{self.name}", daemon=True
        )
        self._heartbeat.start()

    def _beat(self) -> None:
        interval = self.lease_duration / 3
        while not self._stop.wait(interval):
            try:
                if not self._renew():
                    return
                fault_point("lease.renewed")
            except Exception:  # noqa: BLE001 - a missed beat only shortens the lease
                continue

    def _renew(self) -> bool:
        """One renewal: the record rewritten (new bytes: its `renewal` goes up); False,
        with nothing written, when the lease was taken over."""
        if self._newest() != self._generation:
            self._lost = True
            return False
        self.store.write(self._key(self._generation), self._record(self._generation))
        return True

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
        if self._newest() == self._generation:
            released = self._record(self._generation, released=True)
            self.store.write(self._key(self._generation), released)

    @property
    def held(self) -> bool:
        return self._held and not self._lost

    def busy(self) -> bool:
        """Whether a live lease is held now (by anyone), read without creating a record: a
        process that must never take the lease can still wait for its holder. A record
        this process has not watched for a period yet counts as live."""
        return self._watch()[1] > 0

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def took_over_from(self) -> str | None:
        return self._took_over_from

    def seconds_until_free(self) -> float:
        return max(0.0, self._free_at - time.monotonic())
