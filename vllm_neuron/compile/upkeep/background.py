"""What keeps one node's local tier healthy beside serving: `TierUpkeep`.

Three jobs, none on the hot path and none allowed to stop the cache from serving:

- when a cache opens: bring the tier within its size bound;
- at its first use (`get_or_compile`; not when it is built, which may happen before vLLM
  forks its workers: a fork must not copy a thread's locks mid-use), a background pass
  that collects what killed processes left (`collect.py`'s plan of the tier with its default
  bounds: staging, temp files, dead leases and expired notes; never an entry; and their
  compile job directories in the temporary directory, `job_dirs.py`) and settles
  the promotions an earlier process owed the remote (`owed.py`). One process per tier
  runs it at a time (the tier's ``upkeep`` lock; a pass that finds it held waits, then
  settles only, or leaves the work to a holder still at it: `_take_upkeep_lock`): the
  ranks of a TP=32 engine opening one tier walk it once, not 32 times. It stops between
  items when the interpreter exits; what an exit cuts short is crash-safe (the next pass
  finishes it);
- after each publish: evict least recently used entries above the bound (`eviction.py`);
- around a compile for the fleet: note the promotion owed, forget it once promoted.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable, Collection

from vllm_neuron.backends import Lock, LockTimeout, Record, Store

from ..tiers.remote import RemoteTier
from ..trust.policy import TrustPolicy
from ..workers.job_dirs import sweep_dead_jobs
from .collect import plan_gc
from .eviction import Evictor
from .owed import owe_promotion, owed_keys, promotion_settled, settle_owed

logger = logging.getLogger("vllm_neuron.compile")

UPKEEP_LOCK = "upkeep"
"""The tier-wide lock of the background pass (one process per tier at a time)."""

SETTLE_LOCK_WAIT = 600.0
"""Seconds the settling after an outage waits for the tier's upkeep lock."""

_STOPPING = threading.Event()
atexit.register(_STOPPING.set)  # background passes stop between items at exit


