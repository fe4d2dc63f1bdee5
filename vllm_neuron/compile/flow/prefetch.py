"""Deferred graphs fetched as soon as their holders publish them, not at their first calls.

A process that traced past graphs other nodes hold (`deferred`, reason ``remote-lease``)
would otherwise fetch each one at its first call, one after another: on a fleet whose ranks
share out G graphs, each process fetches G - G/N of them in a row once the compiles are done.
The prefetcher looks for them in the background meanwhile and copies each into the local
tier once it is published, so a first call finds a local hit, or the local lock held by the
fetch already under way (it waits for it, then hits).

What it does and does not do:

* one thread per cache, alive while a key is pending; it looks at one key per pause
  (`MAX_POLL_INTERVAL` at most, as a first call's wait does), so a process adds about one
  small request per second to the remote however many graphs it deferred, and fetches the
  published ones back to back; keys go in the order opposite to the first calls', so the
  two meet in the middle instead of queueing on the same key;
* it only fetches: a graph whose holder died (taken over), failed (failure note) or never
  publishes is left to its first call, which owns those outcomes; a look is one request
  (is it published?), and the key's local lock is taken - without waiting - only to fetch
  what is published (busy: a first call or another rank is on it; looked at again later);
* a published key gets one fetch: whatever comes of it (fetched; or a full or read-only
  disk, a defective or untrusted entry, a remote that fails - each said once, where the
  fetch says it), the key is done and its first call takes it from there;
* a key is also dropped at its first call, after NEURON_LIBTORCH_COMPILATION_TIMEOUT, or
  when a look raises (the first call says why);
* the fetch is the graph's one use of the remote: its first call's local hit records no
  second ``hit`` event (`cache stats` counts one remote hit).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from vllm_neuron.backends import LockTimeout, Store

from ..entry.outcomes import CacheResult
from ..tiers.local import LocalTier
from .fleet import MAX_POLL_INTERVAL

__all__ = ["PrefetchLook", "Prefetcher"]

logger = logging.getLogger("vllm_neuron.compile")

FIRST_PAUSE = 0.05


class Prefetcher:
    """Keys to fetch in the background, and the thread that fetches them.

    `fetch(key)` makes one attempt: True when the local tier has the entry (nothing left to
    do), False to look again later; an exception drops the key.
    """

    def __init__(self, fetch: Callable[[str], bool], *, patience: float) -> None:
        self._fetch = fetch
        self.patience = patience
        self._pending: dict[str, float] = {}  # key -> monotonic deadline, in deferral order
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._running = False

    def add(self, key: str) -> None:
        """Fetch `key` once it is published (it was deferred to a holder elsewhere)."""
        with self._lock:
            self._pending[key] = time.monotonic() + self.patience
            self._wake.set()
            if self._running:
                return
            self._running = True
        try:
            threading.Thread(target=self._run, daemon=True, name="vllm-neuron-prefetch").start()
        except RuntimeError as exc:  # no thread to be had: the first calls fetch, as without
            with self._lock:
                self._running = False
                self._pending.clear()
            logger.warning("compile cache: no background fetches (%s); deferred graphs are "
                           "fetched at their first calls", exc)  # fmt: skip

    def forget(self, key: str) -> None:
        """Leave `key` to its first call, which has begun."""
        with self._lock:
            self._pending.pop(key, None)

    @property
    def pending(self) -> list[str]:
        with self._lock:
            return list(self._pending)

    def _next(self, after: str | None) -> str | None:
        """The key to look at after `after`, latest deferral first, round and round; None
        when none is pending (the thread then ends: the caller holds the lock)."""
        keys = list(reversed(self._pending))
        if not keys:
            self._running = False
            return None
        if after in keys:
            return keys[(keys.index(after) + 1) % len(keys)]
        return keys[0]

    def _run(self) -> None:
        pause = FIRST_PAUSE
        key: str | None = None
        while True:
            with self._lock:
                key = self._next(key)
                if key is None:
                    return
                deadline = self._pending[key]
                self._wake.clear()
            if time.monotonic() > deadline:
                self.forget(key)
                continue
            try:
                done = self._fetch(key)
            except Exception as exc:  # noqa: BLE001 - the first call owns this key's outcome
                logger.debug("compile cache: no background fetch of %s: %s", key, exc)
                done = True
            if done:
                self.forget(key)
                pause = FIRST_PAUSE  # its peers are likely published too: look at once
                continue
            self._wake.wait(pause)  # a new deferral cuts the pause short
            pause = min(pause * 1.5, MAX_POLL_INTERVAL)


class PrefetchLook:
    """One cache's look at a deferred key from the prefetcher's thread, and the keys it
    fetched that no call has used yet (their first local hit is this fetch, not a second).

    `remote()` is the remote store (None: set aside), `fetch(key)` the cache's fetch from it,
    `grew()` keeps the tier within its bound after a fetch."""

    def __init__(self, local: Store, local_tier: LocalTier, *, lease_duration: float,
                 remote: Callable[[], Store | None],
                 fetch: Callable[[str], CacheResult | None],
                 grew: Callable[[], None]) -> None:  # fmt: skip
        self.local = local
        self.local_tier = local_tier
        self.lease_duration = lease_duration
        self._remote = remote
        self._fetch = fetch
        self._grew = grew
        self.prefetched: set[str] = set()  # fetched by it, not yet looked up

    def once(self, key: str) -> bool:
        """One look for `key` on the remote from the prefetcher's thread (a request, no
        lock), and once it is published, one fetch of it under the key's local lock, taken
        without waiting. True when there is nothing more to do: fetched, found here, or a
        fetch that failed (a full disk, a defective or untrusted entry, the remote gone),
        whose first call owns the outcome; False to look again later (not published yet, or
        the lock busy: a first call or another rank is on it)."""
        remote = self._remote()
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
            fetched = self._fetch(key) is not None
        finally:
            lock.release()
        if fetched:
            self.prefetched.add(key)  # its first call's local hit is this fetch, not a 2nd
            self._grew()
        return True

    def first_use(self, key: str) -> bool:
        """Whether `key` was fetched by the prefetcher and not used since: its first local
        hit records no `hit` event (the fetch counted once, as a remote hit)."""
        if key not in self.prefetched:
            return False
        self.prefetched.discard(key)
        return True
