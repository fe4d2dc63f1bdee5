"""The timeline SVG from events alone: where bars and ticks go, lanes for overlapping bars."""

from __future__ import annotations

from report_browser import parse, select

from vllm_neuron.compile.entry.events import CacheHit, Compiled, Fetched, LockWaited, Promoted
from vllm_neuron.report.timeline import LABEL_W, PLOT_W, TimelineRow, render_timeline

KEY = "ab" * 16


def test_bars_span_their_duration_and_ticks_sit_at_their_moment() -> None:
    rows = [
        TimelineRow("host-1", "host-1 in /c", (
            LockWaited(key=KEY, at=110.0, seconds=10.0),
            Compiled(key=KEY, at=130.0, seconds=20.0, toolchain="host", size=1),
            Promoted(key=KEY, at=131.0, remote="/r", published=True),
        )),
        TimelineRow("host-2", "host-2 in /c", (CacheHit(key=KEY, at=200.0, tier="local"),)),
        TimelineRow("idle", "a process with no events", ()),
    ]  # fmt: skip
    dom = parse(render_timeline(rows))
    (compile_,) = select(dom, "rect", data_kind="compile")
    assert (float(compile_.attrs["data-start"]), float(compile_.attrs["data-end"])) == (110, 130)
    (wait,) = select(dom, "rect", data_kind="lock_wait")
    assert float(wait.attrs["x"]) + float(wait.attrs["width"]) <= float(compile_.attrs["x"]) + 1e-6
    (hit,) = select(dom, "line", data_kind="hit", data_tier="local")
    assert hit.attrs["data-row"] == "host-2" and float(hit.attrs["data-at"]) == 200.0
    assert float(wait.attrs["x"]) >= LABEL_W and float(hit.attrs["x1"]) <= LABEL_W + PLOT_W
    labels = [t.text for t in select(dom, "text", class_="label")]  # the label, then its title
    assert labels == ["host-1host-1 in /c", "host-2host-2 in /c", "idlea process with no events"]
    axis = [t.text for t in dom if t.tag == "text" and t.text.startswith("+")]
    assert axis[0] == "+0 s" and all(not x.startswith("+-") for x in axis)
    assert "compile at 1970-01-01 00:02:10.000Z" in compile_.text  # the tooltip


def test_overlapping_bars_of_one_process_get_lanes_and_short_ones_stay_visible() -> None:
    fetches = tuple(Fetched(key=f"{i:032x}", at=10.0 + i, seconds=5.0, size=1, remote="/r")
                    for i in range(3))  # fmt: skip
    blip = Compiled(key=KEY, at=1000.0, seconds=0.0001, toolchain="host", size=1)
    dom = parse(render_timeline([TimelineRow("warm", "cache warm", (*fetches, blip))]))
    bars = select(dom, "rect", data_kind="fetch")
    assert len({b.attrs["y"] for b in bars}) == 3  # each overlaps the others: three lanes
    (short,) = select(dom, "rect", data_kind="compile")
    assert float(short.attrs["width"]) >= 2


def test_no_rows_is_still_a_picture() -> None:
    dom = parse(render_timeline([]))
    assert select(dom, "svg") and not select(dom, "rect", data_kind="compile")
