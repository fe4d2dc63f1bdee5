"""The decode trigger and the fallback detector, over stats lines recorded from vLLM 0.32."""

from __future__ import annotations

import pytest
from profiling_support import DATA

from vllm_neuron.profiling.recipes import stale_trigger
from vllm_neuron.profiling.stats import (
    FallbackDetector,
    StatsTick,
    Verdict,
    is_decode_steady,
    matches_no_prefill_free_signature,
    parse_stats_line,
    parse_stats_lines,
)

LINE = (
    "(APIServer pid=25258) INFO 11-29 10:20:23 [loggers.py:335] Engine 000: Avg prompt "
    "throughput: 0.0 tokens/s, Avg generation throughput: 623.0 tokens/s, Running: 4 reqs, "
    "Waiting: 0 reqs, CPU KV cache usage: 1.6%, Prefix cache hit rate: 0.0%"
)


def lines(name: str) -> list[str]:
    return (DATA / name).read_text().splitlines()


def tick(prompt: float, running: int, waiting: int = 0, gen: float = 100.0) -> StatsTick:
    return StatsTick(prompt, gen, running, waiting)


def test_parse_stats_line() -> None:
    t = parse_stats_line(LINE)
    assert t == StatsTick(0.0, 623.0, 4, 0, engine=0, line=LINE)
    assert t.prefill_free
    assert parse_stats_line("INFO: 127.0.0.1 - GET /v1/models 200") is None
    other = parse_stats_line(
        LINE.replace("Engine 000", "Engine 003").replace("0.0 tokens", "5.5 tokens")
    )
    assert other is not None and other.engine == 3 and other.prompt_throughput == 5.5
    # Singular "req" and extra fields after Waiting (Deferred, KV fetch) still parse.
    t2 = parse_stats_line(
        "Avg prompt throughput: 1.0 tokens/s, Avg generation throughput: 2.0 tokens/s, "
        "Running: 1 req, Waiting: 1 req, Deferred: 2 reqs"
    )
    assert t2 is not None and (t2.running, t2.waiting) == (1, 1)


def test_strict_trigger_needs_all_three_conditions() -> None:
    assert is_decode_steady(tick(0.0, 4), 4)
    assert not is_decode_steady(tick(0.1, 4), 4)  # prefill in the tick
    assert not is_decode_steady(tick(0.0, 3), 4)  # not the target batch
    assert not is_decode_steady(tick(0.0, 4, waiting=1), 4)  # something queued
    assert not is_decode_steady(tick(0.0, 5), 4)
    # With the decode-only connector, prompt throughput is not evidence of prefill.
    assert is_decode_steady(tick(16.0, 1), 1, require_prefill_free=False)
    assert not is_decode_steady(tick(16.0, 1, waiting=1), 1, require_prefill_free=False)


def test_trigger_arms_on_first_prefill_free_target_tick_of_a_recorded_run() -> None:
    recorded = lines("stats_decode_c4.log")  # concurrency 4, 256-token decode legs
    det = FallbackDetector(4)
    decisions = [det.observe_line(line) for line in recorded]
    armed_at = next(i for i, d in enumerate(decisions) if d.verdict is Verdict.ARM)
    # Ticks 0-1 are the admission ticks (prompt throughput > 0); tick 2 is the first clean one.
    assert armed_at == 2
    d = decisions[armed_at]
    assert d.tick is not None
    assert (d.tick.prompt_throughput, d.tick.running, d.tick.waiting) == (0.0, 4, 0)
    # Once armed, the decision sticks.
    assert all(x.verdict is Verdict.ARM for x in decisions[armed_at:])


def test_trigger_ignores_lines_that_are_not_stats() -> None:
    det = FallbackDetector(2, patience=1)
    for line in ["INFO: Started server process", "", "WARNING something Running: 2 reqs"]:
        assert det.observe_line(line).verdict is Verdict.WAIT
    assert det.ticks == []


def test_no_prefill_free_tick_is_detected_in_a_recorded_run() -> None:
    """Concurrency 1, 4-token decode legs, 0.25 s tick: every busy tick has a prefill."""
    ticks = parse_stats_lines(lines("stats_no_prefill_free_c1.log"))
    # Most ticks end between two requests (Running: 0) yet contain a whole prefill.
    assert sum(1 for t in ticks if t.running == 0) > len(ticks) // 2
    assert all(not t.prefill_free for t in ticks[:-1])
    det = FallbackDetector(1, patience=8, input_len=128, tick_seconds=0.25)
    verdicts = [det.observe(t).verdict for t in ticks]
    assert Verdict.ARM not in verdicts
    assert verdicts.index(Verdict.FALLBACK) == 7  # the 8th busy tick with prefill
    reason = det.decision.reason
    assert "8 of 8 busy ticks had prefill" in reason
    assert "no tick was prefill-free" in reason
    assert "input_len/tick = 128/0.25 s = 512 tokens/s" in reason


def test_workload_end_without_trigger_is_a_fallback() -> None:
    det = FallbackDetector(1, patience=100)
    for t in [tick(512.0, 1), tick(512.0, 1), tick(0.0, 0, gen=0.0)]:
        assert det.observe(t).verdict is Verdict.WAIT
    d = det.finish()
    assert d.verdict is Verdict.FALLBACK
    assert "finished without a prefill-free tick" in d.reason


