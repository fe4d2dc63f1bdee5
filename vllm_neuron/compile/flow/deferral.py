"""Deferred compiles: `begin`, the decision flow for a caller that traces several graphs
before it calls any (docs/compile-cache.md, "Deferred compiles").

Where the flow would start to wait - another process holds the key's lock or the fleet's
lease, no compile slot of the node is free - `begin` returns a `PendingCompile` whose
`result()` does that wait later, at the graph's first call. A graph this process wins can go
to a compile worker (`compile_workers.py`): prepared here, compiled by a thread of the cache
in a worker process, within one of the node's slots.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

from vllm_neuron.backends import LockTimeout, Record, Store

from ..entry.events import Deferred
from ..entry.outcomes import CacheResult, CompileWorkerLost, DeferCompile, PendingCompile
from ..tiers.build import CompileFn
from ..workers.slots import CompileSlots
from .prefetch import Prefetcher

__all__ = ["DeferringFlow", "WorkerCompile"]

logger = logging.getLogger("vllm_neuron.compile")

WorkerCompile = Callable[[], "tuple[CompileFn, Callable[[], None]] | None"]
"""Prepares a graph for a compile worker (`DeferringFlow.begin`): the compile to run, and
what discards the prepared job; None when the graph cannot go to a worker."""


class DeferringFlow:
    """`begin` and its background compiles, over the flow `_get` (`TwoTierCache`'s)."""

    timeout: float
    defer_compiles: bool
    local: Store
    lease_duration: float
    _slots: CompileSlots | None
    _in_flight: dict[str, PendingCompile]
    _prefetcher: Prefetcher
    _prefetched: set[str]

    def _record(self, event: Record) -> None:
        raise NotImplementedError

    def lookup_local(self, key: str, *, quarantine: bool = True) -> CacheResult | None:
        raise NotImplementedError

    def fetch_remote(self, key: str) -> CacheResult | None:
        raise NotImplementedError

    def keep_within_bound(self) -> None:
        raise NotImplementedError

    @property
    def remote(self) -> Store | None:
        raise NotImplementedError

    def _get(self, key: str, compile_fn: CompileFn, components: Mapping[str, str],
             piece: str | None, *, wait: bool, started: float | None,
             worker: WorkerCompile | None = None,
             have_slot: bool = False) -> CacheResult:  # fmt: skip
        raise NotImplementedError

    @property
    def compile_share(self) -> int:
        """How many compiles this process may run at once - its share of the node's slots
        (`slots.py`), or the CPUs when nothing bounds them: the compile workers it needs."""
        return self._slots.share if self._slots is not None else (os.cpu_count() or 1)

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
        ``worker``). A worker
        that cannot run (`CompileWorkerLost`) costs an in-place compile at the first call.
        With VLLM_NEURON_DEFER_COMPILES=0 (`defer_compiles`) this is `get_or_compile`."""
        components = components or {}
        if not self.defer_compiles:
            return self._get(key, compile_fn, components, piece, wait=True, started=None)
        queued = self._in_flight.get(key)
        if queued is not None and not queued.done:
            return queued  # one job per key: a model's repeated layers are one graph
        at = time.time()
        try:
            return self._get(key, compile_fn, components, piece, wait=False, started=at,
                             worker=worker)
        except DeferCompile as deferral:
            reason, prepared = deferral.reason, deferral.prepared
        in_place = compile_fn
        if reason == "worker":
            future = _in_background(self._compile_in_worker, key, prepared, components, piece,
                                    at)  # fmt: skip
        self._record(Deferred(key=key, at=at, reason=reason, piece=piece or ""))
        if reason == "remote-lease":  # fetched once its holder publishes it (prefetch.py)
            self._prefetcher.add(key)

        def resolve() -> CacheResult:
            self._prefetcher.forget(key)
            if reason == "worker":
                try:
                    return future.result()
                except (CompileWorkerLost, TimeoutError) as exc:
                    # No worker, or its slot never came: not the graph's failure. Compiled
                    # here, now, under a fresh NEURON_LIBTORCH_COMPILATION_TIMEOUT.
                    logger.warning("compile cache: %s; compiling %s in this process", exc, key)
            return self._get(key, in_place, components, piece, wait=True, started=at)

        pending = PendingCompile(key, reason, at, resolve)
        if reason == "worker":
            self._in_flight[key] = pending
        return pending

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
            if self.lookup_local(key) is not None:
                return True
            fetched = self.fetch_remote(key) is not None
        finally:
            lock.release()
        if fetched:
            self._prefetched.add(key)  # its first call's local hit is this fetch, not a 2nd
            self.keep_within_bound()
        return True

    def _first_use_of_prefetched(self, key: str) -> bool:
        """Whether `key` was fetched by the prefetcher and not used since: its first local
        hit records no `hit` event (the fetch counted once, as a remote hit)."""
        if key not in self._prefetched:
            return False
        self._prefetched.discard(key)
        return True

    def _compile_in_worker(self, key: str, prepared: tuple[CompileFn, Callable[[], None]],
                           components: Mapping[str, str], piece: str | None,
                           started: float) -> CacheResult:  # fmt: skip
        compile_fn, discard = prepared
        try:
            # A slot first, then the key: a key (and its fleet lease) is never held while
            # its compile queues for this node's slots, or the other nodes, idle, would
            # wait on this node's queue instead of taking the graphs it cannot compile yet.
            slot = contextlib.nullcontext() if self._slots is None else self._slots.held(
                wait=True, deadline=time.monotonic() + self.timeout,
                what=f"{key} ({piece})" if piece else key)
            with slot:
                try:
                    return self._get(key, compile_fn, components, piece, wait=False,
                                     started=started, have_slot=True)
                except DeferCompile:
                    pass  # another process took it meanwhile: waited for without a slot
            return self._get(key, compile_fn, components, piece, wait=True, started=started)
        finally:
            discard()


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
