"""What the compile cache hands back and raises: the result of a lookup, the errors a
caller can tell apart, and the remote-write setting's values.

Kept apart from `cache.py` so that the fleet protocol (`fleet.py`), which the cache uses,
can raise the cache's own errors without importing the cache.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from .entry import EntryRecord

__all__ = ["CacheResult", "CompileError", "PrecompiledOnlyMiss", "RemoteWrite"]

RemoteWrite = Literal["auto", "off"]
"""VLLM_NEURON_REMOTE_WRITE: "auto" compiles once per fleet (remote leases, promotion after
a compile); "off" leaves the remote read-only (promotion is `save_cache`)."""


class CompileError(RuntimeError):
    """The compile of a key failed (in this process or in the one we waited for)."""


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