def test_prefill_free_ticks_below_target_reset_the_patience() -> None:
    """Prefill-free ticks do occur (just not at the target): not the structural failure."""
    det = FallbackDetector(4, patience=3)
    seq = [tick(100, 4), tick(100, 4), tick(0.0, 3), tick(100, 4), tick(100, 4), tick(0.0, 4)]
    verdicts = [det.observe(t).verdict for t in seq]
    assert verdicts == [Verdict.WAIT] * 5 + [Verdict.ARM]


def test_idle_ticks_are_not_evidence() -> None:
    det = FallbackDetector(2, patience=2)
    for _ in range(10):
        assert det.observe(tick(0.0, 0, gen=0.0)).verdict is Verdict.WAIT
    assert det.observe(tick(50.0, 2)).verdict is Verdict.WAIT
    assert det.observe(tick(50.0, 2)).verdict is Verdict.FALLBACK


def test_connector_mode_arms_on_target_batch_of_a_recorded_run() -> None:
    """With DecodeBenchConnector each new request computes one prompt token, so prompt
    throughput never drops to 0 at concurrency 1; the connector-mode trigger arms anyway."""
    ticks = parse_stats_lines(lines("stats_connector_c1.log"))
    busy = [t for t in ticks if t.running]
    # One computed prompt token per new request: a few tokens/s, never the prompt length.
    assert busy and all(t.prompt_throughput < 50 for t in busy)
    assert sum(1 for t in busy if t.prompt_throughput > 0) > len(busy) // 2
    det = FallbackDetector(1, connector_mode=True)
    verdicts = [det.observe(t).verdict for t in ticks]
    assert Verdict.FALLBACK not in verdicts
    first = verdicts.index(Verdict.ARM)
    armed = ticks[first]
    # It armed where the strict trigger could not: the tick counts one-token "prefills".
    assert armed.prompt_throughput > 0 and armed.running == 1 and armed.waiting == 0
    assert not is_decode_steady(armed, 1)


def test_connector_mode_never_declares_a_second_fallback_by_patience() -> None:
    det = FallbackDetector(2, patience=1, connector_mode=True)
    for _ in range(5):
        assert det.observe(tick(10.0, 1, waiting=1)).verdict is Verdict.WAIT
    assert det.finish().verdict is Verdict.FALLBACK
    assert "a tick at the target batch" in det.decision.reason


def test_signature_helper() -> None:
    ticks = [tick(512.0, 1), tick(500.0, 0), tick(0.0, 0, gen=0.0)]
    assert matches_no_prefill_free_signature(ticks, input_len=128, tick_seconds=0.25)
    assert not matches_no_prefill_free_signature(
        [*ticks, tick(0.0, 1)], input_len=128, tick_seconds=0.25
    )
    assert not matches_no_prefill_free_signature([], input_len=128, tick_seconds=0.25)


@pytest.mark.parametrize("bad", [0, -1])
def test_detector_rejects_bad_arguments(bad: int) -> None:
    with pytest.raises(ValueError):
        FallbackDetector(bad)
    with pytest.raises(ValueError):
        FallbackDetector(1, patience=bad)


def test_a_withdrawn_arm_waits_again_and_counts_as_a_prefill_free_tick() -> None:
    d = FallbackDetector(4, patience=2)
    assert d.observe(tick(0.0, 4)).verdict is Verdict.ARM
    d.disarm()
    assert d.decision.verdict is Verdict.WAIT
    assert d.observe(tick(0.0, 4)).verdict is Verdict.ARM  # a fresh steady tick arms again
    d.disarm()
    assert d.observe(tick(300.0, 4)).verdict is Verdict.WAIT
    reason = d.finish().reason
    assert "no tick was prefill-free" not in reason  # the withdrawn ticks were
    d.disarm()  # only an ARM is withdrawn
    assert d.decision.verdict is Verdict.FALLBACK


def test_a_trigger_is_stale_when_newer_evidence_shows_the_batch_draining() -> None:
    steady = StatsTick(0.0, 900.0, 4, 0, line="Running: 4 reqs")
    assert stale_trigger(steady, 4, 4, connector_mode=False) is None
    drained = StatsTick(0.0, 90.0, 0, 0, line="Running: 0 reqs")
    why = stale_trigger(drained, 4, 4, connector_mode=False)
    assert why is not None and "no longer shows steady decode: Running: 0 reqs" in why
    why = stale_trigger(steady, 3, 4, connector_mode=False)  # the client has a response
    assert why is not None and "only 3 of the 4 requests were still unanswered" in why
    next_wave = StatsTick(64.0, 900.0, 4, 0)  # a new request's prefill: not steady either
    assert stale_trigger(next_wave, 4, 4, connector_mode=False) is not None
    assert stale_trigger(next_wave, 4, 4, connector_mode=True) is None


def test_decode_ticks_below_the_target_are_not_the_structural_failure() -> None:
    d = FallbackDetector(4)
    for t in (tick(300.0, 1), tick(0.0, 1), tick(300.0, 2), tick(0.0, 2), tick(0.0, 0)):
        d.observe(t)
    assert d.decision.verdict is Verdict.WAIT and d.ran_below_target() == 2
    structural = FallbackDetector(1)
    for t in (tick(300.0, 1), tick(0.0, 0, gen=50.0), tick(300.0, 1)):
        structural.observe(t)  # the only prefill-free tick is a drain with nothing running
    assert structural.ran_below_target() is None
    connector = FallbackDetector(4, connector_mode=True)
    connector.observe(tick(16.0, 3))  # prompt throughput is not prefill with the connector
    assert connector.ran_below_target() == 3
