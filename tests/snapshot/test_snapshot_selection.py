"""Selection: each rule alone and combined, budget, ranks, warm-up, and the rule model."""

from __future__ import annotations

import dataclasses
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from snapshot_helpers import ctx, make_config

from vllm_neuron.backends import open_store
from vllm_neuron.snapshot import (
    CaptureBudget,
    CaptureSelector,
    RankInfo,
    SnapshotCapturer,
    SnapshotConfig,
    SnapshotForwardContext,
    forward_context,
    get_current_forward,
    resolve_capture_spec,
    set_current_forward,
)
from vllm_neuron.snapshot.bundles import list_bundles

CapturerFactory = Callable[..., SnapshotCapturer]  # the capturer_for fixture

X = torch.arange(6, dtype=torch.float32).reshape(2, 3)


def executable(x: torch.Tensor) -> torch.Tensor:
    return x * 2


# Rules in isolation ------------------------------------------------------------------------


def test_call_rule_selects_listed_post_warmup_calls(
    memory_root: str, capturer_for: CapturerFactory
) -> None:
    cfg = make_config(memory_root, CAPTURE_AT_CALL="1,3")
    cap = capturer_for(cfg)
    fn = cap.wrap(executable)
    for _ in range(3):
        fn(X)  # warm-up: no published forward, never counted
    for step in range(5):
        with forward_context(SnapshotForwardContext(step=step)):
            fn(X)
    assert cap.calls == 5
    assert [p.rsplit("/", 1)[1] for p in cap.captured] == ["call1", "call3"]


def test_warmup_never_counts_or_captures(memory_root: str, capturer_for: CapturerFactory) -> None:
    cfg = make_config(memory_root, CAPTURE_AT_CALL="-1")
    cap = capturer_for(cfg)
    fn = cap.wrap(executable)
    for _ in range(10):
        assert torch.equal(fn(X), X * 2)
    assert cap.calls == 0 and cap.captured == []
    assert open_store(memory_root).list() == []


def test_token_rule_fires_on_decode_only() -> None:
    sel = CaptureSelector(at_calls=None, tokens=frozenset({12}))
    verdict = sel.evaluate_forward(["a"], [11], is_decode=True)
    assert verdict.selected_by == ("token",)
    (match,) = verdict.matches
    assert (match.row, match.req_id, match.position, match.target, match.offset) == (
        0, "a", 11, 12, 1,
    )  # fmt: skip
    # prefill: a row at position 11 of a prompt does not generate position 12
    assert not sel.evaluate_forward(["a"], [11], is_decode=False)
    assert not sel.evaluate_forward(["a"], [12], is_decode=True)  # generates 13
    assert not sel.evaluate_forward(["a"], [10], is_decode=True)  # generates 11


def test_token_rule_with_speculative_offsets() -> None:
    sel = CaptureSelector(at_calls=None, tokens=frozenset({20}))
    # with 2 speculative tokens a decode row at p generates p+1..p+3
    for pos, offset in ((19, 1), (18, 2), (17, 3)):
        verdict = sel.evaluate_forward(["a"], [pos], True, num_speculative_tokens=2)
        assert [m.offset for m in verdict.matches] == [offset]
    assert not sel.evaluate_forward(["a"], [16], True, num_speculative_tokens=2)
    assert not sel.evaluate_forward(["a"], [18], True, num_speculative_tokens=0)


def test_token_rule_per_row_decode_flags_in_a_mixed_batch() -> None:
    sel = CaptureSelector(at_calls=None, tokens=frozenset({8}))
    verdict = sel.evaluate_forward(["p", "d"], [7, 7], is_decode=[False, True])
    assert [(m.row, m.req_id) for m in verdict.matches] == [(1, "d")]
    ctx_ = SnapshotForwardContext.build(3, ["p", "d"], [7, 7], [False, True], selector=sel)
    assert ctx_.is_prompt and ctx_.verdict == verdict


@pytest.mark.parametrize(
    ("req_id", "expected"),
    [
        ("abc", True),  # exact full id
        ("abc-9a8546d5", True),  # vLLM's <id>-<8 hex>
        ("abc-9a8546d", False),  # 7 hex
        ("abc-9a8546d5a", False),  # 9 hex
        ("abc-XYZ12345", False),  # not hex
        ("abcd-9a8546d5", False),  # another id that merely starts with "abc"
        ("abc-def-9a8546d5", False),  # base id "abc-def", not "abc"
        ("xabc-9a8546d5", False),
    ],
)
def test_request_rule_prefix_vs_exact(req_id: str, expected: bool) -> None:
    sel = CaptureSelector(at_calls=None, requests=("abc",))
    verdict = sel.evaluate_forward([req_id], [0], is_decode=False)
    assert bool(verdict) is expected
    if expected:
        assert verdict.matches[0].request == "abc"


