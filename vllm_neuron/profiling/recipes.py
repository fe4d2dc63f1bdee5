"""The two capture recipes: prefill isolation and decode isolation.

Each call runs one *profiling window*: a run of the workload and one profiler session. The
capture checks the window's trace and, when it missed the phase, runs another window (up
to ``max_windows``; see `capture`).

**Prefill isolation.** Prefill is one iteration long, so an iteration counter cannot
isolate it. The profiler is armed while the server is idle (no warm-up request has been
sent), exactly one synchronous request with ``max_tokens 1`` is fired (the prefill pass
emits that token itself: no decode iteration runs), and the profiler is stopped the moment
the request returns. ``max_iterations 2`` in the profiler config is only a safety cap.

**Decode isolation.** The workload starts at the target concurrency, and the server log's
stats lines are followed; the profiler is armed on the first tick that shows no prefill,
``Running`` equal to the target and nothing waiting. The next iterations are steady-state
decode, and ``max_iterations 2`` closes the window; the workload then runs to its end and
the (idempotent) explicit stop is sent. When no tick can ever be prefill-free (the decode
leg is shorter than the stats tick), `NeedsFallback` is raised so the capture can relaunch
with the decode-only KV connector.

Why a decode window can miss, and what prevents it: a tick is evidence about the past. It
is logged at the end of its interval, read by polling the log, and the profiler starts
only after ``/start_profile`` has crossed the API server's event loop and the engine's
input queue. On a busy host the waiting parties (the stats logger, this follower, the
HTTP handler) wake late while the engine core keeps stepping (far later when the server
runs in a scheduling group of its own, which `lifecycle` avoids), so ticks arrive in bursts
and the first steady tick of a burst can describe a batch that has already finished: a
window opened then records no model step at all. So the trigger fires only on fresh
evidence: the *latest* tick of a read must still show steady decode, and every request of
the batch must still be unanswered at the client. A stale trigger is withdrawn
(`WindowMissed` when the workload ends without a fresh one), and the window's trace is
still checked afterwards, since the batch can drain while ``/start_profile`` is in flight.
A busy host can also stagger the batch's requests so that it never runs whole; that too is
a missed window (decode ticks below the target prove it is not the structural case that
needs the fallback).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_neuron.backends import Store

from .client import VllmClient
from .logfollow import LogFollower
from .run_spec import Workload
from .stats import (
    DEFAULT_STATS_INTERVAL,
    Decision,
    FallbackDetector,
    StatsTick,
    Verdict,
    is_decode_steady,
    parse_stats_line,
)
from .workload import WorkloadRunner, make_prompt


class RecipeFailed(RuntimeError):
    """The recipe could not produce its capture (the reason is the message)."""


class WindowMissed(RuntimeError):
    """The window's workload ended before the trigger fired on fresh evidence.

    No profiler session was opened (or none that could hold the phase), so the capture may
    run the workload again in another window.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class NeedsFallback(RuntimeError):
    """Decode arming can structurally never fire; serve without prefill instead."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class ProfilerControl:
    """Start/stop bookkeeping, so teardown knows whether a stop is still owed."""

    def __init__(self, client: VllmClient, *, start_timeout: float, stop_timeout: float) -> None:
        self.client = client
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.active = False
        self.timings: dict[str, float] = {}

    def start(self) -> None:
        self.timings["start_profile_s"] = round(
            self.client.start_profile(timeout=self.start_timeout), 3
        )
        self.active = True

    def stop(self, timeout: float | None = None) -> None:
        if not self.active:
            return
        self.active = False  # stop is idempotent on the server; never send it twice here
        self.timings["stop_profile_s"] = round(
            self.client.stop_profile(timeout=timeout or self.stop_timeout), 3
        )


@dataclass
class RecipeResult:
    requests: dict[str, Any] = field(default_factory=dict)
    trigger: dict[str, Any] | None = None


def prefill_isolation(
    client: VllmClient,
    profiler: ProfilerControl,
    workload: Workload,
    *,
    request_timeout: float,
    window: int = 1,
) -> RecipeResult:
    profiler.start()
    t0 = time.monotonic()
    result = client.chat(
        # A prompt of its own per window: a retried window must not hit the prefix cache.
        make_prompt(workload.input_len, f"prefill-w{window}"),
        max_tokens=1,
        ignore_eos=workload.ignore_eos,
        timeout=request_timeout,
    )
    profiler.stop()
    if not result.ok:
        raise RecipeFailed(f"the prefill request failed: {result.error}")
    return RecipeResult(
        requests={
            "sent": 1,
            "ok": 1,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "seconds": round(result.seconds, 3),
        },
        trigger={
            "kind": "idle",
            "armed_after_s": 0.0,
            "request_s": round(time.monotonic() - t0, 3),
        },
    )


def stale_trigger(
    latest: StatsTick, in_flight: int, target: int, *, connector_mode: bool
) -> str | None:
    """Why an armed tick no longer describes the batch (None: it still does).

    `latest` is the newest tick read with it and `in_flight` the requests the client has
    sent and not yet had answered.
    """
    if not is_decode_steady(latest, target, require_prefill_free=not connector_mode):
        return f"a later tick read with it no longer shows steady decode: {latest.line.strip()}"
    if in_flight < target:
        return (
            f"only {in_flight} of the {target} requests were still unanswered: the batch is "
            "draining"
        )
    return None


def decode_isolation(
    client: VllmClient,
    profiler: ProfilerControl,
    workload: Workload,
    *,
    log_store: Store,
    log_key: str,
    connector_mode: bool,
    patience: int,
    tick_seconds: float | None,
    request_timeout: float,
    window: int = 1,
    poll_interval: float = 0.02,
    on_tick: Callable[[str], None] | None = None,
    log: Callable[[str], None] | None = None,
    on_armed: Callable[[dict[str, Any]], None] | None = None,
) -> RecipeResult:
    """Run the workload, arm on a fresh stats trigger, let the workload finish, stop.

    `on_armed` receives the trigger record as soon as it fires, so a capture interrupted
    afterwards still records what armed it. Raises `WindowMissed` when the workload ended
    with every trigger withdrawn as stale (see the module docstring).
    """
    follower = LogFollower(log_store, log_key)
    detector = FallbackDetector(
        workload.concurrency,
        patience=patience,
        input_len=workload.input_len,
        tick_seconds=tick_seconds,
        connector_mode=connector_mode,
    )
    runner = WorkloadRunner(
        client,
        input_len=workload.input_len,
        output_len=workload.output_len,
        concurrency=workload.concurrency,
        num_requests=workload.num_requests,
        request_timeout=request_timeout,
        tag=f"w{window}-",
    )
    t0 = time.monotonic()
    runner.start()
    trigger: dict[str, Any] | None = None
    withdrawn: list[str] = []
    try:
        while trigger is None:
            armed: Decision | None = None
            latest: StatsTick | None = None
            for line in follower.read_lines():
                tick = parse_stats_line(line)
                if tick is None:
                    continue
                if on_tick is not None:
                    on_tick(line)
                latest = tick
                decision = detector.observe(tick)
                if decision.verdict is Verdict.FALLBACK:
                    raise NeedsFallback(decision.reason)
                if decision.verdict is Verdict.ARM and armed is None:
                    armed = decision
            if armed is not None and latest is not None:
                stale = stale_trigger(latest, runner.in_flight(), workload.concurrency,
                                      connector_mode=connector_mode)
                if stale is None:
                    # The newest tick is the freshest evidence; it is the one recorded.
                    trigger = _armed(Decision(Verdict.ARM, armed.reason, latest), t0,
                                     connector_mode)
                    break
                withdrawn.append(stale)
                detector.disarm()
                if log is not None:
                    log(f"decode trigger withdrawn in window {window} ({stale})")
            if runner.done():
                _read_to_idle(follower, detector, tick_seconds, poll_interval)
                if withdrawn or detector.decision.verdict is Verdict.ARM:
                    why = withdrawn[-1] if withdrawn else (
                        "its steady tick was read only after the last response")
                    raise WindowMissed(
                        f"the workload finished before the trigger fired on fresh evidence "
                        f"({why})"
                    )
                most = detector.ran_below_target()
                if most is not None:
                    raise WindowMissed(
                        f"the batch never ran whole: at most {most} of the {workload.concurrency}"
                        " requests decoded at once (requests arriving staggered on a busy host, "
                        "or --max-num-seqs or the KV cache below the concurrency)"
                    )
                reason = detector.finish().reason
                if connector_mode:
                    raise RecipeFailed(
                        f"{reason} (even with the decode-only connector; is --max-num-seqs "
                        "below the concurrency?)"
                    )
                raise NeedsFallback(reason)
            time.sleep(poll_interval)
        if withdrawn:
            trigger["withdrawn"] = withdrawn
        if log is not None:
            log(f"decode trigger fired ({trigger['reason']}): {trigger['line']}")
        if on_armed is not None:
            on_armed(trigger)
        profiler.start()
        trigger["start_profile_after_s"] = round(time.monotonic() - t0, 3)
        # Not proof either way (responses trail the engine), but the first thing to read
        # when a window is rejected.
        trigger["in_flight_after_start"] = runner.in_flight()
        if log is not None:
            log(f"profiling window {window} open")
        if not runner.wait(timeout=request_timeout):
            raise RecipeFailed(f"the workload did not finish within {request_timeout:g} s")
        profiler.stop()
    finally:
        runner.stop()
    summary = runner.summary()
    if summary.failed:
        raise RecipeFailed(f"{summary.failed} of {summary.sent} requests failed: {summary.errors}")
    return RecipeResult(
        requests={
            "sent": summary.sent,
            "ok": summary.ok,
            "prompt_tokens": summary.prompt_tokens,
            "completion_tokens": summary.completion_tokens,
            "concurrency": workload.concurrency,
        },
        trigger=trigger,
    )


def _read_to_idle(
    follower: LogFollower, detector: FallbackDetector, tick_seconds: float | None,
    poll_interval: float,
) -> None:
    """Feed `detector` the ticks still to come for a finished workload, up to an idle one.

    The last ticks of a batch are logged after its last response (and, on a busy host,
    read later still), so judging at the last response would miss them: a steady tick among
    them means the window was missed, not that no tick can ever be prefill-free. vLLM logs
    one idle tick (no throughput, nothing running) after activity, so that is the
    handshake; a server that never logs one is judged after three ticks.
    """
    interval = tick_seconds if tick_seconds is not None else DEFAULT_STATS_INTERVAL
    deadline = time.monotonic() + 3 * interval
    while True:
        for line in follower.read_lines():
            tick = parse_stats_line(line)
            if tick is None:
                continue
            detector.observe(tick)
            if not tick.busy:
                return
        if time.monotonic() >= deadline:
            return
        time.sleep(poll_interval)


def _armed(decision: Decision, t0: float, connector_mode: bool) -> dict[str, Any]:
    assert decision.tick is not None
    return {
        "kind": "connector" if connector_mode else "stats",
        "reason": decision.reason,
        "line": decision.tick.line.strip(),
        "armed_after_s": round(time.monotonic() - t0, 3),
    }
