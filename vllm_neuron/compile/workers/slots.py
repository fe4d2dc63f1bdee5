"""The node's compile slots: at most VLLM_NEURON_COMPILE_WORKERS compiles at once per node.

Every process of a node (the ranks of its engines, a `cache warm`) shares the local tier,
so the slots are locks in it - ``.locks/compile-slot-<i>`` - not a server: a kernel lock is
dropped the moment its holder dies, so a killed compiler never keeps a slot. A compile
takes a slot after it has won its key (the key's lock, and the fleet's lease when there is
a remote) and gives it back when the entry is published.

A process that finds every slot taken either defers the graph (`held` says no slot, when
it traces and may come back at the graph's first call) or waits for one, bounded by
NEURON_LIBTORCH_COMPILATION_TIMEOUT. A tier that cannot hold the lock files (full,
read-only) has no slots: the compile runs, as it would without a cache - the bound is
there to keep a node from running out of memory, never to stop it serving.

The ranks of a tensor-parallel engine trace the same graphs at the same time, and the
first to trace would otherwise take every free slot and compile every graph while the
others wait: each process holds at most its share of the slots - ``ceil(count / peers)``,
`peers` being the ranks that trace alongside it (`identity.tensor_parallel_size`) - so the
engine's graphs are shared out among its ranks, and the node stays as busy.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

from vllm_neuron.backends import Lock, LockTimeout, Store

from ..entry.outcomes import CompileSlotTimeout

__all__ = ["SLOT_PREFIX", "CompileSlots"]

logger = logging.getLogger("vllm_neuron.compile")

SLOT_PREFIX = "compile-slot-"
MAX_POLL = 0.2
_NONE_FREE = object()  # `_take` without waiting: every slot of this process's share is taken
"""The longest pause between two looks for a free slot: what a finished compile may add to
the next one's start, against a few lock attempts per second."""


_HELD: dict[str, int] = {}
"""Slots this process holds, per tier (its URL): every cache of the process on one node's
tier, and every compile thread of each, draws on the process's one share."""
_HELD_LOCK = threading.Lock()


class CompileSlots:
    """`count` slots in `store`'s locks; `held()` is a context that holds one of them."""

    def __init__(self, store: Store, count: int, *, lease_duration: float = 30.0,
                 peers: Callable[[], int] = lambda: 1) -> None:  # fmt: skip
        if count < 1:
            raise ValueError(f"a node needs at least one compile slot, not {count}")
        self.store = store
        self.count = count
        self.lease_duration = lease_duration
        self.peers = peers  # asked at each take: vLLM's groups appear after start-up
        self._broken = False  # the tier could not hold a slot's lock file: no bound

    @property
    def share(self) -> int:
        """The most slots this process may hold at once: its part of the node's."""
        return max(1, -(-self.count // max(1, self.peers())))

    def _try_take(self) -> Lock | None:
        share = self.share  # asked outside the lock: a release never waits for it
        with _HELD_LOCK:  # reserve one of this process's share first ...
            if _HELD.get(self.store.url, 0) >= share:
                return None  # the rest of the node's slots are its peers' turn
            _HELD[self.store.url] = _HELD.get(self.store.url, 0) + 1
        taken: Lock | None = None
        try:  # ... then look for a free slot of the node, without holding the lock
            for index in range(self.count):
                lock = self.store.lock(f"{SLOT_PREFIX}{index}",
                                       lease_duration=self.lease_duration)  # fmt: skip
                try:
                    lock.acquire(timeout=0)
                except LockTimeout:
                    continue
                taken = lock
                break
        finally:
            if taken is None:  # none free (or the tier failed): the reservation goes back
                self._unreserve()
        return taken

    def _unreserve(self) -> None:
        with _HELD_LOCK:
            _HELD[self.store.url] -= 1

    def _give_back(self, slot: Lock) -> None:
        self._unreserve()
        with contextlib.suppress(Exception):  # an unreleased kernel lock dies with us
            slot.release()

    @contextlib.contextmanager
    def held(self, *, wait: bool, deadline: float, what: str) -> Iterator[bool]:
        """Hold a slot for the block, which is told whether it may compile: with `wait`,
        poll until `deadline` (monotonic), then `CompileSlotTimeout` naming the setting;
        without it, False at once when none is free (the caller defers the graph). True
        also when the slots cannot be kept (compiles unbounded). `what` names the compile in
        messages."""
        slot = self._take(wait=wait, deadline=deadline, what=what)
        if slot is _NONE_FREE:
            yield False
            return
        try:
            yield True
        finally:
            if isinstance(slot, Lock):
                self._give_back(slot)

    def _take(self, *, wait: bool, deadline: float, what: str) -> Lock | object | None:
        """A slot, None when no bound applies, `_NONE_FREE` without `wait` when none is
        free."""
        if self._broken:
            return None
        delay = 0.01
        while True:
            try:
                slot = self._try_take()
            except OSError as exc:  # full or read-only: compile unbounded, never fail
                self._broken = True
                logger.warning("compile cache: no compile slots in %s (%s): compiles on this "
                               "node are not bounded by VLLM_NEURON_COMPILE_WORKERS",
                               self.store.url, exc)  # fmt: skip
                return None
            if slot is not None:
                return slot
            if not wait:
                return _NONE_FREE
            now = time.monotonic()
            if now >= deadline:
                raise CompileSlotTimeout(
                    f"waited for a free compile slot to compile {what}: the node's "
                    f"{self.count} (VLLM_NEURON_COMPILE_WORKERS={self.count}) - or this "
                    f"process's share of them, {self.share} beside its tensor-parallel "
                    "peers - stayed taken until NEURON_LIBTORCH_COMPILATION_TIMEOUT ran out")
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 1.5, MAX_POLL)
