"""The two-tier compile cache: the per-key decision, in one place, top to bottom.

Per key (docs/compile-cache.md), `_get` and `_locked_miss`:

1. memory: what this process loaded already;
2. fast local check, no lock (a hit is size-checked: one stat per file); then the
   read-only tiers (a baked image's cache, a local tier this process cannot write:
   `tiers/baked.py`), checked the same way and never written;
3. take the key's lock (different keys never contend);
4. re-check local: another process may have finished while we waited;
5. a compile by the holder we waited for failed -> raise its error now, not at timeout;
6. remote configured -> fetch, verify every checksum (and the signature), publish locally;
7. pre-compiled-only mode -> `PrecompiledOnlyMiss`;
8. trust: a process that cannot sign never leases: it waits for a builder, else compiles for
   itself alone;
9. remote writable (VLLM_NEURON_REMOTE_WRITE=auto) -> the fleet's single flight
   (`fleet.py`) says who compiles: `Fetched` (another node published it), `Won` (this
   process: with the key's lease, or alone when the remote is down) or `Wait`;
10. compile into a staging directory in one of the node's compile slots, write the commit
    record last, publish atomically (`tiers/build.py`); promote to the remote while the
    lease holds, or note the failure there for every node's waiters.

Correctness never rests on a lock or a lease: publication is first-writer-wins, so a
holder that died (its kernel lock is dropped, its lease expires) only costs the next one a
compile, and nothing half-built is ever visible. The remote tier is best-effort: when it
fails, one warning, and the node carries on alone.

Two callers share the flow. `get_or_compile` waits wherever the flow waits. `begin` is for a
caller that traces several graphs before it calls any (vLLM's pieces): where the flow would
start to wait, it hands back a `Wait(reason)` value, which `begin` turns into a
`PendingCompile` whose `result()` runs the flow again, waiting, at the graph's first call; a
graph this process wins can go to a compile worker meanwhile. And `heal_unloadable` is the
runtime's call when an entry that verified will not load here: withdrawn and compiled again
under the key's lock.

What reads and withdraws what is already in the local tier is the `LocalTier` this cache
holds (`tiers/local.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import msgspec

from vllm_neuron.backends import (
    LockTimeout,
    Record,
    Store,
    normalize_location,
    open_store,
    validate_hex,
)
from vllm_neuron.envs import redact_text
from vllm_neuron.identity import tensor_parallel_size

from ..entry.events import (
    CacheHit,
    CacheMiss,
    Deferred,
    Fetched,
    LoadFailed,
    LockWaited,
    Untrusted,
)
from ..entry.failure_notes import (
    clear_failure_note,
    forget_stopped,
    note_message,
    recent_failure,
)
from ..entry.load_failure_notes import note_load_failure
from ..entry.outcomes import (
    CacheResult,
    CompileError,
    CompileSlotTimeout,
    CompileWorkerLost,
    FetchedFromFleet,
    PendingCompile,
    PrecompiledOnlyMiss,
    RemoteWrite,
    Wait,
    Won,
)
from ..entry.record import EntryProblem, EntryRecord
from ..tiers.baked import ReadOnlyTiers, open_read_only_tier
from ..tiers.build import CompileFn, EntryBuilder
from ..tiers.health import LOCAL_DISK_FULL_OR_READ_ONLY, LocalTierFault, tier_dir, unwritable_cause
from ..tiers.local import LocalTier
from ..tiers.promote import promote_entry
from ..tiers.quarantine import PublicationProblem, quarantine_entry
from ..tiers.remote import RemoteTier, fetch_entry
from ..trust.policy import TrustPolicy, UntrustedEntry, trust_policy
from ..trust.signing import Verdict
from ..upkeep.background import TierUpkeep
from ..workers.slots import CompileSlots
from .fleet import RemoteSingleFlight
from .prefetch import Prefetcher

__all__ = [
    "CacheResult", "CompileError", "CompileFn", "PrecompiledOnlyMiss", "TwoTierCache",
    "WorkerCompile",
]

logger = logging.getLogger("vllm_neuron.compile")

WorkerCompile = Callable[[], "tuple[CompileFn, Callable[[], None]] | None"]
"""Prepares a graph for a compile worker (`TwoTierCache.begin`): the compile to run, and
what discards the prepared job; None when the graph cannot go to a worker."""


@dataclass(frozen=True)
class _Ask:
    """One pass of the flow for one key: what to compile it with, and how patient to be.

    `wait`: False for `begin`'s first pass (where waiting would start, a `Wait` comes back);
    `started` (epoch seconds): when the caller began to want the key - a compile that failed
    since then is its failure too; `worker`: prepares the graph for a compile worker;
    `have_slot`: the caller already holds one of the node's compile slots."""

    key: str
    compile_fn: CompileFn
    components: Mapping[str, str]
    piece: str | None
    wait: bool
    started: float | None = None
    worker: WorkerCompile | None = None
    have_slot: bool = False

    @property
    def what(self) -> str:
        return f"{self.key} ({self.piece})" if self.piece else self.key


