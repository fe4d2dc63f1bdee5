"""The node's local tier as the cache sees it: what is already there - lookups, withdrawals,
full verification - and the event log every part of the cache writes to.

No compile, fetch, lock wait or fleet is in here: those are the decision's
(`flow/cache.py`), which holds one `LocalTier` and asks it. A lookup takes no lock; what
must happen under the key's lock (a withdrawal that could race a republication) is the
caller's to arrange, which `lookup`'s `quarantine` flag says.

A read-only tier (``read_only``: a baked tier, or a local tier this process cannot write)
is looked up the same way, never written, and judged as a tier prepared elsewhere: by
signature alone (its node key, if one is there, is never read: whoever prepared the image or
mount had it), and every file checked against the record's digests once per process before
the entry is first served (`_checksummed`: a signature covers the record, not the bytes a
size check lets through). Its events go to the `record` it is given (the writable tier's
log), and a defective or untrusted entry there is skipped - one warning per key and process
- never withdrawn or "repaired".
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

from vllm_neuron.backends import EventLog, Record, Store
from vllm_neuron.backends.records import RecordError

from ..entry.check import verify_entry
from ..entry.events import EVENTS_STREAM, VerificationFailed
from ..entry.outcomes import CacheResult
from ..entry.record import (
    ENTRY_RECORD,
    EntryProblem,
    EntryRecord,
    check_checksums,
    decode_record,
    read_record,
)
from ..entry.text import printable
from ..trust.policy import TrustPolicy
from ..trust.signing import Verdict
from .quarantine import quarantine_entry

__all__ = ["EVENT_OBSERVERS", "LocalTier"]

logger = logging.getLogger("vllm_neuron.compile")

EVENT_OBSERVERS: list[Callable[[Record], None]] = []
"""Told every event any cache of this process records, before it is written; each must
never raise. Empty (one empty loop per event) unless vllm_neuron.metrics installed its
counters, which it does only inside vLLM."""

Admit = Callable[[str, str, Verdict], bool]
"""``admit(key, tier, verdict)``: whether this process may use an entry the trust policy
judged `verdict` (the cache's, which says so once per entry)."""


class LocalTier:
    """One process's view of the local tier (see the module doc).

    `admit` decides on an entry no trusted key signed (the cache's trust bookkeeping);
    `forget` is told of every key this tier withdraws, so a memory of it goes too.
    """

    def __init__(
        self, store: Store, *, trust: TrustPolicy, lease_duration: float, timeout: float,
        admit: Admit, forget: Callable[[str], object], read_only: bool = False,
        record: Callable[[Record], None] | None = None,
    ) -> None:
        self.store = store
        self.url = store.url  # where the local tier is, for messages and tools
        self.trust = trust
        self.lease_duration = lease_duration
        self.timeout = timeout
        self._admit = admit
        self._forget = forget
        # The last record bytes read for each key and their decoding: a hit still reads the
        # record and stats every file, but bytes seen before are not decoded again.
        self._decoded: dict[str, tuple[bytes, EntryRecord]] = {}
        # A read-only tier is never this node's own, even under this user's cache root: it
        # was prepared where this process could not see (an image layer, a mount), so it is
        # judged by signature alone and its node key never read (a key shipped with it would
        # be every pod's: trust/origin.py).
        self.read_only = read_only
        # Read-only tiers: the record bytes whose files were checksummed, per key.
        self._checksummed: dict[str, bytes] = {}
        self._skipped: set[str] = set()  # keys of a read-only tier said skipped (once each)
        self._elsewhere = record  # where a read-only tier's events go
        self._events: EventLog | None = None if read_only else store.log(
            EVENTS_STREAM, writer=f"{socket.gethostname()}-{os.getpid()}")
        self._events_broken = False

    # ------------------------------------------------------------ events
    def record(self, event: Record) -> None:
        """Append `event` to this process's segment of the tier's event log (observers first);
        best-effort: a log that cannot be written is said once and given up."""
        if self._events is None:  # a read-only tier: recorded where it was told to
            if self._elsewhere is not None:
                self._elsewhere(event)
            return
        for observe in EVENT_OBSERVERS:
            observe(event)
        if self._events_broken:
            return
        try:
            self._events.append(event)
        except Exception as exc:  # noqa: BLE001 - statistics never break a compile
            self._events_broken = True
            logger.warning("compile cache: cannot record events in %s: %s", self.url, exc)

    # ------------------------------------------------------------ lookups
    def result(self, key: str, prefix: str, record: EntryRecord, source: str,
               seconds: float) -> CacheResult:  # fmt: skip
        """The `CacheResult` of the published entry at `prefix`."""
        # The documented door (docs/storage.md): the toolchain loads from this directory.
        return CacheResult(key, self.store.local_dir_of(prefix), record, source, seconds, prefix)

    def lookup(self, key: str, *, quarantine: bool = True) -> CacheResult | None:
        """A published, size-checked local entry or None (no lock taken).

        A defective entry is a miss; with `quarantine` it is also withdrawn. The decision
        flow's first, unlocked check passes ``quarantine=False`` and leaves the withdrawal
        to the re-check under the key's lock: an unlocked withdrawal could remove the good
        entry that the lock holder has just published in place of the defective one.
        """
        start = time.perf_counter()
        store = self.store
        try:
            # One store operation for the record (on local disk: one read; the directory is
            # stat'ed only when the record is absent), one for the sizes (a stat per file).
            found = store.read_published(key, ENTRY_RECORD)
        except (OSError, RecordError):
            # Unreadable (an I/O error; a record too large or not a regular file, refused
            # unread): a defective entry.
            found = (key, b"")
        if found is None:
            return None
        prefix, data = found
        try:
            if data is None:
                # A published entry without a record (deleted, or not a file) is defective,
                # not a miss, or its directory would block the recompiled entry from being
                # published in its place.
                raise EntryProblem(f"{self.url}/{key}: {ENTRY_RECORD} is missing")
            known = self._decoded.get(key)
            if known is not None and known[0] == data:
                record = known[1]  # the same bytes as last time: the same (frozen) record
            else:
                record = decode_record(data, source=f"{self.url}/{key}/{ENTRY_RECORD}")
                if record.key != key:
                    raise EntryProblem(f"{self.url}/{key}: record names key "
                                       f"{printable(record.key, 100)}")
                self._decoded[key] = (data, record)
            store.check_sizes(prefix, record.files)
            trust = self.trust
            verdict = None if trust.mode == "off" else (
                trust.judge_signed(data, store, prefix) if self.read_only
                else trust.judge_local(record, data, store, prefix))
            if self.read_only and self._checksummed.get(key) != data and not (
                    verdict is not None and not verdict.trusted and trust.requires):
                # Once per process, before its first use: every byte as the (signed) record
                # says - a replaced file of the same size passes the size check.
                check_checksums(store, prefix, record)
                self._checksummed[key] = data
        except Exception as exc:  # noqa: BLE001 - any defect is a miss (plus a quarantine)
            if self.read_only:
                self.skip(key, str(exc))
            elif quarantine:
                self.withdraw(store, key, str(exc), tier="local")
            return None
        if verdict is not None and not verdict.trusted:
            if self.read_only and self.trust.requires:  # said once, by `skip`; never loaded
                self.skip(key, f"untrusted: {verdict.reason}")
                return None
            # Under require the locked re-check decides (and says so); under warn every
            # hit is used and counted.
            if (quarantine or not self.trust.requires) and self._admit(key, "local", verdict):
                pass
            else:
                if quarantine:  # withdrawn (evidence kept); the graph is compiled here
                    quarantine_entry(store, key, f"untrusted: {verdict.reason}", warn=False)
                return None
        return self.result(key, prefix, record, "local", time.perf_counter() - start)

    def entries(self) -> list[str]:
        """Keys of every published local entry."""
        return [n for n in self.store.published_children("") if len(n) == 32]

    def read_entry(self, key: str) -> EntryRecord:
        prefix = self.store.published(key)
        if prefix is None:
            raise EntryProblem(f"{self.url}/{key}: no such entry")
        return read_record(self.store, prefix)

    # ------------------------------------------------------------ withdrawals
    def skip(self, key: str, reason: str) -> None:
        """A read-only tier's defective or untrusted entry: a miss, said once per key and
        process (a ``verification_failed`` event, tier ``read-only``), never withdrawn."""
        if key in self._skipped:
            return
        self._skipped.add(key)
        self.record(VerificationFailed(key=key, at=time.time(), tier="read-only",
                                       reason=reason))  # fmt: skip
        logger.warning("compile cache: skipping entry %s of the read-only tier %s (%s); it "
                       "is fetched or compiled instead, the tier is left as it is",
                       key, self.url, reason)  # fmt: skip

    def withdraw(
        self, store: Store, key: str, reason: str, *, tier: str, version: str | None = None
    ) -> None:
        """Withdraw a defective entry of `store` (this tier, or the remote one: it becomes a
        miss) and say so once, in this tier's event log; with `version`, only that
        publication (one another node published since stays). A read-only tier's own
        entries are skipped instead (`skip`)."""
        if self.read_only and store is self.store:
            self.skip(key, reason)
            return
        self.record(VerificationFailed(key=key, at=time.time(), tier=tier, reason=reason))
        if store is self.store:
            self._forget(key)
        quarantine_entry(store, key, reason, version=version)

    def verify(self, key: str) -> str | None:
        """Full check of a local entry; returns the problem (and quarantines) or None.

        Runs under the key's lock, so it never withdraws an entry that a compile or fetch
        is replacing at that moment.
        """
        if self.store.published(key) is None:
            return f"{self.url}/{key}: no such entry"
        with self.store.lock(key, lease_duration=self.lease_duration, timeout=self.timeout):
            problem = verify_entry(self.store, key)
            if problem is not None and self.store.published(key) is not None:
                self.withdraw(self.store, key, problem, tier="local")
        return problem
