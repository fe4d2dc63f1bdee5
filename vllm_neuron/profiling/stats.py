"""The engine's periodic stats line: parsing, the decode trigger and the fallback detector.

vLLM logs, every ``VLLM_LOG_STATS_INTERVAL`` seconds (one *tick*)::

    Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 412.3
    tokens/s, Running: 4 reqs, Waiting: 0 reqs, GPU KV cache usage: 1.2%, ...

Decode isolation arms the profiler on the first tick that proves no prefill is in flight:
prompt throughput 0, ``Running`` equal to the target concurrency and ``Waiting`` 0.

An average prompt throughput of 0 is a property of a whole tick: it needs a tick with no
prefill in it. When the workload's decode leg is shorter than the tick (concurrency 1,
requests back to back), every tick contains a prefill and the trigger can never fire. That
is structural, not flaky; its signature is a prompt throughput near ``input_len / tick`` on
every tick. `FallbackDetector` recognises it so the capture can fall back to serving with
a KV-transfer connector that skips prefill.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass

_STATS = re.compile(
    r"Avg prompt throughput:\s*(?P<prompt>[0-9.]+)\s*tokens/s,\s*"
    r"Avg generation throughput:\s*(?P<gen>[0-9.]+)\s*tokens/s,\s*"
    r"Running:\s*(?P<running>\d+)\s*reqs?,\s*"
    r"Waiting:\s*(?P<waiting>\d+)\s*reqs?"
)
_ENGINE = re.compile(r"Engine\s+(?P<engine>\d+):")
# vLLM's VLLM_LOG_STATS_INTERVAL when it is not set (seconds per tick).
DEFAULT_STATS_INTERVAL = 10.0


@dataclass(frozen=True)
class StatsTick:
    """One stats line."""

    prompt_throughput: float
    generation_throughput: float
    running: int
    waiting: int
    engine: int = 0
    line: str = ""

    @property
    def prefill_free(self) -> bool:
        return self.prompt_throughput == 0.0

    @property
    def busy(self) -> bool:
        """The engine did or held work during the tick.

        With short requests back to back, a tick often ends between two requests
        (``Running: 0``) although it contained a whole prefill; it is busy all the same.
        """
        return bool(
            self.running or self.waiting or self.prompt_throughput or self.generation_throughput
        )


def parse_stats_line(line: str) -> StatsTick | None:
    """The tick reported by `line`, or None when `line` is not a stats line."""
    m = _STATS.search(line)
    if m is None:
        return None
    e = _ENGINE.search(line, 0, m.start())
    return StatsTick(
        prompt_throughput=float(m["prompt"]),
        generation_throughput=float(m["gen"]),
        running=int(m["running"]),
        waiting=int(m["waiting"]),
        engine=int(e["engine"]) if e else 0,
        line=line.rstrip("\n"),
    )


def parse_stats_lines(lines: Iterable[str]) -> list[StatsTick]:
    return [t for t in (parse_stats_line(line) for line in lines) if t is not None]


def is_decode_steady(
    tick: StatsTick, target_running: int, *, require_prefill_free: bool = True
) -> bool:
    """The strict decode trigger: no prefill in the tick, the target batch, nothing queued.

    ``require_prefill_free=False`` is for serving with the decode-only connector: it leaves
    one prompt token per new request to compute, so the prompt throughput of a tick is not
    evidence of prefill there (every step is decode-shaped).
    """
    return (
        (tick.prefill_free or not require_prefill_free)
        and tick.running == target_running
        and tick.waiting == 0
    )


class Verdict(enum.Enum):
    WAIT = "wait"
    ARM = "arm"  # steady-state decode: start the profiler now
    FALLBACK = "fallback"  # structurally no prefill-free tick: serve without prefill


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str = ""
    tick: StatsTick | None = None


class FallbackDetector:
    """Watches ticks; decides to arm, to wait, or that arming can never happen.

    The fallback is declared after ``patience`` consecutive *busy* ticks (see
    `StatsTick.busy`) none of which was prefill-free, or when the workload ends without a
    trigger (`finish`).
    A busy tick that is prefill-free but not at the target batch (for example while the
    batch drains) shows that prefill-free ticks happen, and restarts the count.

    ``connector_mode``: the server runs the decode-only connector; arming ignores prompt
    throughput (see `is_decode_steady`) and there is no further fallback to declare.
    """

    def __init__(
        self,
        target_running: int,
        *,
        patience: int = 12,
        input_len: int | None = None,
        tick_seconds: float | None = None,
        connector_mode: bool = False,
    ) -> None:
        if target_running < 1:
            raise ValueError(f"target_running must be >= 1, got {target_running}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.target_running = target_running
        self.patience = patience
        self.input_len = input_len
        self.tick_seconds = tick_seconds
        self.connector_mode = connector_mode
        self.ticks: list[StatsTick] = []
        self._busy_with_prefill = 0
        self._saw_prefill_free_busy_tick = False
        self.decision = Decision(Verdict.WAIT)

    def observe(self, tick: StatsTick) -> Decision:
        if self.decision.verdict is not Verdict.WAIT:
            return self.decision
        self.ticks.append(tick)
        if is_decode_steady(
            tick, self.target_running, require_prefill_free=not self.connector_mode
        ):
            why = "target batch, nothing waiting (decode-only connector)" if (
                self.connector_mode) else "prefill-free tick at the target batch"
            self.decision = Decision(Verdict.ARM, why, tick)
            return self.decision
        if self.connector_mode:
            return self.decision
        if tick.busy:
            if tick.prefill_free:
                # Prefill-free ticks do happen, so the failure is not structural.
                self._saw_prefill_free_busy_tick = True
                self._busy_with_prefill = 0
            else:
                self._busy_with_prefill += 1
        if self._busy_with_prefill >= self.patience:
            self.decision = Decision(Verdict.FALLBACK, self._reason(), tick)
        return self.decision

    def ran_below_target(self) -> int | None:
        """The most requests a decode tick ran, when decode ticks happened below the target.

        A tick with requests running and no prefill in it proves the decode leg outlasts a
        tick, so a workload that ends without a trigger did not fail structurally: its batch
        never ran whole at once (requests arriving staggered on a busy host, or a server
        that cannot hold the target batch). None when no such tick was seen.
        """
        decode = [t.running for t in self.ticks
                  if t.running > 0 and (t.prefill_free or self.connector_mode)]
        return max(decode) if decode else None

    def disarm(self) -> None:
        """Withdraw an ARM whose tick turned out stale, and keep watching.

        The decode recipe arms only on fresh evidence (see `recipes.decode_isolation`): when
        a tick read in the same burst, or the client's own responses, show the batch already
        draining, the ARM is withdrawn. The withdrawn tick still proves that prefill-free
        ticks happen, so it counts against declaring the structural fallback.
        """
        if self.decision.verdict is Verdict.ARM:
            self._saw_prefill_free_busy_tick = True
            self._busy_with_prefill = 0
            self.decision = Decision(Verdict.WAIT)

    def observe_line(self, line: str) -> Decision:
        tick = parse_stats_line(line)
        return self.decision if tick is None else self.observe(tick)

    def finish(self) -> Decision:
        """The workload ended: if nothing armed by now, arming can never happen."""
        if self.decision.verdict is Verdict.WAIT:
            what = "a tick at the target batch" if self.connector_mode else (
                "a prefill-free tick at the target batch")
            self.decision = Decision(
                Verdict.FALLBACK,
                f"the workload finished without {what}; " + self._reason(),
            )
        return self.decision

    def _reason(self) -> str:
        busy = [t for t in self.ticks if t.busy]
        with_prefill = [t for t in busy if not t.prefill_free]
        parts = [
            f"{len(with_prefill)} of {len(busy)} busy ticks had prefill "
            f"(target running {self.target_running})"
        ]
        if with_prefill:
            rates = sorted(t.prompt_throughput for t in with_prefill)
            median = rates[len(rates) // 2]
            parts.append(f"median prompt throughput {median:g} tokens/s")
            if self.input_len and self.tick_seconds:
                expected = self.input_len / self.tick_seconds
                parts.append(
                    f"input_len/tick = {self.input_len}/{self.tick_seconds:g} s = "
                    f"{expected:g} tokens/s"
                )
        if not self._saw_prefill_free_busy_tick:
            parts.append("no tick was prefill-free: the decode leg is shorter than the tick")
        return "; ".join(parts)


def matches_no_prefill_free_signature(
    ticks: Iterable[StatsTick], input_len: int, tick_seconds: float, tolerance: float = 0.5
) -> bool:
    """True when every busy tick reports roughly one prompt of ``input_len`` per tick.

    The documented signature of the structural failure: a prompt throughput of exactly
    ``input_len / tick`` on every tick (``tolerance`` is relative, to absorb the engine's
    rounding and tick jitter).
    """
    busy = [t for t in ticks if t.busy]
    if not busy:
        return False
    expected = input_len / tick_seconds
    return all(
        not t.prefill_free and abs(t.prompt_throughput - expected) <= tolerance * expected
        for t in busy
    )
