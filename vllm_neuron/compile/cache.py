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
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from vllm_neuron.backends import (
    EventLog,
    LockTimeout,
    Record,
    Store,
    normalize_location,
    open_store,
    validate_hex,
)

from .building import CompileFn, Compiler
from .entry import (
    ENTRY_RECORD,
    EntryProblem,
    EntryRecord,
    decode_record,
    read_record,
)
from .events import (
    EVENTS_STREAM,
    CacheHit,
    CacheMiss,
    Deferred,
    Fetched,
    LoadFailed,
    LockWaited,
    Untrusted,
    VerificationFailed,
)
from .failures import (
    FAILURES_DIR,
    recent_failure,
)
from .fleet import RemoteSingleFlight
from .gc import STAGING_MAX_AGE
from .inventory import verify_entry
from .load_notes import note_load_failure
from .outcomes import (
    CacheResult,
    CompileError,
    CompileWorkerLost,
    DeferCompile,
    PendingCompile,
    PrecompiledOnlyMiss,
    RemoteWrite,
)
from .promote import promote_entry
from .quarantine import PublicationProblem, quarantine_entry
from .remote_tier import REMOTE_RETRY_AFTER, RemoteTier, fetch_entry
from .signing import Verdict
from .slots import CompileSlots
from .tier_health import (
    LOCAL_DISK_FULL_OR_READ_ONLY,
    LocalTierFault,
    tier_dir,
    unwritable_cause,
)
from .trust import TrustPolicy, UntrustedEntry, trust_policy
from .upkeep import TierUpkeep

__all__ = [  # noqa: RUF022 - grouped: settings and names, then types
    "EVENT_OBSERVERS", "FAILURES_DIR", "REMOTE_RETRY_AFTER", "STAGING_MAX_AGE",
    "CacheResult", "CompileError", "CompileFn", "PrecompiledOnlyMiss", "TwoTierCache",
]

logger = logging.getLogger("vllm_neuron.compile")

WorkerCompile = Callable[[], "tuple[CompileFn, Callable[[], None]] | None"]
"""Prepares a graph for a compile worker (`TwoTierCache.begin`): the compile to run, and
what discards the prepared job; None when the graph cannot go to a worker."""

EVENT_OBSERVERS: list[Callable[[Record], None]] = []
"""Told every event any cache of this process records, before it is written; each must
never raise. Empty (one empty loop per event) unless vllm_neuron.metrics installed its
counters, which it does only inside vLLM."""

