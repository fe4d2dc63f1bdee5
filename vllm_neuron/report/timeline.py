"""The timeline picture: one row per process, one bar per compile, fetch and wait, a tick
per hit (and per other moment the cache records), as inline SVG.

Why a picture: an event log says the same, but "rank 3 waited 40 s on the lock while rank 0
compiled" is seen at once in a row of bars and read with effort in JSON lines. Each event
carries ``at``, when it ended, and the events that last carry ``seconds``
(`compile/entry/events.py`), so a bar spans ``[at - seconds, at]``. Times are the writers' wall
clocks: rows of different hosts are only as aligned as their clocks.

Every mark carries ``data-kind`` (the event's record tag: ``compile``, ``fetch``, ``hit``...)
and ``data-key``; a bar also ``data-start``/``data-end``, a tick ``data-at``. Tests count
marks by these, and a reader can select them in the browser's inspector. Overlapping bars
of one process (the parallel fetches of ``cache warm``) go to lanes of their own row.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from vllm_neuron.backends import Record

from .markup import Markup, el, join

__all__ = ["BAR_KINDS", "TIMELINE_CSS", "TimelineRow", "event_kind", "render_timeline"]

# Events drawn as bars over their duration; every other event is a tick at its `at`.
BAR_KINDS = ("compile", "fetch", "lock_wait", "lease_wait")

WIDTH, LABEL_W, PAD_R = 1000, 200, 16
PLOT_W = WIDTH - LABEL_W - PAD_R
AXIS_H, LANE_H, ROW_PAD = 30, 14, 5
MIN_BAR = 2.0  # a compile of a few milliseconds in a timeline of an hour is still seen

# Colours by data-kind (and a hit's tier); the page's legend uses the same classes.
TIMELINE_CSS = """
svg.timeline { width: 100%; height: auto; font: 11px system-ui, sans-serif; }
svg.timeline .row-bg { fill: #f6f7f9; }
svg.timeline .row-bg.odd { fill: #eceef2; }
svg.timeline .grid { stroke: #c9ced6; stroke-width: 1; }
svg.timeline .axis text, svg.timeline .label { fill: #333; }
svg.timeline .bar { stroke: #0003; stroke-width: 0.5; }
.k-compile { fill: #e07b24; background: #e07b24; }
.k-fetch { fill: #2f74c0; background: #2f74c0; }
.k-lock_wait { fill: #9aa0a6; background: #9aa0a6; }
.k-lease_wait { fill: #8a63c2; background: #8a63c2; }
svg.timeline line.tick { stroke-width: 2; }
.k-hit { stroke: #1e9e4a; background: #1e9e4a; }
.k-hit.t-memory { stroke: #8fd3a4; background: #8fd3a4; }
.k-miss { stroke: #e0a100; background: #e0a100; }
.k-compile_failed, .k-verify_failed, .k-load_failed { stroke: #c62828; background: #c62828; }
.k-promote { stroke: #00897b; background: #00897b; }
.k-evict { stroke: #795548; background: #795548; }
.k-lease_takeover { stroke: #d81b60; background: #d81b60; }
.k-remote_unavailable { stroke: #000; background: #000; }
.k-deferred { stroke: #5c6bc0; background: #5c6bc0; }
"""


@dataclass(frozen=True)
class TimelineRow:
    """One process: its label (the event log's writer), a longer title, its events."""

    label: str
    title: str
    events: tuple[Record, ...]


def event_kind(event: Record) -> str:
    """The event's record tag (``compile``, ``hit``...): its ``type`` in the log."""
    return str(type(event).__struct_config__.tag)


def _span(event: Record) -> tuple[float, float]:
    at = float(getattr(event, "at", 0.0))
    if event_kind(event) in BAR_KINDS:
        return at - max(0.0, float(getattr(event, "seconds", 0.0))), at
    return at, at


def _describe(event: Record, kind: str) -> str:
    """The mark's tooltip: the event's fields, as the log has them, and its time in UTC."""
    fields = msgspec.structs.asdict(event)
    at = float(fields.pop("at", 0.0))
    fields.pop("v", None)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}Z"
    details = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in fields.items())  # fmt: skip
    return f"{kind} at {stamp}: {details}"


def _lanes(spans: Sequence[tuple[float, float]]) -> list[int]:
    """A lane per bar so that bars in one lane never overlap (first fit, by start)."""
    ends: list[float] = []
    out = [0] * len(spans)
    for i in sorted(range(len(spans)), key=lambda j: spans[j]):
        start, end = spans[i]
        lane = next((n for n, e in enumerate(ends) if e <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        ends[lane] = end
        out[i] = lane
    return out


def _step(span: float) -> float:
    """A 1-2-5 step giving at most about eight grid lines over `span` seconds."""
    raw = span / 8
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def _seconds(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"+{value:.{decimals}f} s"


def render_timeline(rows: Sequence[TimelineRow]) -> Markup:
    """The SVG of `rows` on one shared time axis (empty rows are drawn, without marks)."""
    spans = [_span(e) for row in rows for e in row.events]
    t0 = min((s for s, _ in spans), default=0.0)
    t1 = max((e for _, e in spans), default=1.0)
    total = max(t1 - t0, 1e-3)
    t0 -= total * 0.02
    total *= 1.04

    def x(t: float) -> float:
        return LABEL_W + (t - t0) / total * PLOT_W

    body: list[Markup] = []
    y = AXIS_H
    for n, row in enumerate(rows):
        bars = [e for e in row.events if event_kind(e) in BAR_KINDS]
        lanes = _lanes([_span(e) for e in bars])
        height = (max(lanes, default=0) + 1) * LANE_H + 2 * ROW_PAD
        body.append(el("rect", class_="row-bg odd" if n % 2 else "row-bg", x=0, y=y,
                       width=WIDTH, height=height))  # fmt: skip
        body.append(el("text", row.label, el("title", row.title), class_="label", x=6,
                       y=f"{y + height / 2 + 4:.1f}"))  # fmt: skip
        for event, lane in zip(bars, lanes, strict=True):
            kind = event_kind(event)
            start, end = _span(event)
            left = x(start)
            body.append(el(
                "rect", el("title", _describe(event, kind)), class_=f"bar k-{kind}",
                data_kind=kind, data_key=getattr(event, "key", ""), data_start=f"{start:.6f}",
                data_end=f"{end:.6f}", data_row=row.label, x=f"{left:.2f}",
                y=y + ROW_PAD + lane * LANE_H + 1, width=f"{max(MIN_BAR, x(end) - left):.2f}",
                height=LANE_H - 2, rx=2,
            ))  # fmt: skip
        for event in row.events:
            kind = event_kind(event)
            if kind in BAR_KINDS:
                continue
            tier = getattr(event, "tier", None) if kind == "hit" else None
            at = x(_span(event)[0])
            body.append(el(
                "line", el("title", _describe(event, kind)),
                class_=f"tick k-{kind}" + (f" t-{tier}" if tier else ""), data_kind=kind,
                data_tier=tier, data_key=getattr(event, "key", ""),
                data_at=f"{_span(event)[0]:.6f}", data_row=row.label, x1=f"{at:.2f}",
                x2=f"{at:.2f}", y1=y + 2, y2=y + height - 2,
            ))  # fmt: skip
        y += height
    axis = _axis(t0, total, x, y)
    return el("svg", axis, join(body), class_="timeline", role="img",
              aria_label=f"timeline of {len(rows)} processes", xmlns="http://www.w3.org/2000/svg",
              viewBox=f"0 0 {WIDTH} {y + 4}", width=WIDTH, height=y + 4)  # fmt: skip


def _axis(t0: float, total: float, x: Callable[[float], float], bottom: float) -> Markup:
    """Grid lines and their labels, in seconds from the first event."""
    first = t0 + total / 1.04 * 0.02  # the first event (before the left margin was added)
    step = _step(total)
    marks: list[Markup] = []
    k = 0
    while first + k * step <= t0 + total:
        t = first + k * step
        at = x(t)
        marks.append(el("line", class_="grid", x1=f"{at:.2f}", x2=f"{at:.2f}", y1=AXIS_H - 6,
                        y2=bottom))  # fmt: skip
        marks.append(el("text", _seconds(k * step, step), x=f"{at:.2f}", y=AXIS_H - 10,
                        text_anchor="middle"))  # fmt: skip
        k += 1
    start = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(first))
    marks.append(el("text", f"from {start}", x=6, y=AXIS_H - 10))
    return el("g", join(marks), class_="axis")
