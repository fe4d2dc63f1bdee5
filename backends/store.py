"""`Store`: the byte operations of `StoreBase` plus the protocols built from them.

Named locks (a kernel lock where the store's processes share a kernel's view of the file,
otherwise a fenced lease) and per-writer event logs are written against `StoreBase`;
this class hands them out, so callers keep one object for everything a store does.
Every backend subclasses `Store`.
"""

from __future__ import annotations

from .base import LOCKS_DIR, StoreBase
from .errors import StoreError
from .eventlog import EventLog
from .keys import join, validate_key
from .locks import KernelLock, LeaseLock, Lock


class Store(StoreBase):
    """A key -> bytes store at a URL. Get one with `open_store`, never by constructing it."""

    def lock(
        self, name: str, *, timeout: float | None = None, lease_duration: float = 30.0
    ) -> Lock:
        """A named lock: a kernel lock where trustworthy, otherwise a fenced lease.

        `timeout` is what entering the lock as a context manager waits (None: forever).
        """
        validate_key(name)
        if self.capabilities.kernel_locks:
            path = self.local_path(join(LOCKS_DIR, name + ".lock"))
            if path is None:
                raise StoreError(f"{self.url} claims kernel locks but has no local paths")
            return KernelLock(path, name=name, timeout=timeout)
        return LeaseLock(
            self, join(LOCKS_DIR, name), lease_duration=lease_duration, timeout=timeout
        )

    def log(
        self, stream: str, *, writer: str | None = None, truncate_first: bool = False
    ) -> EventLog:
        """The append-only event stream `stream` (one segment per writer)."""
        return EventLog(self, validate_key(stream), writer=writer, truncate_first=truncate_first)
