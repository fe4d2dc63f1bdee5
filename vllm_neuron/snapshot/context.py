"""The forward context the model runner publishes, and the process-global capture budget.

A compiled executable sees tensors, not requests: which request and which token a forward
serves is known only to the model runner. The runner and the executable run on the same
thread inside one synchronous forward, so the runner publishes a
:class:`SnapshotForwardContext` into a process-global holder before calling the model and
clears it after; the executable reads it when deciding whether to capture. No context
published means warm-up (or a forward outside the runner): never counted, never captured.

The budget (``VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_MAX_CAPTURES``) counts captured *forwards*:
every executable of one forward (a piecewise-compiled model runs several) that is selected
shares one unit, because replaying that forward needs all of its pieces. A unit is consumed
only when a bundle was written successfully; a failed capture gives its reservation back.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from vllm_neuron.envs import snapshot_settings

from .config import CaptureSelector, ForwardVerdict, snapshot_config

__all__ = [
    "CaptureBudget",
    "SnapshotForwardContext",
    "clear_current_forward",
    "forward_context",
    "get_capture_budget",
    "get_current_forward",
    "reset_capture_budget",
    "reset_snapshot_config",
    "set_current_forward",
]


@dataclass(frozen=True)
class SnapshotForwardContext:
    """The identity of one forward, published by the runner before the compiled forward.

    ``positions[i]`` is the position of row ``i``'s first scheduled token; ``is_decode`` is
    one flag for the forward or one per row. ``verdict`` is the runner's
    ``CaptureSelector.evaluate_forward`` result (None: each executable evaluates it).
    """

    step: int
    req_ids: tuple[str, ...] = ()
    positions: tuple[int, ...] = ()
    is_decode: bool | tuple[bool, ...] = False
    num_speculative_tokens: int = 0
    verdict: ForwardVerdict | None = None

    @property
    def is_prompt(self) -> bool:
        """True when any row is still prefilling (the forward is not pure decode)."""
        if isinstance(self.is_decode, bool):
            return not self.is_decode
        return not all(self.is_decode)

    @classmethod
    def build(
        cls,
        step: int,
        req_ids: Sequence[str],
        positions: Sequence[int],
        is_decode: bool | Sequence[bool],
        num_speculative_tokens: int = 0,
        *,
        selector: CaptureSelector | None = None,
    ) -> SnapshotForwardContext:
        """A context with its verdict evaluated by ``selector`` (default: the process's)."""
        sel = selector if selector is not None else snapshot_config().selector
        flags: bool | tuple[bool, ...] = (
            is_decode if isinstance(is_decode, bool) else tuple(bool(f) for f in is_decode)
        )
        verdict = sel.evaluate_forward(req_ids, positions, flags, num_speculative_tokens)
        return cls(
            step=step,
            req_ids=tuple(req_ids),
            positions=tuple(int(p) for p in positions),
            is_decode=flags,
            num_speculative_tokens=num_speculative_tokens,
            verdict=verdict,
        )


# The holder. Read directly (`context._current`) on the execute path: one global load.
_current: SnapshotForwardContext | None = None


def set_current_forward(ctx: SnapshotForwardContext) -> None:
    """Publish the context of the forward about to run (the runner, before the model)."""
    global _current
    _current = ctx


def get_current_forward() -> SnapshotForwardContext | None:
    return _current


def clear_current_forward() -> None:
    """Withdraw the context (the runner, after the model, also on error)."""
    global _current
    _current = None


@contextmanager
def forward_context(ctx: SnapshotForwardContext) -> Iterator[SnapshotForwardContext]:
    """``with forward_context(ctx): model(...)`` publishes and always clears."""
    global _current
    previous = _current
    _current = ctx
    try:
        yield ctx
    finally:
        _current = previous


# The position of the next compiled-graph call within the published forward. Every rank
# runs the same graphs in the same order, so (step, position) names one call on every
# rank, including a piece whose graph differs by rank (vLLM's vocab-parallel embedding):
# what a collective replay pairs the ranks' bundles by.
_position_of: SnapshotForwardContext | None = None
_position = 0


def next_forward_call(ctx: SnapshotForwardContext) -> int:
    """The position of this graph call among the graph calls of forward ``ctx`` (from 0)."""
    global _position_of, _position
    if ctx is not _position_of:
        _position_of, _position = ctx, 0
    position = _position
    _position += 1
    return position


class CaptureBudget:
    """At most ``max_captures`` captured forwards per process (thread-safe).

    ``reserve(step)`` before writing, then ``commit(step)`` once the bundle is written or
    ``release(step)`` if it was not. Executables of a forward that is already reserved or
    consumed always get in: one forward, one unit.

    ``stop(reason)`` ends capture for the process (the snapshot root is full, read-only or
    refused: every later bundle would fail the same way); ``stopped`` says why.
    """

    def __init__(self, max_captures: int) -> None:
        if max_captures < 0:
            raise ValueError(f"max_captures must be >= 0, got {max_captures}")
        self.max_captures = max_captures
        self._consumed: set[int] = set()
        self._pending: dict[int, int] = {}
        self._lock = threading.Lock()
        self.stopped: str | None = None

    @property
    def consumed(self) -> int:
        return len(self._consumed)

    @property
    def remaining(self) -> int:
        with self._lock:
            return max(0, self.max_captures - len(self._consumed | set(self._pending)))

    def reserve(self, step: int) -> bool:
        with self._lock:
            if self.stopped is not None:
                return False
            if step in self._consumed or step in self._pending:
                self._pending[step] = self._pending.get(step, 0) + 1
                return True
            if len(self._consumed) + len(self._pending) >= self.max_captures:
                return False
            self._pending[step] = 1
            return True

    def _drop(self, step: int) -> None:
        left = self._pending.get(step, 0) - 1
        if left > 0:
            self._pending[step] = left
        else:
            self._pending.pop(step, None)

    def commit(self, step: int) -> None:
        with self._lock:
            self._drop(step)
            self._consumed.add(step)

    def release(self, step: int) -> None:
        with self._lock:
            self._drop(step)

    def stop(self, reason: str) -> bool:
        """No capture after this one; True for the call that stopped it (it says so once)."""
        with self._lock:
            first = self.stopped is None
            if first:
                self.stopped = reason
            return first


_budget: CaptureBudget | None = None
_budget_lock = threading.Lock()


def get_capture_budget() -> CaptureBudget:
    """The process-global budget, sized from the process's snapshot settings."""
    global _budget
    with _budget_lock:
        if _budget is None:
            _budget = CaptureBudget(snapshot_config().max_captures)
        return _budget


def reset_capture_budget(budget: CaptureBudget | None = None) -> None:
    """Replace (or forget) the process-global budget; for tests."""
    global _budget
    with _budget_lock:
        _budget = budget


def reset_snapshot_config() -> None:
    """Forget the snapshot settings and the capture budget (tests, or re-reading the env).

    The settings are forgotten in :mod:`vllm_neuron.envs`, which parses them (its
    ``reset_for_tests`` forgets them too, with every other group); the budget is this
    module's state, sized from the settings, so it is forgotten with them.
    """
    snapshot_settings.cache_clear()
    reset_capture_budget()
