"""What keeps one node's local tier healthy beside serving: `TierUpkeep`.

Three jobs, none on the hot path and none allowed to stop the cache from serving:

- when a cache opens: collect what killed processes left (staging older than
  `STAGING_MAX_AGE`), bring the tier within its size bound, and settle the promotions an
  earlier process owed the remote (`owed.py`) in a background thread;
- after each publish: evict least recently used entries above the bound (`eviction.py`);
- around a compile for the fleet: note the promotion owed, forget it once promoted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection

from vllm_neuron.backends import Record, Store

from .eviction import Evictor
from .inventory import find_leftovers, remove_leftovers
from .owed import owe_promotion, owed_keys, promotion_settled, settle_owed
from .remote_tier import RemoteTier

logger = logging.getLogger("vllm_neuron.compile")

STAGING_MAX_AGE = 6 * 3600.0
"""Seconds a staging area is left untouched before a starting cache collects it."""


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
        record: Callable[[Record], None],
    ) -> None:
        self.local = local
        self.remote = remote
        self._lease_seconds = lease_seconds
        self._lock_lease = lock_lease
        self._evictor = Evictor(local, max_size, record=record) if max_size else None
        self._settling: threading.Thread | None = None

    # ------------------------------------------------------------------ start
    def at_start(self) -> None:
        """Collect stale staging, fit the bound, start settling owed promotions."""
        try:
            remove_leftovers(self.local, find_leftovers(self.local, older_than=STAGING_MAX_AGE))
        except Exception as exc:  # noqa: BLE001 - hygiene never stops the cache from starting
            logger.debug("compile cache: could not collect stale staging: %s", exc)
        self.keep_within_bound(())
        if self.remote.url and not self.remote.read_only:
            keys = owed_keys(self.local)
            if keys:
                self._settling = threading.Thread(
                    target=self._settle, args=(keys,), name="vllm-neuron-owed-promotions",
                    daemon=True)  # fmt: skip
                self._settling.start()

    def _settle(self, keys: list[str]) -> None:
        try:
            settle_owed(self.local, self.remote, keys, lease_seconds=self._lease_seconds,
                        lock_lease=self._lock_lease)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a background pass never kills the process
            logger.warning("compile cache: settling owed promotions stopped: %s", exc)

    def wait_for_owed_promotions(self, timeout: float | None = None) -> bool:
        """Wait for the start's background promotions; True when none is running.

        A process that is about to exit calls it to share what it owes now rather than
        at its next start (the CLI, tests); serving never waits.
        """
        if self._settling is not None:
            self._settling.join(timeout)
            return not self._settling.is_alive()
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