class TwoTierCache:
    """One node's view of the cache: a local tier plus an optional remote tier."""

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
        read_only: Sequence[str | Store] = (),
        writes_bypassed: bool = False,
    ) -> None:
        if disabled and precompiled_only and not (writes_bypassed and read_only):
            raise ValueError(
                "VLLM_NEURON_DISABLE_WARMUP_COMPILE=1 is incompatible with "
                "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE=1: with no cache nothing can be "
                "pre-compiled"
            )
        self.local: Store = (
            open_store(normalize_location(local)) if isinstance(local, str) else local
        )
        self.local_dir = self.local.url  # where the local tier is, for messages and tools
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
        # Whose entries this process loads, and whether it signs (docs/trust.md).
        self.trust = trust_policy() if trust is None else trust
        self._untrusted: dict[str, str] = {}  # key -> why its entry is not trusted
        self._loaded: dict[str, CacheResult] = {}  # the memory tier: what this process loaded
        self.local_tier = LocalTier(
            self.local, trust=self.trust, lease_duration=lease_duration, timeout=timeout,
            admit=self._admitted, forget=lambda key: self._loaded.pop(key, None))
        record = self.local_tier.record
        # Consulted after the local tier, before the remote; never written (tiers/baked.py).
        self.read_only = ReadOnlyTiers(
            [open_read_only_tier(t) if isinstance(t, str) else t for t in read_only],
            trust=self.trust, admit=self._admitted, record=record)
        # `disabled` because nothing can be written (the assembly's bypass), not because the
        # user said so: the read-only tiers still serve every hit they hold (a hit writes
        # nothing); what misses is compiled uncached, or refused in pre-compiled-only mode.
        self.writes_bypassed = writes_bypassed
        self.remote_url = remote or None
        self.remote_write: RemoteWrite = remote_write
        self._remote = RemoteTier(self.remote_url, remote_options or {}, record,
                                  write=remote_write)  # fmt: skip
        self._fleet = RemoteSingleFlight(
            self._remote, lease_seconds=remote_lease_seconds, retry_after=compile_retry_after,
            timeout=timeout, record=record, trust=self.trust, stopped_in=self.local)  # fmt: skip
        self._slots = None if compile_workers is None else CompileSlots(
            self.local, compile_workers, lease_duration=lease_duration, peers=tensor_parallel_size)
        self._in_flight: dict[str, PendingCompile] = {}  # begin's worker compiles, by key
        self._prefetcher = Prefetcher(self._prefetch_once, patience=timeout)
        self._prefetched: set[str] = set()  # fetched by it, not yet looked up
        self._bound_lock = threading.Lock()  # one eviction pass at a time
        self._builder = EntryBuilder(
            self.local, toolchain=toolchain, target=target, record=record,
            sign=self.trust.signature_for if self.trust.signer is not None else None)
        # The size bound, collection, owed promotions; failure notes live as long as a wait
        self._upkeep = TierUpkeep(
            self.local, self._remote, max_size=None if disabled else max_size,
            lease_seconds=remote_lease_seconds, lock_lease=lease_duration,
            failure_max_age=max(compile_retry_after, timeout), record=record,
            may_publish=self.trust.may_publish_remote, policy=self.trust,
            quarantine=lambda key, why: self.local_tier.withdraw(self.local, key, why,
                                                                 tier="local"))  # fmt: skip
        self._upkeep.at_start()

    # ================================================================ the callers
    def get_or_compile(
        self, key: str, compile_fn: CompileFn, *, components: Mapping[str, str] | None = None,
        piece: str | None = None, started: float | None = None,
    ) -> CacheResult:
        """The artifacts for `key`: from memory, local, remote, or a compile, in that order.
        `piece` (which piece of the model it is) only labels the compile's events (stats).
        `started` (epoch seconds) is when the caller began to want `key` (a deferral): a
        compile that failed since then is this caller's failure too."""
        return self._waited_for(_Ask(key, compile_fn, components or {}, piece, wait=True,
                                     started=started))  # fmt: skip

    def begin(
        self, key: str, compile_fn: CompileFn, *, components: Mapping[str, str] | None = None,
        piece: str | None = None, worker: WorkerCompile | None = None,
    ) -> CacheResult | PendingCompile:
        """`get_or_compile` for a caller that traces several graphs before it runs any: where
        that would wait - another process holds the key's lock or the fleet's lease, or no
        compile slot of the node is free - a `PendingCompile` comes back at once (and a
        `deferred` event says why), and the wait happens at its `result()`.

        With `worker`, a graph this process wins is compiled in the background too: `worker()`
        prepares it here, in the tracing thread, under the key's lock (a rank tracing it
        meanwhile defers to this one), and returns the compile to run in a worker process
        plus what discards the prepared job (None: compile in place, now, if a slot is free);
        a thread of this cache then runs the flow with it (`deferred` event, reason
        ``worker``). A worker that cannot run (`CompileWorkerLost`) costs an in-place compile
        at the first call. With VLLM_NEURON_DEFER_COMPILES=0 (`defer_compiles`) this is
        `get_or_compile`."""
        components = components or {}
        if not self.defer_compiles:
            return self.get_or_compile(key, compile_fn, components=components, piece=piece)
        queued = self._in_flight.get(key)
        if queued is not None and not queued.done:
            return queued  # one job per key: a model's repeated layers are one graph
        at = time.time()
        ask = _Ask(key, compile_fn, components, piece, wait=False, started=at, worker=worker)
        outcome = self._get(ask)
        if isinstance(outcome, CacheResult):
            return outcome
        reason = outcome.reason
        if reason == "worker":
            future = _in_background(self._compile_in_worker, ask, outcome.prepared)
        self._record(Deferred(key=key, at=at, reason=reason, piece=piece or ""))
        if reason == "remote-lease":  # fetched once its holder publishes it (prefetch.py)
            self._prefetcher.add(key)
        later = replace(ask, wait=True, worker=None)  # the first call waits, compiles in place

        def resolve() -> CacheResult:
            self._prefetcher.forget(key)
            if reason == "worker":
                try:
                    return future.result()
                except (CompileWorkerLost, TimeoutError) as exc:
                    # No worker, or its slot never came: not the graph's failure. Compiled
                    # here, now, under a fresh NEURON_LIBTORCH_COMPILATION_TIMEOUT.
                    logger.warning("compile cache: %s; compiling %s in this process", exc, key)
            return self._waited_for(later)

        pending = PendingCompile(key, reason, at, resolve)
        if reason == "worker":
            self._in_flight[key] = pending
        return pending

    def heal_unloadable(
        self, result: CacheResult, error: str, compile_fn: CompileFn, *,
        components: Mapping[str, str], piece: str | None = None,
    ) -> CacheResult:
        """`result`'s entry passed its checksums but would not load here (a library missing
        here, a package torch's loader refuses): record a `load_failed` event; withdraw it
        from the local tier (a quarantine note kept) unless another process replaced it
        meanwhile (then that one is served), and compile the graph again under the key's
        lock, not fetched again - serving it again would fail every start after this one. A
        fetched entry is not withdrawn from the remote on this node's word alone: it gets
        this host's note (`tiers/load_failure_notes.py`). Where the tier cannot withdraw it
        or take the lock, the graph is compiled and served from scratch; in
        pre-compiled-only mode `PrecompiledOnlyMiss` says why, and nothing is withdrawn."""
        key = result.key
        self._loaded.pop(key, None)
        self._record(LoadFailed(key=key, at=time.time(), source=result.source,
                                error=redact_text(error)))  # a file of the tier: no secret
        if self.precompiled_only:
            raise PrecompiledOnlyMiss(
                f"the compile cache entry {key} does not load here ({error}), and "
                "VLLM_NEURON_DISABLE_WARMUP_COMPILE=1 forbids compiling at runtime"
            )
        remote = self.remote if result.source == "remote" else None
        if remote is not None:  # a note for the fleet's operators, not a withdrawal
            note_load_failure(remote, key, error)
        ask = _Ask(key, compile_fn, components, piece, wait=True)
        try:
            with self.local.lock(key, lease_duration=self.lease_duration, timeout=self.timeout):
                try:
                    current: EntryRecord | None = self.local_tier.read_entry(key)
                except EntryProblem:
                    current = None
                if current == result.record:
                    if not quarantine_entry(self.local, key, f"does not load here: {error}",
                                            warn=False):  # fmt: skip
                        raise LocalTierFault(f"could not withdraw the entry {key}")
                    current = None
                replaced = None if current is None else self.local_tier.lookup(key)
                healed = replaced or self._compiled(
                    self._compile(ask, deadline=time.monotonic() + self.timeout))
        except (LocalTierFault, OSError) as exc:
            if isinstance(exc, OSError) and unwritable_cause(exc, tier_dir(self.local)) is None:
                raise
            healed = self._from_scratch(ask, str(exc))
        self._loaded[key] = healed
        return healed

    # ================================================================ the flow
    def _waited_for(self, ask: _Ask) -> CacheResult:
        """`_get` for a caller that waits wherever the flow waits: never a `Wait`."""
        outcome = self._get(ask)
        if isinstance(outcome, Wait):  # pragma: no cover - the flow waits when asked to
            raise AssertionError(f"the flow deferred {ask.key} ({outcome.reason}) while asked "
                                 "to wait")  # fmt: skip
        return outcome

    def _get(self, ask: _Ask) -> CacheResult | Wait:
        key = ask.key
        validate_hex(key, length=32, what="compile cache key")
        cached = self._loaded.get(key)
        if cached is not None:
            self._record(CacheHit(key=key, at=time.time(), tier="memory"))
            return msgspec.structs.replace(cached, source="memory", seconds=0.0)
        if self.disabled:
            if self.writes_bypassed and self.read_only.tiers:
                baked = self._baked_hit(key)
                if baked is not None:
                    return baked
                if self.precompiled_only:
                    raise self._precompiled_only_miss(key)
            out_dir, record, seconds = self._builder.uncached(key, ask.compile_fn,
                                                              ask.components, ask.piece)
            return CacheResult(key, out_dir, record, "uncached", seconds, "")
        self._upkeep.start_background()  # once (upkeep/background.py)
        hit = self.local_tier.lookup(key, quarantine=False)
        if hit is not None:
            if not self._first_use_of_prefetched(key):
                self._record(CacheHit(key=key, at=time.time(), seconds=hit.seconds,
                                      compile_seconds=hit.record.compile_seconds))
            self._loaded[key] = hit
            return hit
        baked = self._baked_hit(key) if self.read_only.tiers else None
        if baked is not None:
            return baked
        outcome = self._locked_miss(ask)
        if isinstance(outcome, Wait):
            return outcome
        self._loaded[key] = outcome
        if outcome.source in ("compiled", "remote"):  # published: the tier grew
            self.keep_within_bound()
        return outcome

    def _locked_miss(self, ask: _Ask) -> CacheResult | Wait:
        key = ask.key
        wait_start = time.time() if ask.started is None else ask.started
        deadline = time.monotonic() + self.timeout
        t0 = time.perf_counter()
        try:
            lock = self.local.lock(key, lease_duration=self.lease_duration)
            lock.acquire(timeout=self.timeout if ask.wait else 0)
        except LockTimeout:
            if not ask.wait:  # a rank of this node compiles it: trace on, wait at the 1st call
                return Wait("local-lock")
            raise TimeoutError(
                f"waited {self.timeout:g} s for another process to compile {key} "
                f"(NEURON_LIBTORCH_COMPILATION_TIMEOUT={self.timeout:g}); the lock is "
                f"{self.local_dir}/.locks/{key}"
            ) from None
        except OSError as exc:  # a tier that filled up or turned read-only since it opened
            if unwritable_cause(exc, tier_dir(self.local)) is None:
                raise
            return self._from_scratch(ask, f"cannot take the key's lock: {exc}")
        waited = time.perf_counter() - t0
        try:
            if waited > 0.05:
                self._record(LockWaited(key=key, at=time.time(), seconds=waited))
            hit = self.local_tier.lookup(key)
            if hit is not None:
                if not self._first_use_of_prefetched(key):
                    self._record(CacheHit(key=key, at=time.time(), seconds=waited,
                                          compile_seconds=hit.record.compile_seconds))
                return self.local_tier.result(key, hit.prefix, hit.record, "local-after-wait",
                                              waited)  # fmt: skip
            failure = recent_failure(self.local, key, since=wait_start,
                                     retry_after=self._fleet.retry_after,
                                     stopped_in=self.local)  # fmt: skip
            if failure is not None:
                raise CompileError(note_message(key, failure))
            fetched = self.fetch_remote(key)
            if fetched is not None:
                return fetched
            if self.precompiled_only:
                raise self._precompiled_only_miss(key)
            if not self.trust.may_publish_remote:  # cannot sign: waits, never leases
                claim = self._fleet.claim_without_lease(
                    key, started=wait_start, deadline=deadline, wait=ask.wait,
                    fetch=lambda: self.fetch_remote(key))
            elif self._remote.read_only:  # VLLM_NEURON_REMOTE_WRITE=off, or writes refused
                claim = Won(owes=False)
            else:
                claim = self._fleet.claim(key, started=wait_start, deadline=deadline,
                                          wait=ask.wait, fetch=lambda: self.fetch_remote(key))
            if isinstance(claim, Wait):
                return claim
            if isinstance(claim, FetchedFromFleet):
                return claim.result
            return self._compile_won(ask, claim, deadline)
        finally:
            lock.release()

    def _compile_won(self, ask: _Ask, won: Won, deadline: float) -> CacheResult | Wait:
        """Compile a key this process won: promote it while the fleet's lease holds, or note
        its failure there for every node's waiters; the lease is let go whatever happens."""
        try:
            try:
                outcome = self._compile(ask, deadline=deadline, owes=won.owes)
            except (CompileWorkerLost, CompileSlotTimeout):
                raise  # no worker, or no slot: not the graph's failure; the lease comes free
            except Exception as exc:
                self._fleet.note_failure(won, ask.key, exc)
                raise
            if isinstance(outcome, CacheResult) and won.remote is not None \
                    and self._fleet.still_holds(won, ask.key):  # fmt: skip
                self._promote(won.remote, ask.key)
            return outcome
        finally:
            self._fleet.let_go(won)

    def _compile(self, ask: _Ask, *, deadline: float, owes: bool = False) -> CacheResult | Wait:
        """Compile a key this process has won, in one of the node's compile slots: without
        `wait`, `Wait("no-slot")` when none is free, or - with a `worker` - the graph
        prepared for a background compile (`Wait("worker", prepared)`: `begin` hands it to
        a worker); with `owes`, the promotion to the remote is owed first (settled by it, or
        by a later start)."""
        if ask.worker is not None and not ask.wait:
            # Prepared here, under the key's lock (and lease): a rank that traces the graph
            # meanwhile defers to this one instead of preparing it too.
            prepared = ask.worker()
            if prepared is not None:
                return Wait("worker", prepared)
            # no worker for this graph: compiled here, now, if a slot is free
        if self._slots is None or ask.have_slot:  # no bound, or the caller holds a slot
            return self._publish(ask, owes)
        with self._slots.held(wait=ask.wait, deadline=deadline, what=ask.what) as held:
            if not held:
                return Wait("no-slot")
            return self._publish(ask, owes)

    def _publish(self, ask: _Ask, owes: bool) -> CacheResult:
        if owes:
            self._upkeep.owe(ask.key)
        scratch, record, seconds = self._builder.publish_where_room(
            ask.key, ask.compile_fn, ask.components, ask.piece)
        if scratch is not None:  # the tier had no room: served from the scratch area
            return CacheResult(ask.key, scratch, record, "uncached", seconds, "")
        published = self.local_tier.lookup(ask.key)
        if published is None:
            raise CompileError(
                f"compiled {ask.key} but its entry in {self.local_dir} is not readable")
        return self.local_tier.result(ask.key, published.prefix, published.record, "compiled",
                                      seconds)  # fmt: skip

    def _promote(self, remote: Store, key: str) -> None:
        """Promote what this process compiled for the fleet, and clear the key's failure
        note there; best-effort (the local entry serves this node anyway)."""
        try:
            if self.local.published(key) is not None:
                promote_entry(self.local, remote, key, policy=self.trust)
            # else: served from scratch (the tier had no room): nothing to promote; the
            # lease comes free and another node compiles it.
            self._upkeep.settled(key)
            clear_failure_note(remote, key)
        except Exception as exc:  # noqa: BLE001 - the remote is best-effort
            # Leased, so the remote takes writes: a refusal here (that key's folder made
            # unreadable), a record that does not read, a publication stuck are that key's
            # defects while the remote still answers a probe; only then its outage.
            self._remote.key_failed(key, exc)

    def _from_scratch(self, ask: _Ask, reason: str) -> CacheResult:
        """The tier cannot be used for this key at all (`reason`): compiled in scratch and
        served from there, said once."""
        out_dir, record, seconds = self._builder.serve_from_scratch(
            ask.key, ask.compile_fn, ask.components, ask.piece, reason)
        return CacheResult(ask.key, out_dir, record, "uncached", seconds, "")

    def _baked_hit(self, key: str) -> CacheResult | None:
        """A read-only tier's hit for `key` (counted, remembered), or None."""
        baked = self.read_only.lookup(key)
        if baked is not None:
            self._record(CacheHit(key=key, at=time.time(), tier="baked", seconds=baked.seconds,
                                  compile_seconds=baked.record.compile_seconds))
            self._loaded[key] = baked
        return baked

    def _compiled(self, outcome: CacheResult | Wait) -> CacheResult:
        if isinstance(outcome, Wait):  # pragma: no cover - a waiting compile never defers
            raise AssertionError(f"a waiting compile deferred ({outcome.reason})")
        return outcome

    def _precompiled_only_miss(self, key: str) -> PrecompiledOnlyMiss:
        self._record(CacheMiss(key=key, at=time.time()))
        where = f"the local cache {self.local_dir}"
        for url in self.read_only.urls:
            where += f", the read-only cache {url}"
        if self.remote_url:
            where += f" or the remote cache {self.remote_url}"
        untrusted = self._untrusted.get(key)
        if untrusted is not None:
            where += f" (an entry is there, but untrusted: {untrusted})"
        return PrecompiledOnlyMiss(
            f"compile cache miss for {key} in {where}, and "
            "VLLM_NEURON_DISABLE_WARMUP_COMPILE=1 forbids compiling at runtime"
        )

    # ================================================================ the remote tier
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
            self.local_tier.withdraw(remote, key, str(exc), tier="remote", version=exc.version)
            return None
        except EntryProblem as exc:
            self.local_tier.withdraw(remote, key, str(exc), tier="remote")
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
            self._remote.key_failed(key, exc)
            return None
        local = None if record is None else self.local_tier.lookup(key)
        if record is None or local is None:
            return None
        seconds = time.perf_counter() - start
        forget_stopped(self.local, key)
        self._record(Fetched(key=key, at=time.time(), seconds=seconds, size=record.total_size,
                             remote=str(self.remote_url),
                             compile_seconds=record.compile_seconds))
        return self.local_tier.result(key, local.prefix, local.record, "remote", seconds)

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

    # ================================================================ deferred graphs
    @property
    def compile_share(self) -> int:
        """How many compiles this process may run at once - its share of the node's slots
        (`workers/slots.py`), or the CPUs when nothing bounds them: the compile workers it
        needs."""
        return self._slots.share if self._slots is not None else (os.cpu_count() or 1)

    def _compile_in_worker(self, ask: _Ask,
                           prepared: tuple[CompileFn, Callable[[], None]]) -> CacheResult:
        """`begin`'s background compile of a graph prepared for a worker."""
        compile_fn, discard = prepared
        in_worker = replace(ask, compile_fn=compile_fn, worker=None)
        try:
            # A slot first, then the key: a key (and its fleet lease) is never held while
            # its compile queues for this node's slots, or the other nodes, idle, would
            # wait on this node's queue instead of taking the graphs it cannot compile yet.
            slot = contextlib.nullcontext(True) if self._slots is None else self._slots.held(
                wait=True, deadline=time.monotonic() + self.timeout, what=ask.what)
            with slot:
                outcome = self._get(replace(in_worker, wait=False, have_slot=True))
                if isinstance(outcome, CacheResult):
                    return outcome
                # another process took it meanwhile: waited for without a slot
            return self._waited_for(replace(in_worker, wait=True))
        finally:
            discard()

    def _prefetch_once(self, key: str) -> bool:
        """One look for `key` on the remote from the prefetcher's thread (a request, no
        lock), and once it is published, one fetch of it under the key's local lock, taken
        without waiting. True when there is nothing more to do: fetched, found here, or a
        fetch that failed (a full disk, a defective or untrusted entry, the remote gone),
        whose first call owns the outcome; False to look again later (not published yet, or
        the lock busy: a first call or another rank is on it)."""
        remote = self.remote
        if remote is None:
            return True  # no remote (set aside): the first call waits and says why
        if remote.publication(key).state == "absent":
            return False
        lock = self.local.lock(key, lease_duration=self.lease_duration)
        try:
            lock.acquire(timeout=0)
        except LockTimeout:
            return False
        try:
            if self.local_tier.lookup(key) is not None:
                return True
            fetched = self.fetch_remote(key) is not None
        finally:
            lock.release()
        if fetched:
            self._prefetched.add(key)  # its first call's local hit is this fetch, not a 2nd
            self.keep_within_bound()
        return True

    def prefetch(self, keys: Sequence[str]) -> None:
        """Fetch `keys` into the local tier in the background, each once it is published
        (a new node's known graphs, while vLLM loads the model: head_start.py), as deferred
        graphs are (prefetch.py)."""
        for key in keys:
            validate_hex(key, length=32, what="compile cache key")
            self._prefetcher.add(key)

    @property
    def writes_remote(self) -> bool:
        """Whether this process writes the remote tier: one is set and answers, writable
        (not VLLM_NEURON_REMOTE_WRITE=off, not refused), and the trust policy lets it
        publish (docs/trust.md)."""
        return (self.remote is not None and not self._remote.read_only
                and self.trust.may_publish_remote)  # fmt: skip

    def _first_use_of_prefetched(self, key: str) -> bool:
        """Whether `key` was fetched by the prefetcher and not used since: its first local
        hit records no `hit` event (the fetch counted once, as a remote hit)."""
        if key not in self._prefetched:
            return False
        self._prefetched.discard(key)
        return True

    # ================================================================ the tier's keeping
    def keep_within_bound(self) -> None:
        """Evict the least recently used entries above the bound, never one this process
        has loaded (its artifact is loaded from the entry) or prefetched for a call still to
        come; best-effort (upkeep/eviction.py)."""
        with self._bound_lock:
            # What this process loaded, and what its prefetcher fetched for a first call
            # still to come (evicted now, that call would only fetch it again).
            self._upkeep.keep_within_bound([*self._loaded, *self._prefetched.copy()])

    def wait_for_upkeep(self, timeout: float | None = None) -> bool:
        """Wait for the background pass this cache started when it opened (what killed
        processes left collected, owed promotions paid: upkeep/background.py); True when it
        ended."""
        return self._upkeep.wait_for_background(timeout)

    def _record(self, event: Record) -> None:
        self.local_tier.record(event)


T = TypeVar("T")


def _in_background(fn: Callable[..., T], *args: Any) -> Future[T]:
    """Run `fn(*args)` in a daemon thread; its outcome in the future. Daemon: a process that
    exits (a server stopped during its cold start) does not wait for its queued compiles,
    whose workers exit with it (they watch their parent) and whose staging `cache gc`
    collects."""
    future: Future[T] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="vllm-neuron-compile").start()
    return future
