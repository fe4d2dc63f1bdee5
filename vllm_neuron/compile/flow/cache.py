"""The two-tier compile cache: local per node, optional remote shared by every node.

The decision flow (docs/compile-cache.md), per key:

1. fast local check, no lock (a hit is size-checked: one stat per file);
2. take the key's lock (different keys never contend);
3. re-check local: another process may have finished while we waited;
4. a compile by the holder we waited for failed -> raise its error now, not at timeout;
5. remote configured -> fetch, verify every checksum, publish locally;
6. pre-compiled-only mode -> `PrecompiledOnlyMiss`;
7. remote writable (VLLM_NEURON_REMOTE_WRITE=auto) -> the fleet's single flight
   (`fleet.py`): take the key's remote lease and go on to 8 then promote, or wait for the
   node that holds it and fetch what it publishes;
8. compile into a staging directory, write the commit record last, publish atomically.

Correctness never rests on a lock or a lease: publication is first-writer-wins, so a
holder that died (its kernel lock is dropped, its lease expires) only costs the next one a
compile, and nothing half-built is ever visible. The remote tier is best-effort: when it
fails, one warning, and the node carries on alone.

Step 8 runs in one of the node's compile slots (`slots.py`). `begin` (`deferral.py`) is this
flow for a caller that traces several graphs before it calls any: where it would wait, it
returns a `PendingCompile` instead. What reads, withdraws and accounts for the local tier
without compiling is `local_view.py`'s.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from vllm_neuron.backends import (
    EventLog,
    LockTimeout,
    Store,
    normalize_location,
    open_store,
    validate_hex,
)
from vllm_neuron.identity import tensor_parallel_size

from ..entry.events import (
    EVENTS_STREAM,
    CacheHit,
    CacheMiss,
    Fetched,
    LockWaited,
)
from ..entry.failure_notes import (
    FAILURES_DIR,
    recent_failure,
)
from ..entry.outcomes import (
    CacheResult,
    CompileError,
    DeferCompile,
    PendingCompile,
    PrecompiledOnlyMiss,
    RemoteWrite,
)
from ..entry.record import (
    EntryProblem,
    EntryRecord,
)
from ..tiers.build import CompileFn, Compiler
from ..tiers.health import (
    LOCAL_DISK_FULL_OR_READ_ONLY,
    tier_dir,
    unwritable_cause,
)
from ..tiers.promote import promote_entry
from ..tiers.quarantine import PublicationProblem
from ..tiers.remote import REMOTE_RETRY_AFTER, RemoteTier, fetch_entry
from ..trust.policy import TrustPolicy, UntrustedEntry, trust_policy
from ..upkeep.background import TierUpkeep
from ..upkeep.collect import STAGING_MAX_AGE
from ..workers.slots import CompileSlots
from .deferral import DeferringFlow, WorkerCompile
from .fleet import RemoteSingleFlight
from .healing import HealingFlow
from .local_view import EVENT_OBSERVERS, LocalTierView
from .prefetch import Prefetcher

__all__ = [  # noqa: RUF022 - grouped: settings and names, then types
    "EVENT_OBSERVERS", "FAILURES_DIR", "REMOTE_RETRY_AFTER", "STAGING_MAX_AGE",
    "CacheResult", "CompileError", "CompileFn", "PrecompiledOnlyMiss", "TwoTierCache",
]

logger = logging.getLogger("vllm_neuron.compile")

class TwoTierCache(LocalTierView, DeferringFlow, HealingFlow):
    """One node's view of the cache: a local store plus an optional remote store."""

    def __init__(
        self,
        local: str | Store,
        *,
        remote: str | None = None,
        timeout: float = 600.0,
        disabled: bool = False,
        precompiled_only: bool = False,
        toolchain: str = "host",
        target: str = "cpu",
        lease_duration: float = 30.0,
        remote_options: Mapping[str, Any] | None = None,
        remote_write: RemoteWrite = "auto",
        remote_lease_seconds: float = 30.0,
        compile_retry_after: float = 300.0,
        max_size: int | None = None,
        trust: TrustPolicy | None = None,
        compile_workers: int | None = None,
        defer_compiles: bool = True,
    ) -> None:
        if disabled and precompiled_only:
            raise ValueError(
                "VLLM_NEURON_DISABLE_WARMUP_COMPILE=1 is incompatible with "
                "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE=1: with no cache nothing can be "
                "pre-compiled"
            )
        self.local: Store = (
            open_store(normalize_location(local)) if isinstance(local, str) else local
        )
        self.local_dir = self.local.url  # where the local tier is, for messages and tools
        self.remote_url = remote or None
        self._remote = RemoteTier(
            self.remote_url, remote_options or {}, self._record, write=remote_write)
        self.remote_write: RemoteWrite = remote_write
        # Whose entries this process loads, and whether it signs (docs/trust.md).
        self.trust = trust_policy() if trust is None else trust
        self._untrusted: dict[str, str] = {}  # key -> why its entry is not trusted
        self._fleet = RemoteSingleFlight(
            self._remote, lease_seconds=remote_lease_seconds, retry_after=compile_retry_after,
            record=self._record)  # fmt: skip
        self.timeout = timeout
        self.disabled = disabled
        self.precompiled_only = precompiled_only
        self.toolchain = toolchain
        self.target = target
        self.lease_duration = lease_duration
        # VLLM_NEURON_DEFER_COMPILES: whether `begin` may hand back a PendingCompile.
        self.defer_compiles = defer_compiles
        # VLLM_NEURON_COMPILE_WORKERS: the node's compile slots (None: compiles unbounded).
        self.compile_workers = compile_workers
        self._slots = None if compile_workers is None else CompileSlots(
            self.local, compile_workers, lease_duration=lease_duration, peers=tensor_parallel_size)
        self._loaded: dict[str, CacheResult] = {}
        self._in_flight: dict[str, PendingCompile] = {}  # begin's worker compiles, by key
        self._prefetcher = Prefetcher(self._prefetch_once, patience=timeout)
        self._prefetched: set[str] = set()  # fetched by it, not yet looked up (deferral.py)
        self._bound_lock = threading.Lock()  # one eviction pass at a time
        # The last record bytes read for each key and their decoding: a hit still reads the
        # record and stats every file, but bytes seen before are not decoded again.
        self._decoded: dict[str, tuple[bytes, EntryRecord]] = {}
        self._events: EventLog = self.local.log(
            EVENTS_STREAM, writer=f"{socket.gethostname()}-{os.getpid()}"
        )
        self._events_broken = False
        self._compiler = Compiler(
            self.local, toolchain=toolchain, target=target, record=self._record,
            sign=self.trust.signature_for if self.trust.signer is not None else None)
        # The size bound, collection, owed promotions; failure notes live as long as a wait
        self._upkeep = TierUpkeep(
            self.local, self._remote, max_size=None if disabled else max_size,
            lease_seconds=remote_lease_seconds, lock_lease=lease_duration,
            failure_max_age=max(compile_retry_after, timeout), record=self._record,
            may_publish=self.trust.may_publish_remote,
            quarantine=lambda key, why: self.quarantine(self.local, key, why, tier="local"))
        self._upkeep.at_start()

    # ------------------------------------------------------------- remote
    @property
    def remote(self) -> Store | None:
        """The remote store, or None when unset or currently unreachable."""
        return self._remote.store()

    def fetch_remote(self, key: str) -> CacheResult | None:
        """Copy `key` from the remote tier into the local tier, verifying every checksum."""
        remote = self.remote
        if remote is None:
            return None
        start = time.perf_counter()
        try:
            record = fetch_entry(remote, key, self.local, policy=self.trust,
                                 admit=lambda v: self._admitted(key, "remote", v))
        except UntrustedEntry:  # refused (and said) by the policy: a miss, nothing copied
            return None
        except PublicationProblem as exc:  # judged: withdraw that version only
            self.quarantine(remote, key, str(exc), tier="remote", version=exc.version)
            return None
        except EntryProblem as exc:
            self.quarantine(remote, key, str(exc), tier="remote")
            return None
        except FileNotFoundError as exc:
            logger.warning("compile cache: remote entry %s/%s vanished while fetching: %s",
                           remote.url, key, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - the remote is best-effort
            fault = unwritable_cause(exc)
            if fault is not None and fault.errno in LOCAL_DISK_FULL_OR_READ_ONLY:
                # This node's disk refused the copy: no remote outage. The graph compiles,
                # and is served from scratch if the tier still has no room.
                logger.warning("compile cache: fetching %s into %s failed: %s; compiling it "
                               "here instead", key, self.local_dir, fault)  # fmt: skip
                return None
            self._remote.failed(exc)
            return None
        local = None if record is None else self.lookup_local(key)
        if record is None or local is None:
            return None
        seconds = time.perf_counter() - start
        self._record(Fetched(key=key, at=time.time(), seconds=seconds, size=record.total_size,
                             remote=str(self.remote_url),
                             compile_seconds=record.compile_seconds))
        return self._result(key, local.prefix, local.record, "remote", seconds)

    # ------------------------------------------------------------ compile
    def get_or_compile(
        self, key: str, compile_fn: CompileFn, *, components: Mapping[str, str] | None = None,
        piece: str | None = None, started: float | None = None,
    ) -> CacheResult:
        """The artifacts for `key`: from memory, local, remote, or a compile, in that order.
        `piece` (which piece of the model it is) only labels the compile's events (stats).
        `started` (epoch seconds) is when the caller began to want `key` (a deferral): a
        compile that failed since then is this caller's failure too."""
        return self._get(key, compile_fn, components or {}, piece, wait=True, started=started)

    def _get(
        self, key: str, compile_fn: CompileFn, components: Mapping[str, str],
        piece: str | None, *, wait: bool, started: float | None,
        worker: WorkerCompile | None = None, have_slot: bool = False,
    ) -> CacheResult:
        validate_hex(key, length=32, what="compile cache key")
        cached = self._loaded.get(key)
        if cached is not None:
            self._record(CacheHit(key=key, at=time.time(), tier="memory"))
            return msgspec.structs.replace(cached, source="memory", seconds=0.0)
        if self.disabled:
            out_dir, record, seconds = self._compiler.uncached(key, compile_fn, components, piece)
            return CacheResult(key, out_dir, record, "uncached", seconds, "")
        self._upkeep.start_background()  # once (upkeep.py)
        hit = self.lookup_local(key, quarantine=False)
        if hit is not None:
            if not self._first_use_of_prefetched(key):
                self._record(
                    CacheHit(key=key, at=time.time(), seconds=hit.seconds,
                             compile_seconds=hit.record.compile_seconds)
                )
            self._loaded[key] = hit
            return hit
        result = self._locked_miss(key, compile_fn, components, piece, wait=wait,
                                   started=started, worker=worker, have_slot=have_slot)
        self._loaded[key] = result
        if result.source in ("compiled", "remote"):  # published: the tier grew
            self.keep_within_bound()
        return result

    def _locked_miss(
        self, key: str, compile_fn: CompileFn, components: Mapping[str, str], piece: str | None,
        *, wait: bool, started: float | None, worker: WorkerCompile | None = None,
        have_slot: bool = False,
    ) -> CacheResult:
        wait_start = time.time() if started is None else started
        deadline = time.monotonic() + self.timeout
        t0 = time.perf_counter()
        try:
            lock = self.local.lock(key, lease_duration=self.lease_duration)
            lock.acquire(timeout=self.timeout if wait else 0)
        except LockTimeout:
            if not wait:  # a rank of this node compiles it: trace on, wait at the first call
                raise DeferCompile("local-lock") from None
            raise TimeoutError(
                f"waited {self.timeout:g} s for another process to compile {key} "
                f"(NEURON_LIBTORCH_COMPILATION_TIMEOUT={self.timeout:g}); the lock is "
                f"{self.local_dir}/.locks/{key}"
            ) from None
        except OSError as exc:  # a tier that filled up or turned read-only since it opened
            if unwritable_cause(exc, tier_dir(self.local)) is None:
                raise
            out_dir, record, seconds = self._compiler.serve_from_scratch(
                key, compile_fn, components, piece, f"cannot take the key's lock: {exc}")
            return CacheResult(key, out_dir, record, "uncached", seconds, "")
        compile_here = self._compile_here(key, compile_fn, components, piece, wait, deadline,
                                          worker, have_slot)
        waited = time.perf_counter() - t0
        try:
            if waited > 0.05:
                self._record(LockWaited(key=key, at=time.time(), seconds=waited))
            hit = self.lookup_local(key)
            if hit is not None:
                if not self._first_use_of_prefetched(key):
                    self._record(
                        CacheHit(key=key, at=time.time(), seconds=waited,
                                 compile_seconds=hit.record.compile_seconds)
                    )
                return self._result(key, hit.prefix, hit.record, "local-after-wait", waited)
            failure = recent_failure(self.local, key, since=wait_start)
            if failure is not None:
                raise CompileError(
                    f"compile of {key} failed in process {failure.pid} on {failure.host}: "
                    f"{failure.error}"
                )
            fetched = self.fetch_remote(key)
            if fetched is not None:
                return fetched
            if self.precompiled_only:
                self._record(CacheMiss(key=key, at=time.time()))
                where = f"the local cache {self.local_dir}"
                if self.remote_url:
                    where += f" or the remote cache {self.remote_url}"
                untrusted = self._untrusted.get(key)
                if untrusted is not None:
                    where += f" (an entry is there, but untrusted: {untrusted})"
                raise PrecompiledOnlyMiss(
                    f"compile cache miss for {key} in {where}, and "
                    "VLLM_NEURON_DISABLE_WARMUP_COMPILE=1 forbids compiling at runtime"
                )
            if not self.trust.may_publish_remote:  # cannot sign: waits, never leases
                return self._fleet.wait_without_lease(
                    key, started=wait_start, deadline=deadline, wait=wait,
                    fetch=lambda: self.fetch_remote(key),
                    compile_alone=compile_here,
                    timeout_error=lambda: self._timeout(key, f"another node to compile {key}"))
            if self._remote.read_only:  # VLLM_NEURON_REMOTE_WRITE=off, or writes refused
                return compile_here()
            return self._fleet.run(
                key,
                started=wait_start,
                deadline=deadline,
                wait=wait,
                fetch=lambda: self.fetch_remote(key),
                compile_here=lambda: compile_here(owed=True),
                promote=lambda remote: self._promote(remote, key),
                timeout_error=lambda: self._timeout(key, f"another node to compile {key}"),
            )
        finally:
            lock.release()

    def _timeout(self, key: str, what: str) -> TimeoutError:
        return TimeoutError(
            f"waited {self.timeout:g} s for {what} "
            f"(NEURON_LIBTORCH_COMPILATION_TIMEOUT={self.timeout:g})"
        )

    def _compile_here(
        self, key: str, compile_fn: CompileFn, components: Mapping[str, str], piece: str | None,
        wait: bool, deadline: float, worker: WorkerCompile | None = None,
        have_slot: bool = False,
    ) -> Callable[..., CacheResult]:
        """The compile this process does once it has won `key`: in one of the node's compile
        slots (without `wait`, `DeferCompile` when none is free, or - with `worker` - the
        graph prepared for a background compile and `DeferCompile("worker")` carrying it:
        `begin` hands it to a worker); with `owed`, the promotion to the remote is owed first
        (settled by it, or by a later start)."""

        def compile_here(*, owed: bool = False) -> CacheResult:
            if worker is not None and not wait:
                # Prepared here, under the key's lock (and lease): a rank that traces the
                # graph meanwhile defers to this one instead of preparing it too.
                prepared = worker()
                if prepared is not None:
                    raise DeferCompile("worker", prepared)
                # no worker for this graph: compiled here, now, if a slot is free
            if self._slots is None or have_slot:  # no bound, or the caller holds a slot
                if owed:
                    self._upkeep.owe(key)
                return self._compile_and_publish(key, compile_fn, components, piece)
            with self._slots.held(wait=wait, deadline=deadline,
                                  what=f"{key} ({piece})" if piece else key):
                if owed:
                    self._upkeep.owe(key)
                return self._compile_and_publish(key, compile_fn, components, piece)

        return compile_here

    def _promote(self, remote: Store, key: str) -> None:
        if self.local.published(key) is not None:
            promote_entry(self.local, remote, key, policy=self.trust)
        # else: served from scratch (the tier had no room): nothing to promote; the lease
        # comes free and another node compiles it. A local fault is no remote outage.
        self._upkeep.settled(key)

    def _compile_and_publish(
        self, key: str, compile_fn: CompileFn, components: Mapping[str, str], piece: str | None
    ) -> CacheResult:
        scratch, record, seconds = self._compiler.publish_where_room(
            key, compile_fn, components, piece)
        if scratch is not None:  # the tier had no room: served from the scratch area
            return CacheResult(key, scratch, record, "uncached", seconds, "")
        published = self.lookup_local(key)
        if published is None:
            raise CompileError(f"compiled {key} but its entry in {self.local_dir} is not readable")
        return self._result(key, published.prefix, published.record, "compiled", seconds)
