"""What the compile cache hands back and raises: the result of a lookup and the errors a
caller can tell apart.

Kept apart from `cache.py` so that the fleet protocol (`fleet.py`), which the cache uses,
can raise the cache's own errors without importing the cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgspec

from vllm_neuron.envs.compile_cache import RemoteWrite  # the setting's own type

from .record import EntryRecord

__all__ = [
    "CacheResult", "CompileError", "CompileSlotTimeout", "CompileWorkerLost", "DeferCompile",
    "PendingCompile",
    "PrecompiledOnlyMiss", "RemoteWrite",
]

class CompileError(RuntimeError):
    """The compile of a key failed (in this process or in the one we waited for)."""


class CompileWorkerLost(RuntimeError):
    """A compile worker could not run (no room for its job, a failed start, a signal, an
    exit without a result): not the graph's fault, so no failure note is written and no
    waiter is told the graph failed; the graph is compiled in place instead."""


class CompileSlotTimeout(TimeoutError):
    """No compile slot of the node came free within NEURON_LIBTORCH_COMPILATION_TIMEOUT: the
    node was busy, not the graph at fault (no failure note is written for it)."""


class PrecompiledOnlyMiss(RuntimeError):
    """A miss in pre-compiled-only mode (VLLM_NEURON_DISABLE_WARMUP_COMPILE=1)."""


class CacheResult(msgspec.Struct, frozen=True, gc=False):
    """Where a key's artifacts are, and how they got there.

    A frozen msgspec struct rather than a dataclass: one is built on every hit, and a
    frozen dataclass's ``__init__`` alone costs as much as a `stat`.
    """

    key: str
    path: str | None  # the entry's directory on local disk (None for a non-disk local tier)
    record: EntryRecord
    source: str  # "memory", "local", "local-after-wait", "remote", "compiled", "uncached"
    seconds: float
    prefix: str = ""  # where the entry's files are in the local store


class DeferCompile(Exception):  # noqa: N818 - a signal inside the flow, not an error
    """Raised inside the decision flow where waiting would begin when the caller asked not to
    wait: the key's lock or lease is held by another process, or no compile slot is free.
    `TwoTierCache.begin` turns it into a `PendingCompile`; it never leaves the cache."""

    def __init__(self, reason: str, prepared: Any = None) -> None:
        super().__init__(reason)
        self.reason = reason  # "local-lock", "remote-lease", "no-slot" or "worker"
        # "worker": the graph prepared for a compile off the tracing thread (the compile to
        # run, and what discards the prepared job; `deferral.WorkerCompile`)
        self.prepared = prepared


class PendingCompile:
    """A key whose artifacts are not here yet: another process holds its compile, or this
    node's compile slots were all taken, when the graph was traced.

    `result()` does what a caller that chose to wait would have done - wait for the holder,
    load what it published (local tier) or fetch and verify it (remote), take the compile
    over from a dead holder, or raise the holder's `CompileError` - counting failures from
    the moment of the deferral, not of the first call. It runs once: later and concurrent
    callers get the same result; an error is raised to every caller that asks (a later call
    tries again, as a new compile would)."""

    def __init__(self, key: str, reason: str, deferred_at: float,
                 resolve: Callable[[], CacheResult]) -> None:  # fmt: skip
        self.key = key
        self.reason = reason
        self.deferred_at = deferred_at  # epoch seconds
        self._resolve = resolve
        self._result: CacheResult | None = None
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self._result is not None

    def result(self) -> CacheResult:
        done = self._result
        if done is not None:
            return done
        with self._lock:
            if self._result is None:
                self._result = self._resolve()
            return self._result