class TwoTierCache:
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
        self._slots = None if compile_workers is None else CompileSlots(
            self.local, compile_workers, lease_duration=lease_duration)
        self._loaded: dict[str, CacheResult] = {}
        self._pool: ThreadPoolExecutor | None = None  # background compiles (begin's workers)
        self._pool_lock = threading.Lock()
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

    # ------------------------------------------------------------- events
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

    # -------------------------------------------------------------- local
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

    def heal_unloadable(
        self, result: CacheResult, error: str, compile_fn: CompileFn, *,
        components: Mapping[str, str], piece: str | None = None,
    ) -> CacheResult:
        """`result`'s entry passed its checksums but would not load here: record a
        `load_failed` event; withdraw it from the local tier (a quarantine note kept) unless
        another process replaced it meanwhile (then that one is served), and compile the
        graph again under the key's lock, not fetched again. A fetched entry is not withdrawn
        from the remote on this node's word alone: it gets this host's note
        (`load_notes`). Where the tier cannot withdraw it or take the lock, the graph is
        compiled and served from scratch; in pre-compiled-only mode `PrecompiledOnlyMiss`
        says why, and nothing is withdrawn."""
        key = result.key
        self._loaded.pop(key, None)
        self._record(LoadFailed(key=key, at=time.time(), source=result.source, error=error))
        if self.precompiled_only:
            raise PrecompiledOnlyMiss(
                f"the compile cache entry {key} does not load here ({error}), and "
                "VLLM_NEURON_DISABLE_WARMUP_COMPILE=1 forbids compiling at runtime"
            )
        remote = self.remote if result.source == "remote" else None
        if remote is not None:  # a note for the fleet's operators, not a withdrawal
            note_load_failure(remote, key, error)
        try:
            with self.local.lock(key, lease_duration=self.lease_duration, timeout=self.timeout):
                try:
                    current: EntryRecord | None = self.read_entry(key)
                except EntryProblem:
                    current = None
                if current == result.record:
                    if not quarantine_entry(self.local, key, f"does not load here: {error}",
                                            warn=False):  # fmt: skip
                        raise LocalTierFault(f"could not withdraw the entry {key}")
                    current = None
                replaced = None if current is None else self.lookup_local(key)
                healed = replaced or self._compile_here(
                    key, compile_fn, components, piece, True, time.monotonic() + self.timeout)()
        except (LocalTierFault, OSError) as exc:
            if isinstance(exc, OSError) and unwritable_cause(exc, tier_dir(self.local)) is None:
                raise
            out_dir, record, seconds = self._compiler.serve_from_scratch(
                key, compile_fn, components, piece, str(exc))
            healed = CacheResult(key, out_dir, record, "uncached", seconds, "")
        self._loaded[key] = healed
        return healed

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

    def begin(
        self, key: str, compile_fn: CompileFn, *, components: Mapping[str, str] | None = None,
        piece: str | None = None, worker: WorkerCompile | None = None,
    ) -> CacheResult | PendingCompile:
        """`get_or_compile` for a caller that traces several graphs before it runs any: where
        that would wait - another process holds the key's lock or the fleet's lease, or no
        compile slot of the node is free - a `PendingCompile` comes back at once (and a
        `deferred` event says why), and the wait happens at its `result()`.

        With `worker`, a graph this process wins is compiled in the background too: `worker()`
        prepares it here, in the tracing thread, and returns the compile to run in a worker
        process plus what discards the prepared job (None: compile in place, now); a thread of
        this cache then runs the flow with it (`deferred` event, reason ``worker``). A worker
        that cannot run (`CompileWorkerLost`) costs an in-place compile at the first call.
        With VLLM_NEURON_DEFER_COMPILES=0 (`defer_compiles`) this is `get_or_compile`."""
        components = components or {}
        if not self.defer_compiles:
            return self._get(key, compile_fn, components, piece, wait=True, started=None)
        at = time.time()
        try:
            return self._get(key, compile_fn, components, piece, wait=False, started=at,
                             to_worker=worker is not None)
        except DeferCompile as deferral:
            reason = deferral.reason
        in_place = compile_fn
        if reason == "worker":
            assert worker is not None
            prepared = worker()
            if prepared is None:  # no worker for this graph: compiled here and now
                return self._get(key, compile_fn, components, piece, wait=True, started=at)
            future = self._compile_pool().submit(self._compile_in_worker, key, prepared,
                                                 components, piece, at)  # fmt: skip
        self._record(Deferred(key=key, at=at, reason=reason, piece=piece or ""))

        def resolve() -> CacheResult:
            if reason == "worker":
                try:
                    return future.result()
                except CompileWorkerLost as exc:
                    logger.warning("compile cache: %s; compiling %s in this process", exc, key)
            return self._get(key, in_place, components, piece, wait=True, started=at)

        return PendingCompile(key, reason, at, resolve)

    def _compile_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:  # threads that wait: the node's slots bound the compiles
                self._pool = ThreadPoolExecutor(max_workers=64,
                                                thread_name_prefix="vllm-neuron-compile")
            return self._pool

    def _compile_in_worker(self, key: str, prepared: tuple[CompileFn, Callable[[], None]],
                           components: Mapping[str, str], piece: str | None,
                           started: float) -> CacheResult:  # fmt: skip
        compile_fn, discard = prepared
        try:
            return self._get(key, compile_fn, components, piece, wait=True, started=started)
        finally:
            discard()

    def _get(
        self, key: str, compile_fn: CompileFn, components: Mapping[str, str],
        piece: str | None, *, wait: bool, started: float | None, to_worker: bool = False,
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
            self._record(
                CacheHit(key=key, at=time.time(), seconds=hit.seconds,
                         compile_seconds=hit.record.compile_seconds)
            )
            self._loaded[key] = hit
            return hit
        result = self._locked_miss(key, compile_fn, components, piece, wait=wait,
                                   started=started, to_worker=to_worker)
        self._loaded[key] = result
        if result.source in ("compiled", "remote"):  # published: the tier grew
            self.keep_within_bound()
        return result

    def _locked_miss(
        self, key: str, compile_fn: CompileFn, components: Mapping[str, str], piece: str | None,
        *, wait: bool, started: float | None, to_worker: bool = False,
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
                                          to_worker)
        waited = time.perf_counter() - t0
        try:
            if waited > 0.05:
                self._record(LockWaited(key=key, at=time.time(), seconds=waited))
            hit = self.lookup_local(key)
            if hit is not None:
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
        wait: bool, deadline: float, to_worker: bool = False,
    ) -> Callable[..., CacheResult]:
        """The compile this process does once it has won `key`: in one of the node's compile
        slots (without `wait`, `DeferCompile` when none is free, or - `to_worker` -
        `DeferCompile("worker")`: `begin` hands it to a worker); with `owed`, the promotion
        to the remote is owed first (settled by it, or by a later start)."""

        def compile_here(*, owed: bool = False) -> CacheResult:
            if to_worker and not wait:
                raise DeferCompile("worker")
            if self._slots is None:
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

    # --------------------------------------------------------------- upkeep
    def keep_within_bound(self) -> None:
        """Evict the least recently used entries above the bound, never one this process
        has loaded (its artifact is loaded from the entry); best-effort (eviction.py)."""
        with self._bound_lock:
            self._upkeep.keep_within_bound(list(self._loaded))

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