class TierUpkeep:
    """The upkeep of `local` for one cache (see the module doc)."""

    def __init__(
        self,
        local: Store,
        remote: RemoteTier,
        *,
        max_size: int | None,
        lease_seconds: float,
        lock_lease: float,
        failure_max_age: float,
        record: Callable[[Record], None],
        quarantine: Callable[[str, str], None],
        may_publish: bool = True,
        policy: TrustPolicy | None = None,
    ) -> None:
        self.local = local
        self._policy = policy  # the cache's trust: what an owed promotion is signed with
        self._may_publish = may_publish  # False: a process that cannot sign (docs/trust.md)
        self.remote = remote
        self._lease_seconds = lease_seconds
        self._lock_lease = lock_lease
        self._failure_max_age = failure_max_age
        self._evictor = Evictor(local, max_size, record=record) if max_size else None
        self._quarantine = quarantine
        self._background: threading.Thread | None = None
        self._started = threading.Lock()
        self._settling: threading.Thread | None = None  # after an outage (`_remote_back`)
        remote.when_back(self._remote_back)

    # ------------------------------------------------------------------ start
    def at_start(self) -> None:
        """Fit the bound (the background pass waits for the cache's first use)."""
        self.keep_within_bound(())

    def start_background(self) -> None:
        """Start the background pass once (see the module doc); cheap when started."""
        if self._background is not None:
            return
        with self._started:
            if self._background is None:
                thread = threading.Thread(target=self._background_pass, daemon=True,
                                          name="vllm-neuron-tier-upkeep")  # fmt: skip
                thread.start()
                self._background = thread

    def _background_pass(self) -> None:
        lock = self.local.lock(UPKEEP_LOCK, lease_duration=self._lock_lease)
        try:
            whole = self._take_upkeep_lock(lock)
        except LockTimeout:
            return  # another process's pass is at it
        except Exception as exc:  # noqa: BLE001 - hygiene never stops the cache
            logger.debug("compile cache: upkeep of %s not started: %s", self.local.url, exc)
            return
        try:
            if whole:
                self._collect()
                sweep_dead_jobs()  # never raises; a warm restart prepares no job to sweep them
            self._settle()
        except Exception as exc:  # noqa: BLE001 - a background pass never kills the process
            logger.warning("compile cache: the upkeep of %s stopped: %s", self.local.url, exc)
        finally:
            lock.release()

    def _take_upkeep_lock(self, lock: Lock) -> bool:
        """Take the tier's upkeep lock; True: this pass does all of it, False: only the
        settling; `LockTimeout`: another process's pass is at it.

        Held at the first try: by a live pass, or - on a tier without kernel locks - by the
        lease of a process killed mid-pass, which stays held for up to one lease period.
        Skipping then would leave that process's work (its owed promotion above all) to the
        next start, which may be weeks away, so the pass waits (in the background) for up
        to two periods. A lease taken over from a dead holder (`took_over_from`): the whole
        pass is this one's. A lock released meanwhile: a live pass has just collected the
        tier, but what it could settle depended on its own view of the remote (down for it,
        or a process that may not publish), so this one settles what is still owed - one
        listing when nothing is. A live pass still at it after two periods keeps the work.
        """
        try:
            lock.acquire(timeout=0)
            return True
        except LockTimeout:
            lock.acquire(timeout=2 * self._lock_lease)
        return lock.took_over_from is not None

    def _settle(self) -> None:
        """Promote what this tier owes the remote (`owed.py`), if this process may write."""
        if self.remote.url and not self.remote.read_only and self._may_publish:
            settle_owed(self.local, self.remote, owed_keys(self.local),
                        lease_seconds=self._lease_seconds, lock_lease=self._lock_lease,
                        quarantine=self._quarantine, stopping=_STOPPING.is_set,
                        policy=self._policy)  # fmt: skip

    def _remote_back(self) -> None:
        """The remote answers again after an outage: settle what was owed meanwhile now, not
        at the next start (a server runs for weeks), in the background, under the tier's
        upkeep lock (waiting for a pass that holds it, here or in another process)."""
        with self._started:
            if self._background is None or (self._settling and self._settling.is_alive()):
                return  # not in use yet: the first use's pass settles everything
            self._settling = threading.Thread(target=self._settle_after_outage, daemon=True,
                                              name="vllm-neuron-settle-owed")  # fmt: skip
            self._settling.start()

    def _settle_after_outage(self) -> None:
        lock = self.local.lock(UPKEEP_LOCK, lease_duration=self._lock_lease)
        try:
            # Waits (in the background) for a pass holding it: that pass may be another
            # process's that still sees the remote down, and settles nothing.
            lock.acquire(timeout=SETTLE_LOCK_WAIT)
        except Exception as exc:  # noqa: BLE001 - the next outage's end or start settles
            logger.debug("compile cache: settling what %s owes after the outage not "
                         "started: %s", self.local.url, exc)  # fmt: skip
            return
        try:
            self._settle()
        except Exception as exc:  # noqa: BLE001 - a background pass never kills the process
            logger.warning("compile cache: settling what %s owes stopped: %s", self.local.url,
                           exc)  # fmt: skip
        finally:
            lock.release()

    def _collect(self) -> None:
        """What killed processes left, by gc's plan with its default bounds."""
        try:
            outcome = plan_gc(self.local, failure_max_age=self._failure_max_age).execute(
                stop=_STOPPING.is_set)
            for failed, error in outcome.failed:
                logger.debug("compile cache: could not collect %s: %s", failed.where, error)
        except Exception as exc:  # noqa: BLE001 - hygiene never stops the cache
            logger.debug("compile cache: could not collect what killed processes left in "
                         "%s: %s", self.local.url, exc)  # fmt: skip

    def wait_for_background(self, timeout: float | None = None) -> bool:
        """Start the background pass if it is not, wait for it; True when it has ended.

        A process about to exit calls it to share what it owes now rather than at its next
        start (tests, short-lived tools); serving never waits.
        """
        self.start_background()
        assert self._background is not None
        self._background.join(timeout)
        settling = self._settling
        if settling is not None:
            settling.join(timeout)
        return not self._background.is_alive() and not (settling and settling.is_alive())

    # ---------------------------------------------------------------- publish
    def keep_within_bound(self, protect: Collection[str]) -> None:
        """Evict the least recently used entries above the bound, never one in `protect`;
        best-effort (eviction.py)."""
        if self._evictor is not None:
            self._evictor.run(protect=protect)

    def owe(self, key: str) -> None:
        """A compile of `key` for the fleet starts: its promotion is owed until `settled`."""
        if self.remote.url and not self.remote.read_only:
            owe_promotion(self.local, key, self.remote.url)

    def settled(self, key: str) -> None:
        promotion_settled(self.local, key)
