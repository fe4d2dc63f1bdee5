"""One node's view of its local tier: the part of the cache that reads, withdraws and
accounts for what is already there - lookups, quarantine, verification, the size bound, the
event log - with no compile, fetch or fleet in it (those are `cache.py`'s).

`TwoTierCache` is built on it; the attributes below are set by its constructor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm_neuron.backends import EventLog, Record, Store

from ..entry.check import verify_entry
from ..entry.events import Untrusted, VerificationFailed
from ..entry.outcomes import CacheResult
from ..entry.record import ENTRY_RECORD, EntryProblem, EntryRecord, decode_record, read_record
from ..tiers.quarantine import quarantine_entry
from ..trust.signing import Verdict

if TYPE_CHECKING:
    from ..trust.policy import TrustPolicy
    from ..upkeep.background import TierUpkeep

__all__ = ["EVENT_OBSERVERS", "LocalTierView"]

logger = logging.getLogger("vllm_neuron.compile")

EVENT_OBSERVERS: list[Callable[[Record], None]] = []
"""Told every event any cache of this process records, before it is written; each must
never raise. Empty (one empty loop per event) unless vllm_neuron.metrics installed its
counters, which it does only inside vLLM."""


class LocalTierView:
    """Lookups, withdrawals and accounting on the local tier (see the module doc)."""

    local: Store
    local_dir: str
    remote_url: str | None
    timeout: float
    lease_duration: float
    trust: TrustPolicy
    _untrusted: dict[str, str]
    _loaded: dict[str, CacheResult]
    _prefetched: set[str]
    _decoded: dict[str, tuple[bytes, EntryRecord]]
    _events: EventLog
    _events_broken: bool
    _upkeep: TierUpkeep
    _bound_lock: threading.Lock

    def _record(self, event: Record) -> None:
        for observe in EVENT_OBSERVERS:
            observe(event)
        if self._events_broken:
            return
        try:
            self._events.append(event)
        except Exception as exc:  # noqa: BLE001 - statistics never break a compile
            self._events_broken = True
            logger.warning("compile cache: cannot record events in %s: %s", self.local_dir, exc)

    def _result(self, key: str, prefix: str, record: EntryRecord, source: str,
                seconds: float) -> CacheResult:
        # The documented door (docs/storage.md): the toolchain loads from this directory.
        return CacheResult(key, self.local.local_dir_of(prefix), record, source, seconds, prefix)

    def lookup_local(self, key: str, *, quarantine: bool = True) -> CacheResult | None:
        """A published, size-checked local entry or None (no lock taken).

        A defective entry is a miss; with `quarantine` it is also withdrawn. The decision
        flow's first, unlocked check passes ``quarantine=False`` and leaves the withdrawal
        to the re-check under the key's lock: an unlocked withdrawal could remove the good
        entry that the lock holder has just published in place of the defective one.
        """
        start = time.perf_counter()
        local = self.local
        try:
            # One store operation for the record (on local disk: one read; the directory is
            # stat'ed only when the record is absent), one for the sizes (a stat per file).
            found = local.read_published(key, ENTRY_RECORD)
        except OSError:
            found = (key, b"")  # unreadable (an I/O error): a defective entry
        if found is None:
            return None
        prefix, data = found
        try:
            if data is None:
                # A published entry without a record (deleted, or not a file) is defective,
                # not a miss, or its directory would block the recompiled entry from being
                # published in its place.
                raise EntryProblem(f"{self.local_dir}/{key}: {ENTRY_RECORD} is missing")
            known = self._decoded.get(key)
            if known is not None and known[0] == data:
                record = known[1]  # the same bytes as last time: the same (frozen) record
            else:
                record = decode_record(data, source=f"{self.local_dir}/{key}/{ENTRY_RECORD}")
                if record.key != key:
                    raise EntryProblem(f"{self.local_dir}/{key}: record names key {record.key}")
                self._decoded[key] = (data, record)
            local.check_sizes(prefix, record.files)
            trust = self.trust
            verdict = None if trust.mode == "off" else trust.judge_local(record, data, local,
                                                                         prefix)
        except Exception as exc:  # noqa: BLE001 - any defect is a miss (plus a quarantine)
            if quarantine:
                self.quarantine(local, key, str(exc), tier="local")
            return None
        if verdict is not None and not verdict.trusted:
            # Under require the locked re-check decides (and says so); under warn every
            # hit is used and counted.
            if (quarantine or not self.trust.requires) and self._admitted(key, "local", verdict):
                pass
            else:
                if quarantine:  # withdrawn (evidence kept); the graph is compiled here
                    quarantine_entry(local, key, f"untrusted: {verdict.reason}", warn=False)
                return None
        # The documented door (docs/storage.md): the toolchain loads from this directory.
        return CacheResult(key, local.local_dir_of(prefix), record, "local",
                           time.perf_counter() - start, prefix)

    def _admitted(self, key: str, tier: str, verdict: Verdict) -> bool:
        """Whether the policy lets this process use an entry with `verdict` (one warning
        per signer); an `untrusted` event when it is not trusted."""
        where = self.local_dir if tier == "local" else str(self.remote_url)
        admitted = self.trust.admits(key, where, verdict)
        if not verdict.trusted and key not in self._untrusted:
            self._record(Untrusted(key=key, at=time.time(), tier=tier, status=verdict.status,
                                   reason=verdict.reason, refused=not admitted,
                                   signer=verdict.key_id))  # fmt: skip
            self._untrusted[key] = verdict.reason  # one event per entry and process
        return admitted

    def quarantine(
        self, store: Store, key: str, reason: str, *, tier: str, version: str | None = None
    ) -> None:
        """Withdraw a defective entry (it becomes a miss) and say so once; with `version`,
        only that publication (one another node published since stays)."""
        self._record(VerificationFailed(key=key, at=time.time(), tier=tier, reason=reason))
        if store is self.local:
            self._loaded.pop(key, None)
        quarantine_entry(store, key, reason, version=version)

    def keep_within_bound(self) -> None:
        """Evict the least recently used entries above the bound, never one this process
        has loaded (its artifact is loaded from the entry) or prefetched for a call still to
        come; best-effort (eviction.py)."""
        with self._bound_lock:
            # What this process loaded, and what its prefetcher fetched for a first call
            # still to come (evicted now, that call would only fetch it again).
            self._upkeep.keep_within_bound([*self._loaded, *self._prefetched.copy()])

    def wait_for_upkeep(self, timeout: float | None = None) -> bool:
        """Wait for the background pass this cache started when it opened (what killed
        processes left collected, owed promotions paid: upkeep.py); True when it ended."""
        return self._upkeep.wait_for_background(timeout)

    def entries(self) -> list[str]:
        """Keys of every published local entry."""
        return [n for n in self.local.published_children("") if len(n) == 32]

    def read_entry(self, key: str) -> EntryRecord:
        prefix = self.local.published(key)
        if prefix is None:
            raise EntryProblem(f"{self.local_dir}/{key}: no such entry")
        return read_record(self.local, prefix)

    def verify(self, key: str) -> str | None:
        """Full check of a local entry; returns the problem (and quarantines) or None.

        Runs under the key's lock, so it never withdraws an entry that a compile or fetch
        is replacing at that moment.
        """
        if self.local.published(key) is None:
            return f"{self.local_dir}/{key}: no such entry"
        with self.local.lock(key, lease_duration=self.lease_duration, timeout=self.timeout):
            problem = verify_entry(self.local, key)
            if problem is not None and self.local.published(key) is not None:
                self.quarantine(self.local, key, problem, tier="local")
        return problem