def test_request_rule_exact_full_vllm_id_and_prefill() -> None:
    sel = CaptureSelector(at_calls=None, requests=("chatcmpl-bc110f3d8fc5ae7a-baeef51b",))
    assert sel.evaluate_forward(["chatcmpl-bc110f3d8fc5ae7a-baeef51b"], [0], False)
    base = CaptureSelector(at_calls=None, requests=("chatcmpl-bc110f3d8fc5ae7a",))
    assert base.evaluate_forward(["other", "chatcmpl-bc110f3d8fc5ae7a-baeef51b"], [3, 0], False)


def test_rules_combined_are_ored_and_all_named(
    memory_root: str, capturer_for: CapturerFactory
) -> None:
    cfg = make_config(memory_root, CAPTURE_AT_CALL="0", CAPTURE_TOKEN="11",
                      CAPTURE_REQUEST="want", MAX_CAPTURES="10")  # fmt: skip
    cap = capturer_for(cfg)
    fn = cap.wrap(executable)
    forwards = [
        ctx(0, ["x-00000000"], [5], True, config=cfg),  # call 0 only
        ctx(1, ["x-00000000"], [5], True, config=cfg),  # nothing
        ctx(2, ["x-00000000"], [10], True, config=cfg),  # token
        ctx(3, ["want-0000abcd"], [3], False, config=cfg),  # request
        ctx(4, ["want-0000abcd"], [10], True, config=cfg),  # token + request
    ]
    for c in forwards:
        with forward_context(c):
            fn(X)
    store = open_store(memory_root)
    got = {b.call_index: b.selected_by for b in list_bundles(store).bundles}
    assert got == {0: ("call",), 2: ("token",), 3: ("request",), 4: ("token", "request")}


# Budget, ranks, holder --------------------------------------------------------------------------


def test_budget_exhaustion_stops_capture_and_counts_forwards(
    memory_root: str, capturer_for: CapturerFactory
) -> None:
    cfg = make_config(memory_root, CAPTURE_AT_CALL="-1", MAX_CAPTURES="2")
    budget = CaptureBudget(cfg.max_captures)
    a = capturer_for(cfg, compilation_hash="aaaa0000aaaa0000", budget=budget)
    b = capturer_for(cfg, compilation_hash="bbbb0000bbbb0000", budget=budget)
    fa, fb = a.wrap(executable), b.wrap(executable)
    for step in range(5):
        with forward_context(SnapshotForwardContext(step=step)):
            fa(X)
            fb(X)  # a second piece of the same forward shares the forward's unit
    assert [p.split("/")[-1] for p in a.captured] == ["call0", "call1"]
    assert [p.split("/")[-1] for p in b.captured] == ["call0", "call1"]
    assert budget.consumed == 2 and budget.remaining == 0
    assert a.calls == b.calls == 5  # calls keep being counted after the budget is spent


def test_budget_is_consumed_only_by_a_written_capture() -> None:
    budget = CaptureBudget(1)
    assert budget.reserve(7)
    budget.release(7)  # the write failed
    assert budget.remaining == 1 and budget.consumed == 0
    assert budget.reserve(8)
    assert not budget.reserve(9)  # reserved by step 8 while it is being written
    assert budget.reserve(8)  # another piece of step 8
    budget.commit(8)
    budget.commit(8)
    assert budget.consumed == 1 and not budget.reserve(9)


def test_process_global_budget_comes_from_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_neuron.snapshot import get_capture_budget, reset_snapshot_config

    monkeypatch.setenv("VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_ENABLE", "1")
    monkeypatch.setenv("VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_MAX_CAPTURES", "3")
    reset_snapshot_config()
    assert get_capture_budget() is get_capture_budget()
    assert get_capture_budget().max_captures == 3


def test_ranks_filter(memory_root: str) -> None:
    cfg = make_config(memory_root, RANKS="1,3")
    budget = CaptureBudget(4)
    for tp, wanted in ((0, False), (1, True), (2, False), (3, True)):
        spec = resolve_capture_spec("abcdabcd00", config=cfg, budget=budget,
                                    ranks=RankInfo(global_rank=10 + tp, tp_rank=tp))  # fmt: skip
        assert (spec is not None) is wanted
        if spec is not None:
            assert spec.call_prefix(2) == f"abcdabcd00/rank{10 + tp}/call2"
    every = make_config(memory_root)
    assert resolve_capture_spec("abcdabcd00", config=every, ranks=RankInfo(tp_rank=5),
                                budget=budget) is not None  # fmt: skip


def test_disabled_config_resolves_no_spec() -> None:
    assert resolve_capture_spec("abcd", config=SnapshotConfig(enabled=False)) is None


def test_forward_context_holder() -> None:
    assert get_current_forward() is None
    outer = SnapshotForwardContext(step=1)
    inner = SnapshotForwardContext(step=2)
    with forward_context(outer):
        assert get_current_forward() is outer
        with forward_context(inner):
            assert get_current_forward() is inner
        assert get_current_forward() is outer
    assert get_current_forward() is None
    set_current_forward(outer)
    assert get_current_forward() is outer
    with pytest.raises(RuntimeError), forward_context(inner):
        raise RuntimeError("the model failed")
    assert get_current_forward() is outer  # restored even on error


