"""The report of one replayed snapshot bundle: shared by the one-process replay
(:mod:`.replay`) and the tensor-parallel one (:mod:`.tp_replay`), which builds on it, so
neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .bundles import Bundle
from .compare import OutputComparison

__all__ = ["ReplayReport", "report_of"]


@dataclass(frozen=True)
class ReplayReport:
    """The replay of one bundle."""

    bundle: str
    runner: str
    outputs: tuple[OutputComparison, ...] = ()
    problem: str | None = None
    global_rank: int = 0
    call_index: int = 0
    tp_rank: int = 0
    collectives: tuple[str, ...] = ()  # the collective ops its graph calls
    peers: tuple[str, ...] = ()  # the other ranks' bundles replayed together with it
    runner_note: str | None = None  # with --runner auto: why the cache entry did not run
    missing: bool = False  # named (by a manifest) but not there: nothing to replay

    @property
    def passed(self) -> bool:
        return self.problem is None and all(o.passed for o in self.outputs)

    @property
    def ran(self) -> bool:
        """Whether the bundle was run and compared (its outputs then say whether it matched);
        False when it could not be replayed or is missing: never counted as a mismatch."""
        return self.problem is None


def report_of(bundle: Bundle, runner: str, outputs: Sequence[OutputComparison] = (),
              problem: str | None = None, runner_note: str | None = None) -> ReplayReport:
    """The report of ``bundle``, with its identity from its ``meta.json``."""
    meta = bundle.meta
    return ReplayReport(bundle.location, runner, tuple(outputs), problem, meta.global_rank,
                        meta.call_index, meta.tp_rank, tuple(meta.collectives or ()),
                        runner_note=runner_note)  # fmt: skip
