"""Waiting on observable facts, so no contract test is decided by how long something took.

"Meanwhile" is a handshake (a thread seen blocked inside a lock's ``acquire``), lease expiry
is read from the lease's own record on the store's clock, and the only upper bound (`HANG`)
catches hangs. A loaded machine makes the suite slower, never red.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import msgspec

from ..locks import LeaseLock, Lock

HANG = 300.0
"""Seconds. A safety limit only: what takes this long is hung, not slow."""


def _lock_classes(cls: type[Lock] = Lock) -> list[type[Lock]]:
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _lock_classes(direct))]


def wait_until_blocked(thread: threading.Thread, timeout: float = HANG) -> None:
    """Poll until `thread` is inside a lock's ``acquire`` (seen in its stack).

    The observable fact that a thread waits for a lock, where a test would otherwise sleep
    and hope it got there. Fails if the thread ends first, or after `timeout` (a hang).
    """
    codes = {cls.__dict__["acquire"].__code__ for cls in _lock_classes()
             if "acquire" in cls.__dict__ and hasattr(cls.__dict__["acquire"], "__code__")}
    deadline = time.monotonic() + timeout
    while True:
        frame = sys._current_frames().get(thread.ident or -1)
        while frame is not None:
            if frame.f_code in codes:
                return
            frame = frame.f_back
        if not thread.is_alive():
            raise AssertionError(f"{thread.name} ended without blocking on a lock")
        if time.monotonic() > deadline:
            raise AssertionError(f"{thread.name} did not block on a lock within {timeout} s")
        time.sleep(0.005)


def lease_record(lease: LeaseLock) -> dict[str, Any]:
    """The lease's current generation record in its store (owner, generation, expires)."""
    generation, record = lease._latest()
    assert record is not None, f"lease {lease.name!r} has no record"
    return {**msgspec.structs.asdict(record), "generation": generation}