def test_capturer_evaluates_unevaluated_contexts(
    memory_root: str, capturer_for: CapturerFactory
) -> None:
    cfg = make_config(memory_root, CAPTURE_TOKEN="6")
    cap = capturer_for(cfg)
    fn = cap.wrap(executable)
    with forward_context(SnapshotForwardContext(step=0, req_ids=("r",), positions=(5,),
                                                is_decode=True)):  # fmt: skip
        fn(X)
    assert len(cap.captured) == 1


# The rule model (hypothesis) ----------------------------------------------------------------------

HEX8 = st.text(alphabet="0123456789abcdef", min_size=8, max_size=8)
BASES = ["abc", "abc-def", "zz"]


@st.composite
def req_ids(draw: Any) -> str:
    base = draw(st.sampled_from(BASES))
    kind = draw(st.sampled_from(["exact", "suffix", "other"]))
    if kind == "exact":
        return base
    if kind == "suffix":
        return f"{base}-{draw(HEX8)}"
    return base + draw(st.sampled_from(["x", "-12", "-ABCDEF12", "-0123456789"]))


@st.composite
def forwards(draw: Any) -> list[dict[str, Any]]:
    out = []
    for _ in range(draw(st.integers(1, 12))):
        rows = draw(st.integers(1, 3))
        out.append(
            {
                "req_ids": [draw(req_ids()) for _ in range(rows)],
                "positions": [draw(st.integers(0, 12)) for _ in range(rows)],
                "is_decode": [draw(st.booleans()) for _ in range(rows)],
                "num_spec": draw(st.integers(0, 2)),
                "executables": draw(st.sets(st.sampled_from([0, 1]), min_size=1)),
            }
        )
    return out


@st.composite
def rule_sets(draw: Any) -> tuple[CaptureSelector, int]:
    call_kind = draw(st.sampled_from(["none", "some", "all"]))
    selector = CaptureSelector(
        at_calls=frozenset(draw(st.sets(st.integers(0, 8), max_size=3)))
        if call_kind == "some" else None,
        all_calls=call_kind == "all",
        tokens=frozenset(draw(st.sets(st.integers(1, 15), max_size=3))),
        requests=tuple(draw(st.sets(st.sampled_from(BASES + ["abc-def-00000000"]),
                                    max_size=2))),
    )  # fmt: skip
    return selector, draw(st.integers(1, 5))


def predicted(
    fwds: list[dict[str, Any]], sel: CaptureSelector, budget: int
) -> set[tuple[int, int]]:
    """What the rules say, written independently of the implementation."""
    calls: dict[int, int] = defaultdict(int)
    captured: set[tuple[int, int]] = set()
    used = 0
    for f in fwds:
        token = any(
            dec and any(p + o in sel.tokens for o in range(1, f["num_spec"] + 2))
            for p, dec in zip(f["positions"], f["is_decode"], strict=True)
        )
        request = False
        for rid in f["req_ids"]:
            for want in sel.requests:
                rest = rid[len(want):]
                suffix_ok = (rid.startswith(want) and len(rest) == 9 and rest[0] == "-"
                             and all(c in "0123456789abcdef" for c in rest[1:]))  # fmt: skip
                request = request or rid == want or suffix_ok
        selected = []
        for e in sorted(f["executables"]):
            c = calls[e]
            calls[e] += 1
            by_call = sel.all_calls or (sel.at_calls is not None and c in sel.at_calls)
            if by_call or token or request:
                selected.append((e, c))
        if selected and used < budget:
            used += 1
            captured.update(selected)
    return captured


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fwds=forwards(), rules=rule_sets())
def test_captured_set_equals_the_rule_model(
    fwds: list[dict[str, Any]], rules: tuple[CaptureSelector, int]
) -> None:
    selector, max_captures = rules
    root = f"memory://prop-{uuid.uuid4().hex[:12]}"
    cfg = dataclasses.replace(
        make_config(root), selector=selector, max_captures=max_captures
    )
    budget = CaptureBudget(max_captures)
    caps = {}
    for e in (0, 1):
        spec = resolve_capture_spec(f"{e:x}" * 16, config=cfg, ranks=RankInfo(), budget=budget)
        assert spec is not None
        from vllm_neuron.snapshot import SnapshotCapturer

        caps[e] = SnapshotCapturer(spec)
    fns = {e: caps[e].wrap(executable) for e in caps}
    for _ in range(2):
        fns[0](X)  # warm-up calls: never counted
    for step, f in enumerate(fwds):
        c = SnapshotForwardContext.build(step, f["req_ids"], f["positions"], f["is_decode"],
                                         f["num_spec"], selector=selector)  # fmt: skip
        with forward_context(c):
            for e in sorted(f["executables"]):
                fns[e](X)
    got = {(e, int(p.rsplit("call", 1)[1])) for e, cap in caps.items() for p in cap.captured}
    assert got == predicted(fwds, selector, max_captures)
    on_store = {
        (int(b.compilation_hash[0], 16), b.call_index)
        for b in list_bundles(open_store(root)).bundles
    }
    assert on_store == got
