"""What one pass of the per-key flow is asked (`cache.py`), in a module of its own.

The flow (`cache.py`) and the collaborators it hands a key to - the worker hand-off
(`hand_off.py`), the healing of an entry that will not load (`healing.py`) - all read the
same question; it lives here so that none of them imports another to learn its shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..tiers.build import CompileFn

__all__ = ["Ask", "WorkerCompile"]

WorkerCompile = Callable[[], "tuple[CompileFn, Callable[[], None]] | None"]
"""Prepares a graph for a compile worker (`TwoTierCache.begin`): the compile to run, and
what discards the prepared job; None when the graph cannot go to a worker."""


@dataclass(frozen=True)
class Ask:
    """One pass of the flow for one key: what to compile it with, and how patient to be.

    `wait`: False for `begin`'s first pass (where waiting would start, a `Wait` comes back);
    `started` (epoch seconds): when the caller began to want the key - a compile that failed
    since then is its failure too; `worker`: prepares the graph for a compile worker;
    `have_slot`: the caller already holds one of the node's compile slots."""

    key: str
    compile_fn: CompileFn
    components: Mapping[str, str]
    piece: str | None
    wait: bool
    started: float | None = None
    worker: WorkerCompile | None = None
    have_slot: bool = False

    @property
    def what(self) -> str:
        return f"{self.key} ({self.piece})" if self.piece else self.key
