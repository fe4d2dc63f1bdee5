"""What keeps one node's local tier healthy beside serving: `TierUpkeep`.

Three jobs, none on the hot path and none allowed to stop the cache from serving:

- when a cache opens: bring the tier within its size bound; then, in a background
  thread, collect what killed processes left (`gc.py`'s plan of the tier with its default
  bounds: staging, temp files, expired leases and notes older than `STAGING_MAX_AGE` or
  their own clocks; never an entry) and settle the promotions an earlier process owed the
  remote (`owed.py`);
- after each publish: evict least recently used entries above the bound (`eviction.py`);
- around a compile for the fleet: note the promotion owed, forget it once promoted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection

from vllm_neuron.backends import Record, Store

from .eviction import Evictor
from .gc import plan_gc
from .owed import owe_promotion, owed_keys, promotion_settled, settle_owed
from .remote_tier import RemoteTier

logger = logging.getLogger("vllm_neuron.compile")

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
    ) -> None:
        self.local = local
        self.remote = remote
        self._lease_seconds = lease_seconds
        self._lock_lease = lock_lease
        self._failure_max_age = failure_max_age
        self._evictor = Evictor(local, max_size, record=record) if max_size else None
        self._background: threading.Thread | None = None

    # ------------------------------------------------------------------ start
    def at_start(self) -> None:
        """Fit the bound; start the background pass (collection, owed promotions)."""
        self.keep_within_bound(())
        self._background = threading.Thread(
            target=self._background_pass, name="vllm-neuron-tier-upkeep", daemon=True)
        self._background.start()

    def _background_pass(self) -> None:
        try:
            outcome = plan_gc(self.local, failure_max_age=self._failure_max_age).execute()
            for item, error in outcome.failed:
                logger.debug("compile cache: could not collect %s: %s", item.where, error)
        except Exception as exc:  # noqa: BLE001 - hygiene never stops the cache
            logger.debug("compile cache: could not collect what killed processes left in "
                         "%s: %s", self.local.url, exc)  # fmt: skip
        if self.remote.url and not self.remote.read_only:
            keys = owed_keys(self.local)
            try:
                settle_owed(self.local, self.remote, keys, lease_seconds=self._lease_seconds,
                            lock_lease=self._lock_lease)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - a background pass never kills the process
                logger.warning("compile cache: settling owed promotions stopped: %s", exc)

    def wait_for_background(self, timeout: float | None = None) -> bool:
        """Wait for the start's background pass; True when it has ended.

        A process about to exit calls it to share what it owes now rather than at its next
        start (tests, short-lived tools); serving never waits.
        """
        if self._background is not None:
            self._background.join(timeout)
            return not self._background.is_alive()
        return True

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
