"""Read the per-step annotations of a vLLM torch-profiler trace, and judge phase isolation.

While the profiler runs, vLLM's worker wraps every ``execute_model`` call in a
``record_function`` whose name counts the step's context (prefill) and generation (decode)
requests and tokens (vLLM 0.32, ``Worker.annotate_profile`` in
``vllm/v1/worker/gpu_worker.py``, inherited by the CPU worker)::

    execute_context_1(15)_generation_0(0)              # the default annotation
    execute_19_context_1(sq15sk15sqsq225sqsk225)_generation_4(sq4sk...)   # detailed

A request counts as *context* while it has produced no output token (a new request, or a
chunk of a chunked prefill); the numbers in parentheses are the scheduled tokens. A step
with nothing scheduled (``context_0(0)_generation_0(0)``, which the engine runs to retire
finished requests) does no model work and is neutral.

The events are ``"cat": "user_annotation"`` complete events in the Chrome-trace JSON
(``<worker_name>.<id>.pt.trace.json.gz``).
"""

from __future__ import annotations

import gzip
import re
from dataclasses import dataclass

import msgspec

from .files import file_store

STEP_PATTERN = re.compile(
    r"^execute_(?:(?P<total>\d+)_)?"
    r"context_(?P<ctx_reqs>\d+)\((?:sq)?(?P<ctx_tokens>\d+)[^)]*\)_"
    r"generation_(?P<gen_reqs>\d+)\((?:sq)?(?P<gen_tokens>\d+)[^)]*\)$"
)


@dataclass(frozen=True)
class Step:
    """One ``execute_model`` call as annotated in the trace."""

    name: str
    context_requests: int
    context_tokens: int
    generation_requests: int
    generation_tokens: int
    ts: float = 0.0
    dur: float = 0.0

    @property
    def empty(self) -> bool:
        return self.context_requests == 0 and self.generation_requests == 0

    @property
    def requests(self) -> int:
        return self.context_requests + self.generation_requests

    @property
    def single_token_rows(self) -> bool:
        """Every scheduled request has a query of exactly one token (decode-shaped)."""
        return (
            self.context_tokens == self.context_requests
            and self.generation_tokens == self.generation_requests
        )


def parse_step_name(name: str) -> Step | None:
    m = STEP_PATTERN.match(name)
    if m is None:
        return None
    return Step(
        name=name,
        context_requests=int(m["ctx_reqs"]),
        context_tokens=int(m["ctx_tokens"]),
        generation_requests=int(m["gen_reqs"]),
        generation_tokens=int(m["gen_tokens"]),
    )


class _Event(msgspec.Struct):
    name: str = ""
    cat: str = ""
    ph: str = ""
    ts: float = 0.0
    dur: float = 0.0


class _Trace(msgspec.Struct):
    traceEvents: list[_Event] = msgspec.field(default_factory=list)  # noqa: N815 - JSON key
    vllm_version: str | None = None
    distributedInfo: dict[str, object] | None = None  # noqa: N815 - JSON key


@dataclass(frozen=True)
class TraceSummary:
    path: str
    steps: list[Step]
    vllm_version: str | None = None
    rank: int | None = None


class TraceError(ValueError):
    """The trace file cannot be read as a Chrome-trace JSON document."""


def read_trace(path: str) -> TraceSummary:
    """The annotated steps (in time order) and metadata of one torch-profiler trace."""
    try:
        store, key = file_store(path)
        with store.open_read(key) as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        trace = msgspec.json.decode(raw, type=_Trace)
    except (OSError, EOFError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TraceError(f"{path}: not a readable trace: {exc}") from None
    steps = []
    for ev in trace.traceEvents:
        if not ev.name.startswith("execute_"):
            continue
        step = parse_step_name(ev.name)
        if step is not None:
            steps.append(
                Step(step.name, step.context_requests, step.context_tokens,
                     step.generation_requests, step.generation_tokens, ev.ts, ev.dur)
            )
    steps.sort(key=lambda s: s.ts)
    rank = None
    if trace.distributedInfo is not None:
        value = trace.distributedInfo.get("rank")
        rank = value if isinstance(value, int) else None
    return TraceSummary(path, steps, trace.vllm_version, rank)


def check_prefill_steps(steps: list[Step], *, max_requests: int = 1) -> list[str]:
    """Reasons the steps are not a prefill-only capture (empty list: they are)."""
    work = [s for s in steps if not s.empty]
    if not work:
        return ["no model step was recorded (no execute_model annotation with work)"]
    problems = []
    for s in work:
        if s.generation_requests:
            problems.append(
                f"step {s.name} contains generation work ({s.generation_requests} decode "
                "requests): the prefill capture is not isolated"
            )
        elif s.context_requests > max_requests:
            problems.append(
                f"step {s.name} has {s.context_requests} context requests; the prefill "
                f"recipe sends {max_requests}"
            )
    return problems


def check_decode_steps(
    steps: list[Step],
    *,
    target_batch: int,
    decode_only_connector: bool = False,
    min_steps: int = 1,
) -> list[str]:
    """Reasons the steps are not steady-state decode at `target_batch` (empty: they are).

    With the decode-only connector, a newly admitted request's first step computes only its
    last prompt token against KV the connector filled: vLLM still calls it "context", but
    it is a one-token, decode-shaped row, so such rows are accepted in that mode.

    `min_steps` is the window's length (the profiler's ``max_iterations``): a decode window
    holding fewer model steps opened on the last steps of the decode leg, so it missed the
    steady state it was meant to record (and one step leaves collective analysis empty).
    """
    work = [s for s in steps if not s.empty]
    if not work:
        return ["no model step was recorded (no execute_model annotation with work)"]
    problems = []
    if len(work) < min_steps:
        problems.append(
            f"only {len(work)} model step(s) recorded in a window of {min_steps} "
            "(max_iterations): the window opened as the decode leg ended"
        )
    for s in work:
        if decode_only_connector:
            if not s.single_token_rows:
                problems.append(
                    f"step {s.name} schedules more than one token for a request: prefill "
                    "work in a decode-only (connector) capture"
                )
                continue
        elif s.context_requests:
            problems.append(
                f"step {s.name} contains context (prefill) work: the decode capture is not "
                "isolated"
            )
            continue
        if s.requests != target_batch:
            problems.append(
                f"step {s.name} decodes {s.requests} requests, not the target batch "
                f"{target_batch}"
            )
    return problems
