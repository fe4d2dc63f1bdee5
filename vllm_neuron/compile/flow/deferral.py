"""`TwoTierCache.begin`'s side of the flow: a caller that traces several graphs before it
calls any (vLLM's pieces) gets a `PendingCompile` where the flow would start to wait.

Apart from the decision (`cache.py`) because none of it decides anything about a key: the
flow's first pass runs without waiting and hands back a `Wait(reason)`; here that value
becomes a `PendingCompile` (a `deferred` event says why) whose `result()` runs the flow
again, waiting, at the graph's first call. A graph deferred to another node's lease is
prefetched meanwhile (`prefetch.py`). A graph this process won and prepared for a worker
(reason ``worker``) is compiled by a thread of the cache in the background, one job per key,
holding a compile slot first and the key second: a key (and its fleet lease) is never held
while its compile queues for this node's slots, or the other nodes, idle, would wait on this
node's queue instead of taking the graphs it cannot compile yet. A worker that cannot run
costs an in-place compile at the first call.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, TypeVar

from vllm_neuron.backends import Record

from ..entry.events import Deferred
from ..entry.outcomes import CacheResult, CompileWorkerLost, PendingCompile, Wait
from ..tiers.build import CompileFn
from ..workers.slots import CompileSlots
from .ask import Ask, WorkerCompile
from .prefetch import Prefetcher

__all__ = ["Deferral", "in_background"]

logger = logging.getLogger("vllm_neuron.compile")


class Deferral:
    """One cache's deferred graphs: `get` is one pass of its flow, `waited_for` a pass that
    waits; `slots` the node's compile slots (None: unbounded), `timeout` how long a worker's
    compile waits for one."""

    def __init__(self, *, get: Callable[[Ask], CacheResult | Wait],
                 waited_for: Callable[[Ask], CacheResult], record: Callable[[Record], None],
                 prefetcher: Prefetcher, slots: CompileSlots | None,
                 timeout: float) -> None:  # fmt: skip
        self._get = get
        self._waited_for = waited_for
        self._record = record
        self._prefetcher = prefetcher
        self._slots = slots
        self.timeout = timeout
        self._in_flight: dict[str, PendingCompile] = {}  # begin's worker compiles, by key

    def begin(self, key: str, compile_fn: CompileFn, components: Mapping[str, str],
              piece: str | None, worker: WorkerCompile | None,
              ) -> CacheResult | PendingCompile:  # fmt: skip
        """`TwoTierCache.begin` with deferral on: a hit, or a `PendingCompile`."""
        queued = self._in_flight.get(key)
        if queued is not None and not queued.done:
            return queued  # one job per key: a model's repeated layers are one graph
        at = time.time()
        ask = Ask(key, compile_fn, components, piece, wait=False, started=at, worker=worker)
        outcome = self._get(ask)
        if isinstance(outcome, CacheResult):
            return outcome
        reason = outcome.reason
        if reason == "worker":
            future = in_background(self._compile_in_worker, ask, outcome.prepared)
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

    def _compile_in_worker(self, ask: Ask,
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


T = TypeVar("T")


def in_background(fn: Callable[..., T], *args: Any) -> Future[T]:
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
