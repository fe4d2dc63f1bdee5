"""What the compile cache hands back and raises: the result of a lookup and the errors a
caller can tell apart.

Kept apart from `cache.py` so that the fleet protocol (`fleet.py`), which the cache uses,
can raise the cache's own errors without importing the cache.
"""

from __future__ import annotations

import msgspec

from vllm_neuron.envs.compile_cache import RemoteWrite  # the setting's own type

from .entry import EntryRecord

__all__ = ["CacheResult", "CompileError", "PrecompiledOnlyMiss", "RemoteWrite"]

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
