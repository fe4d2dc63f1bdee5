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
    lease holds, or note the failure there for every node's waiters (`compiling.py`).

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
holds (`tiers/local.py`). What the decision hands off lives beside it, one job a module, so
that this one reads as the decision and nothing else: the question one pass is asked
(`ask.py`); the fetch from the remote and the trust policy's word on an entry (`fetch.py`);
how a won key is compiled, published and promoted (`compiling.py`); `begin`'s deferral and
its background compiles in workers (`deferral.py`); the prefetcher's look at a deferred key
(`prefetch.py` `PrefetchLook`); the healing of an entry that will not load (`healing.py`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from vllm_neuron.backends import (
    LockTimeout,
    Record,
    Store,
    normalize_location,
    open_store,
    validate_hex,
)
from vllm_neuron.envs import cold_start_without
from vllm_neuron.identity import tensor_parallel_size

from ..entry.events import CacheHit, CacheMiss, LockWaited
from ..entry.failure_notes import note_message, recent_failure
from ..entry.outcomes import (
    CacheResult,
    CompileError,
    FetchedFromFleet,
    PendingCompile,
    PrecompiledOnlyMiss,
    RemoteWrite,
    Wait,
    Won,
)
from ..tiers.baked import ReadOnlyTiers, open_read_only_tier
from ..tiers.build import CompileFn, EntryBuilder
from ..tiers.health import tier_dir, unwritable_cause
from ..tiers.local import LocalTier
from ..tiers.remote import RemoteTier
from ..trust.policy import TrustPolicy, trust_policy
from ..upkeep.background import TierUpkeep
from ..workers.slots import CompileSlots
from . import healing
from .ask import Ask, WorkerCompile
from .compiling import KeyCompiler
from .deferral import Deferral
from .fetch import Admission, RemoteFetch
from .fleet import RemoteSingleFlight
from .prefetch import Prefetcher, PrefetchLook

__all__ = [
    "CacheResult", "CompileError", "CompileFn", "PrecompiledOnlyMiss", "TwoTierCache",
    "WorkerCompile",
]


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
        self._admission = Admission(self.trust, local_dir=self.local_dir, remote_url=remote or None,
                                    record=self._record)  # fmt: skip
        self._loaded: dict[str, CacheResult] = {}  # the memory tier: what this process loaded
        self.local_tier = LocalTier(
            self.local, trust=self.trust, lease_duration=lease_duration, timeout=timeout,
            admit=self._admission.admitted, forget=lambda key: self._loaded.pop(key, None))
        record = self.local_tier.record
        # Consulted after the local tier, before the remote; never written (tiers/baked.py).
        self.read_only = ReadOnlyTiers(
            [open_read_only_tier(t) if isinstance(t, str) else t for t in read_only],
            trust=self.trust, admit=self._admission.admitted, record=record)
        # `disabled` because nothing can be written (the assembly's bypass), not because the
        # user said so: the read-only tiers still serve every hit they hold (a hit writes
        # nothing); what misses is compiled uncached, or refused in pre-compiled-only mode.
        self.writes_bypassed = writes_bypassed
        self.remote_url = remote or None
        self.remote_write: RemoteWrite = remote_write
        self._remote = RemoteTier(self.remote_url, remote_options or {}, record,
                                  write=remote_write)  # fmt: skip
        self._fetch = RemoteFetch(self.local, self.local_tier, self._remote,
                                  admission=self._admission, record=self._record)
        self._fleet = RemoteSingleFlight(
            self._remote, lease_seconds=remote_lease_seconds, retry_after=compile_retry_after,
            timeout=timeout, record=record, trust=self.trust, stopped_in=self.local)  # fmt: skip
        self._slots = None if compile_workers is None else CompileSlots(
            self.local, compile_workers, lease_duration=lease_duration, peers=tensor_parallel_size)
        self._prefetch_look = PrefetchLook(
            self.local, self.local_tier, lease_duration=lease_duration,
            remote=lambda: self.remote, fetch=lambda key: self.fetch_remote(key),
            grew=lambda: self.keep_within_bound())
        self._prefetcher = Prefetcher(self._prefetch_look.once, patience=timeout)
        self._deferral = Deferral(get=self._get, waited_for=self._waited_for,
                                  record=self._record, prefetcher=self._prefetcher,
                                  slots=self._slots, timeout=timeout)  # fmt: skip
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
        self._compiler = KeyCompiler(
            self.local, self.local_tier, self._builder, slots=self._slots, upkeep=self._upkeep,
            fleet=self._fleet, remote_tier=self._remote, trust=self.trust)
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
        return self._waited_for(Ask(key, compile_fn, components or {}, piece, wait=True,
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
        # The A/B benchmark's side without rank sharing (benchmarks/bench_cold_start_ab.py):
        # as VLLM_NEURON_DEFER_COMPILES=0 here, but the start's head start unchanged.
        if not self.defer_compiles or cold_start_without("rank-sharing"):
            return self.get_or_compile(key, compile_fn, components=components, piece=piece)
        return self._deferral.begin(key, compile_fn, components, piece, worker)

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
        ask = Ask(key, compile_fn, components, piece, wait=True)
        healed = healing.heal_unloadable(
            result, error, local=self.local, local_tier=self.local_tier,
            lease_duration=self.lease_duration, timeout=self.timeout,
            precompiled_only=self.precompiled_only, remote=lambda: self.remote,
            record=self._record,
            compile_again=lambda: self._compiler.compile(
                ask, deadline=time.monotonic() + self.timeout),
            from_scratch=lambda why: self._compiler.from_scratch(ask, why))
        self._loaded[key] = healed
        return healed

    # ================================================================ the flow
    def _waited_for(self, ask: Ask) -> CacheResult:
        """`_get` for a caller that waits wherever the flow waits: never a `Wait`."""
        outcome = self._get(ask)
        if isinstance(outcome, Wait):  # pragma: no cover - the flow waits when asked to
            raise AssertionError(f"the flow deferred {ask.key} ({outcome.reason}) while asked "
                                 "to wait")  # fmt: skip
        return outcome

    def _get(self, ask: Ask) -> CacheResult | Wait:
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
            if not self._prefetch_look.first_use(key):
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

    def _locked_miss(self, ask: Ask) -> CacheResult | Wait:
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
            return self._compiler.from_scratch(ask, f"cannot take the key's lock: {exc}")
        waited = time.perf_counter() - t0
        try:
            if waited > 0.05:
                self._record(LockWaited(key=key, at=time.time(), seconds=waited))
            hit = self.local_tier.lookup(key)
            if hit is not None:
                if not self._prefetch_look.first_use(key):
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
            return self._compiler.won(ask, claim, deadline)
        finally:
            lock.release()

    def _baked_hit(self, key: str) -> CacheResult | None:
        """A read-only tier's hit for `key` (counted, remembered), or None."""
        baked = self.read_only.lookup(key)
        if baked is not None:
            self._record(CacheHit(key=key, at=time.time(), tier="baked", seconds=baked.seconds,
                                  compile_seconds=baked.record.compile_seconds))
            self._loaded[key] = baked
        return baked

    def _precompiled_only_miss(self, key: str) -> PrecompiledOnlyMiss:
        self._record(CacheMiss(key=key, at=time.time()))
        where = f"the local cache {self.local_dir}"
        for url in self.read_only.urls:
            where += f", the read-only cache {url}"
        if self.remote_url:
            where += f" or the remote cache {self.remote_url}"
        untrusted = self._admission.untrusted.get(key)
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
        """Copy `key` from the remote tier into the local tier, verifying every checksum
        (`fetch.py`)."""
        remote = self.remote
        if remote is None:
            return None
        return self._fetch.fetch(remote, key)

    # ================================================================ deferred graphs
    @property
    def compile_share(self) -> int:
        """How many compiles this process may run at once - its share of the node's slots
        (`workers/slots.py`), or the CPUs when nothing bounds them: the compile workers it
        needs."""
        return self._slots.share if self._slots is not None else (os.cpu_count() or 1)

    def prefetch(self, keys: Sequence[str]) -> None:
        """Fetch `keys` into the local tier in the background, each once it is published
        (a new node's known graphs, while vLLM loads the model: head_start.py), as deferred
        graphs are (prefetch.py)."""
        for key in keys:
            validate_hex(key, length=32, what="compile cache key")
            self._prefetcher.add(key)

    def prefetch_done(self) -> None:
        """The process's start-up is over (every graph it traced was called): keys still
        pending in the prefetcher are dropped, and what it fetched that was never used is no
        longer kept from eviction (a record may name graphs this process does not use)."""
        for key in self._prefetcher.pending:
            self._prefetcher.forget(key)
        self._prefetch_look.prefetched.clear()

    @property
    def writes_remote(self) -> bool:
        """Whether this process writes the remote tier: one is set and answers, writable
        (not VLLM_NEURON_REMOTE_WRITE=off, not refused), and the trust policy lets it
        publish (docs/trust.md)."""
        return (self.remote is not None and not self._remote.read_only
                and self.trust.may_publish_remote)  # fmt: skip

    # ================================================================ the tier's keeping
    def keep_within_bound(self) -> None:
        """Evict the least recently used entries above the bound, never one this process
        has loaded (its artifact is loaded from the entry) or prefetched for a call still to
        come; best-effort (upkeep/eviction.py)."""
        with self._bound_lock:
            # What this process loaded, and what its prefetcher fetched for a first call
            # still to come (evicted now, that call would only fetch it again).
            self._upkeep.keep_within_bound([*self._loaded, *self._prefetch_look.prefetched.copy()])

    def wait_for_upkeep(self, timeout: float | None = None) -> bool:
        """Wait for the background pass this cache started when it opened (what killed
        processes left collected, owed promotions paid: upkeep/background.py); True when it
        ended."""
        return self._upkeep.wait_for_background(timeout)

    def _record(self, event: Record) -> None:
        self.local_tier.record(event)

