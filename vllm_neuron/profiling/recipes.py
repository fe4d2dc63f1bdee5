"""The two capture recipes: prefill isolation and decode isolation.

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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .client import VllmClient
from .logfollow import LogFollower
from .run_spec import Workload
from .stats import Decision, FallbackDetector, Verdict
from .workload import WorkloadRunner, make_prompt


class RecipeFailed(RuntimeError):
    """The recipe could not produce its capture (the reason is the message)."""


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
    client: VllmClient, profiler: ProfilerControl, workload: Workload, *, request_timeout: float
) -> RecipeResult:
    profiler.start()
    t0 = time.monotonic()
    result = client.chat(
        make_prompt(workload.input_len, "prefill"),
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


def decode_isolation(
    client: VllmClient,
    profiler: ProfilerControl,
    workload: Workload,
    *,
    log_path: str,
    connector_mode: bool,
    patience: int,
    tick_seconds: float | None,
    request_timeout: float,
    poll_interval: float = 0.02,
    on_tick: Callable[[str], None] | None = None,
    log: Callable[[str], None] | None = None,
    on_armed: Callable[[dict[str, Any]], None] | None = None,
) -> RecipeResult:
    """Run the workload, arm on the stats trigger, let the workload finish, stop.

    `on_armed` receives the trigger record as soon as it fires, so a capture interrupted
    afterwards still records what armed it.
    """
    follower = LogFollower(log_path)
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
    )
    t0 = time.monotonic()
    runner.start()
    trigger: dict[str, Any] | None = None
    try:
        while trigger is None:
            for line in follower.read_lines():
                if on_tick is not None and "Avg prompt throughput" in line:
                    on_tick(line)
                decision = detector.observe_line(line)
                if decision.verdict is Verdict.ARM and decision.tick is not None:
                    trigger = _armed(decision, t0, connector_mode)
                    break
                if decision.verdict is Verdict.FALLBACK:
                    raise NeedsFallback(decision.reason)
            if trigger is not None:
                break
            if runner.done():
                for line in follower.read_lines():  # the ticks logged as it finished
                    detector.observe_line(line)
                reason = detector.finish().reason
                if detector.decision.verdict is Verdict.ARM:
                    raise RecipeFailed("the workload finished as the trigger fired: too short")
                if connector_mode:
                    raise RecipeFailed(
                        f"{reason} (even with the decode-only connector; is --max-num-seqs "
                        "below the concurrency?)"
                    )
                raise NeedsFallback(reason)
            time.sleep(poll_interval)
        if log is not None:
            log(f"decode trigger fired ({trigger['reason']}): {trigger['line']}")
        if on_armed is not None:
            on_armed(trigger)
        profiler.start()
        trigger["start_profile_after_s"] = round(time.monotonic() - t0, 3)
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


def _armed(decision: Decision, t0: float, connector_mode: bool) -> dict[str, Any]:
    assert decision.tick is not None
    return {
        "kind": "connector" if connector_mode else "stats",
        "reason": decision.reason,
        "line": decision.tick.line.strip(),
        "armed_after_s": round(time.monotonic() - t0, 3),
    }


