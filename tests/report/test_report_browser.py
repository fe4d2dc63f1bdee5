"""The report opened in a real headless browser (issue 15): no console errors, one timeline
bar per compile and per fetch, a screenshot that is not blank, and the page's numbers equal
`vllm-neuron cache stats --json`'s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from report_browser import Loaded, decode_png, descendants, load, parse, screenshot, select
from report_deployment import Deployment


@pytest.fixture(scope="module")
def loaded(report_page: Path, tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    return load(report_page, tmp_path_factory.mktemp("browser"))


def cache_stats_json(cache: Path) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "cache", "--cache-dir",
                           str(cache), "stats", "--json"], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_no_console_message(loaded: Loaded) -> None:
    # The page has no script, so the browser logs nothing unless something is wrong: a load
    # the Content-Security-Policy refused, markup that escaped from the data.
    assert loaded.console == []


def test_the_harness_sees_console_errors(tmp_path: Path) -> None:
    """The check above is worth something: a page that loads from the network, or runs a
    script, under the report's policy, shows up in the console lines."""
    from vllm_neuron.report.page import CSP

    bad = tmp_path / "bad.html"
    bad.write_text(f'<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" '
                   f'content="{CSP}"></head><body><img src="http://x.invalid/a.png">'
                   '<script>console.error("x")</script></body></html>')  # fmt: skip
    console = load(bad, tmp_path).console
    assert any("x.invalid" in line for line in console), console
    assert any("inline script" in line or "script" in line for line in console), console


def test_one_bar_per_compile_and_per_fetch(loaded: Loaded, deployment: Deployment) -> None:
    dom = parse(loaded.dom)
    stats = [cache_stats_json(deployment.cache_a), cache_stats_json(deployment.cache_b)]
    compiles = select(dom, "rect", data_kind="compile")
    fetches = select(dom, "rect", data_kind="fetch")
    assert len(compiles) == sum(int(s["compiles"]) for s in stats) == 2  # type: ignore[call-overload]
    assert len(fetches) == sum(int(s["fetches"]) for s in stats) == 2  # type: ignore[call-overload]
    # hits as ticks: every hit event (fetches are the remote tier's hits, drawn as bars)
    hits = select(dom, "line", data_kind="hit")
    assert len(hits) == sum(int(s["hits"]) - int(s["fetches"]) for s in stats)  # type: ignore[call-overload]
    # the rank that waited for the other's compile: its lock wait is a bar of its own row
    waits = select(dom, "rect", data_kind="lock_wait")
    assert len(waits) == 1 and waits[0].attrs["data-row"] != compiles[0].attrs["data-row"]
    # one row per process (event-log segment) of both tiers
    segments = [p for c in (deployment.cache_a, deployment.cache_b)
                for p in (c / ".events").iterdir()]  # fmt: skip
    assert len(select(dom, "text", class_="label")) == len(segments) == 6
    for bar in compiles + fetches:
        assert float(bar.attrs["data-start"]) < float(bar.attrs["data-end"])
        assert float(bar.attrs["width"]) >= 2


def test_the_numbers_are_cache_stats_json(loaded: Loaded, deployment: Deployment) -> None:
    dom = parse(loaded.dom)
    for cache in (deployment.cache_a, deployment.cache_b):
        expected = cache_stats_json(cache)
        flat = {f"{k}.{t}" if isinstance(v, dict) else k: n
                for k, v in expected.items()
                for t, n in (v.items() if isinstance(v, dict) else [(None, v)])}  # fmt: skip
        (block,) = select(dom, "div", class_="cache-stats", data_cache=str(cache))
        cells = {e.attrs["data-stat"]: e for e in descendants(block) if "data-stat" in e.attrs}
        assert set(cells) == set(flat)
        for name, value in flat.items():
            cell = cells[name]
            assert json.loads(cell.attrs["data-value"]) == value, name
            shown = f"{value:.3f}" if isinstance(value, float) else str(value)
            assert cell.text.strip() == shown, name


def test_the_screenshot_is_not_blank(report_page: Path, tmp_path: Path) -> None:
    pixels = decode_png(screenshot(report_page, tmp_path).read_bytes())[:, :, :3]
    flat = pixels.reshape(-1, 3)
    colours, counts = np.unique(flat, axis=0, return_counts=True)
    assert len(colours) > 50  # text, bars, badges: not one or two flat colours
    background = counts.max() / len(flat)
    assert background < 0.95  # more than a few pixels differ from the page's background
    # the header band is drawn (its colour, #1f3b57, across the top)
    assert (pixels[10, 10:-10] == [0x1F, 0x3B, 0x57]).all()
