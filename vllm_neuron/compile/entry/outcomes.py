"""What the compile cache hands back and raises: the result of a lookup and the errors a
caller can tell apart.

Kept apart from the decision flow (`flow/cache.py`) so that every wing can raise the cache's
own errors and the fleet protocol (`flow/fleet.py`) can answer in the flow's values.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgspec

from vllm_neuron.backends import Lock, Store
from vllm_neuron.envs.compile_cache import RemoteWrite  # the setting's own type

from .record import EntryRecord

__all__ = [
    "CacheResult", "CompileError", "CompileSlotTimeout", "CompileWorkerLost", "FetchedFromFleet",
    "PendingCompile", "PrecompiledOnlyMiss", "RemoteWrite", "Wait", "Won",
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


class Wait(msgspec.Struct, frozen=True):
    """Where the decision flow would start to wait, for a caller that asked not to: another
    process holds the key's lock (``local-lock``) or the fleet's lease (``remote-lease``), no
    compile slot of the node is free (``no-slot``), or the graph is prepared for a compile
    worker (``worker``, with `prepared`: the compile to run and what discards the prepared
    job). `TwoTierCache.begin` turns it into a `PendingCompile`; it never leaves the cache."""

    reason: str
    prepared: Any = None


class FetchedFromFleet(msgspec.Struct, frozen=True):
    """The fleet's answer for a key another node published: fetched into the local tier."""

    result: CacheResult


class Won(msgspec.Struct, frozen=True):
    """The fleet's answer for a key this process compiles: with the key's `lease` on
    `remote` (promote what it compiles while the lease holds, note a failure, let go), or
    without one (the remote down, read-only or unset; or a process that cannot sign).
    `owes`: whether the promotion is owed to the remote first (settled by it, or by a later
    start), which a process that may never publish does not."""

    owes: bool
    lease: Lock | None = None
    remote: Store | None = None


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
