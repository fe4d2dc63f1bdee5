"""The report page: one HTML document with its CSS and SVG inline, nothing fetched.

Why self-contained: a report is mailed, attached to a ticket, opened on a laptop far from
the cluster, years later; a page that loads a script or a font from a CDN breaks offline
and leaks that someone looked. So the page has no script at all, its style is inline, its
pictures are inline SVG, and a Content-Security-Policy forbids every load (a stray
external reference would be refused, and says so in the browser's console).

Numbers are written twice where a program may want them: as text for people, and exact in
``data-*`` attributes (``data-stat``/``data-value`` for `cache stats --json`'s fields,
``data-kind`` on every timeline mark), so a test or a script can read the page back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_neuron.compile.entry.text import human_size
from vllm_neuron.version import __version__

from .gather import CacheView, ProcessRow, Report
from .markup import Markup, el, join
from .sections import problem_list, render_engines, render_profiles, render_snapshots
from .tier_table import TIER_CSS, render_entries
from .timeline import BAR_KINDS, TIMELINE_CSS, TimelineRow, event_kind, render_timeline

__all__ = ["render_page"]

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

PAGE_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d2228;
       margin: 0; background: #fff; }
main { max-width: 1180px; margin: 0 auto; padding: 16px 24px 48px; }
header { background: #1f3b57; color: #fff; padding: 18px 24px; }
header h1 { margin: 0 0 4px; font-size: 22px; }
header p { margin: 0; opacity: 0.85; }
h2 { border-bottom: 2px solid #1f3b57; padding-bottom: 4px; margin-top: 36px; }
h3 { margin: 22px 0 6px; font-size: 15px; word-break: break-all; }
table { border-collapse: collapse; margin: 8px 0 12px; font-size: 13px; }
th, td { border: 1px solid #d5d9df; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #eef1f5; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
code, .mono { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; font-size: 12px; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; margin: 16px 0; }
.card { border: 1px solid #d5d9df; border-radius: 6px; padding: 8px 14px; min-width: 110px; }
.card b { display: block; font-size: 22px; }
.badge { display: inline-block; border-radius: 10px; padding: 0 8px; font-size: 12px;
         font-weight: 600; color: #fff; background: #5f6b7a; }
.badge.ok { background: #1e9e4a; } .badge.bad { background: #c62828; }
.badge.warn { background: #e0a100; }
tr.bad td { background: #fdecea; }
.problems { border-left: 4px solid #c62828; background: #fdecea; padding: 6px 12px; }
.problems ul { margin: 4px 0; padding-left: 18px; }
.muted { color: #68717d; }
.legend span.sw { display: inline-block; width: 12px; height: 12px; border-radius: 2px;
                  margin: 0 4px 0 12px; vertical-align: -1px; }
.legend span.tk { display: inline-block; width: 3px; height: 12px; margin: 0 4px 0 12px;
                  vertical-align: -1px; }
.cache-stats { display: flex; gap: 32px; align-items: flex-start; }
details { margin: 4px 0 10px; } summary { cursor: pointer; }
"""

_TICK_LEGEND = (("hit", "local", "hit (local)"), ("hit", "memory", "hit (memory)"),
                ("miss", None, "miss"), ("compile_failed", None, "compile failed"),
                ("promote", None, "promotion"), ("evict", None, "eviction"),
                ("lease_takeover", None, "lease takeover"),
                ("remote_unavailable", None, "remote down"),
                ("deferred", None, "deferred to its first call"))  # fmt: skip


def _value_text(value: Any) -> str:
    """How a statistic reads on the page: integers as they are, seconds to the millisecond."""
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _stat_cell(name: str, value: Any) -> Markup:
    return el("td", _value_text(value), class_="num", data_stat=name,
              data_value=json.dumps(value))  # fmt: skip


def stats_table(stats: Mapping[str, Any], cache: str) -> Markup:
    """`cache stats --json`'s document as two tables: hits by tier, then every other field
    (each value in ``data-stat``/``data-value``, the field's own name and exact value)."""
    tiers = stats.get("hits_by_tier") or {}
    tier_rows = [el("tr", el("th", tier), _stat_cell(f"hits_by_tier.{tier}", n))
                 for tier, n in sorted(tiers.items())]  # fmt: skip
    if not tier_rows:
        tier_rows = [el("tr", el("td", "no hits", colspan=2, class_="muted"))]
    by_tier = el("table", el("tr", el("th", "tier"), el("th", "hits")), join(tier_rows),
                 class_="by-tier")  # fmt: skip
    rows = []
    for name, value in stats.items():
        if isinstance(value, dict):
            continue
        extra = human_size(value) if name.endswith("_bytes") and isinstance(value, int) else ""
        rows.append(el("tr", el("th", name.replace("_", " ")), _stat_cell(name, value),
                       el("td", extra, class_="muted")))  # fmt: skip
    everything = el("table", el("tr", el("th", "field"), el("th", "value"), el("th", "")),
                    join(rows), class_="stats")  # fmt: skip
    return el("div", el("div", el("h4", "Hits by tier"), by_tier),
              el("div", el("h4", "All statistics"), everything),
              class_="cache-stats", data_cache=cache)  # fmt: skip


def _legend() -> Markup:
    items: list[Markup] = [Markup("<b>Bars</b>")]
    for kind in BAR_KINDS:
        items += [el("span", class_=f"sw k-{kind}"), Markup(kind.replace("_", " "))]
    items.append(Markup(" &nbsp; <b>Ticks</b>"))
    for kind, tier, label in _TICK_LEGEND:
        items += [el("span", class_=f"tk k-{kind}" + (f" t-{tier}" if tier else "")),
                  Markup(label)]  # fmt: skip
    return el("p", join(items), class_="legend")


def _rows(caches: Sequence[CacheView]) -> list[tuple[int, ProcessRow]]:
    """Every process of every tier, in the order they started (their first event)."""
    rows = [(n, row) for n, cache in enumerate(caches, 1) for row in cache.rows]
    rows.sort(key=lambda r: (min((float(getattr(e, "at", 0.0)) for e in r[1].events),
                                 default=0.0), r[0], r[1].writer))  # fmt: skip
    return rows


def _process_table(rows: Sequence[tuple[int, ProcessRow]]) -> Markup:
    """Per process: what it did, in numbers (the timeline's rows, summed)."""
    out = []
    for n, row in rows:
        kinds = [event_kind(e) for e in row.events]
        waited = sum(float(getattr(e, "seconds", 0.0)) for e in row.events
                     if event_kind(e) in ("lock_wait", "lease_wait"))  # fmt: skip
        ats = [float(getattr(e, "at", 0.0)) for e in row.events]
        last = time.strftime("%H:%M:%S", time.gmtime(max(ats))) if ats else "-"
        out.append(el("tr", el("td", f"[{n}]"), el("td", row.writer, class_="mono"),
                      *(el("td", kinds.count(k), class_="num")
                        for k in ("compile", "fetch", "hit", "miss")),
                      el("td", f"{waited:.3f}", class_="num"), el("td", last),
                      el("td", row.skipped or "", class_="num"),
                      data_writer=row.writer))  # fmt: skip
    head = el("tr", *(el("th", h) for h in ("tier", "process", "compiles", "fetches", "hits",
                                            "misses", "waited (s)", "last event (UTC)",
                                            "torn lines")))  # fmt: skip
    return el("table", head, join(out), class_="processes")


def _trust_table(trust: Mapping[str, int] | None) -> Markup:
    """Entries by trust verdict (or by signer): who built what this tier holds."""
    if not trust:
        return join([])
    rows = [el("tr", el("td", label), el("td", str(n), data_value=str(n)), data_trust=label)
            for label, n in sorted(trust.items())]  # fmt: skip
    return el("table", el("tr", el("th", "entries by signature"), el("th", "entries")),
              join(rows), class_="trust")  # fmt: skip


_REMOTE_NOTE = ("A remote tier: it keeps no event log (the nodes' processes log into their "
                "local tiers), so what was done with it is in their timelines and statistics.")


def _tier(n: int, cache: CacheView, now: float) -> Markup:
    """One tier: its statistics (a local tier), who signed its entries, its notes, its
    entries. Labelled local or remote, as `report.roots` read it."""
    role = "remote" if cache.remote else "local"
    usage = (el("p", _REMOTE_NOTE, class_="muted") if cache.remote
             else stats_table(cache.stats, cache.location))  # fmt: skip
    notes = (problem_list("Keys that did not load on a host, with no entry listed here "
                          "(notes on this tier; a listed entry shows its own below)",
                          cache.load_failures)
             if cache.load_failures else join([]))  # fmt: skip
    return el("section", el("h3", f"[{n}] {role.capitalize()} tier {cache.location}"), usage,
              _trust_table(cache.trust), notes, render_entries(cache.entries, cache.location, now),
              class_="cache", data_cache=cache.location, data_tier=role,
              id=f"cache-{n}")  # fmt: skip


def render_caches(caches: Sequence[CacheView], now: float) -> Markup:
    """One timeline for every process of every local tier read (one shared clock), then
    each tier: local ones first. A tier is named by its number, ``[n]``, in rows and
    headings. `now`: the report's time, which entries' ages are counted to."""
    rows = _rows(caches)
    timeline = [TimelineRow(f"[{n}] {r.writer}" if len(caches) > 1 else r.writer,
                            f"{r.writer} in {r.cache}", r.events) for n, r in rows]  # fmt: skip
    quiet = ("No process has written events to these tiers yet."
             if any(not c.remote for c in caches) else
             "No local tier was read: a remote tier keeps no event log.")  # fmt: skip
    picture = (
        join([_legend(), render_timeline(timeline), _process_table(rows)])
        if rows else el("p", quiet, class_="muted")
    )
    tiers = [_tier(n, c, now) for n, c in enumerate(caches, 1)]
    return join([el("h3", f"Timeline: {len(rows)} processes"), picture, join(tiers)])


def _cards(report: Report) -> Markup:
    def total(name: str) -> int:
        return sum(int(c.stats.get(name, 0)) for c in report.caches)

    graphs = sum(len(e.manifest.graphs) for e in report.engines if e.manifest is not None)
    bundles = sum(len(s.listing.bundles) for s in report.snapshots if s.listing is not None)
    processes = sum(len(c.rows) for c in report.caches)
    entries = {r.key for c in report.caches if c.entries for r in c.entries.live}
    cards = [("processes", processes), ("compiles", total("compiles")),
             ("fetches", total("fetches")), ("hits", total("hits")), ("misses", total("misses")),
             ("tiers", len(report.caches)), ("cache entries", len(entries)),
             ("engines", len(report.engines)), ("graphs", graphs), ("snapshot bundles", bundles),
             ("profile runs", len(report.profiles))]  # fmt: skip
    return el("div", join(el("div", el("b", n), label, class_="card", data_card=label)
                          for label, n in cards), class_="cards")  # fmt: skip


def _sources(report: Report) -> Markup:
    rows = [el("tr", el("td", arg, class_="mono"), el("td", kind), el("td", loc, class_="mono"))
            for arg, kind, loc in report.sources.origins]  # fmt: skip
    head = el("tr", el("th", "argument"), el("th", "read as"), el("th", "location"))
    return el("table", head, join(rows), class_="sources")


def _section(title: str, anchor: str, body: Markup, empty: str, present: bool) -> Markup:
    return el("section", el("h2", title), body if present else el("p", empty, class_="muted"),
              id=anchor)  # fmt: skip


def render_page(report: Report) -> str:
    """The whole page, as text (UTF-8 when written)."""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(report.generated))
    caches = render_caches(report.caches, report.generated)
    body = join([
        el("header", el("h1", "vLLM Neuron deployment report"),
           el("p", f"generated {when} by vllm-neuron {__version__}")),
        Markup("<main>"), _cards(report), _sources(report),
        _section("Compile cache", "cache", caches, "No compile-cache tier was read.",
                 bool(report.caches)),
        _section("Manifests", "manifests", render_engines(report.engines, report.snapshots),
                 "No engine manifest was found.", bool(report.engines)),
        _section("Snapshot bundles", "snapshots", render_snapshots(report.snapshots),
                 "No snapshot root was read.", bool(report.snapshots)),
        _section("Profile runs", "profiles", render_profiles(report.profiles),
                 "No profile run was found.", bool(report.profiles)),
        Markup("</main>"),
    ])  # fmt: skip
    head = join([
        Markup('<meta charset="utf-8">'),
        el("meta", http_equiv="Content-Security-Policy", content=CSP),
        Markup('<meta name="viewport" content="width=device-width, initial-scale=1">'),
        el("title", f"vLLM Neuron report {when}"),
        el("style", Markup(PAGE_CSS + TIMELINE_CSS + TIER_CSS)),
    ])  # fmt: skip
    return f"<!DOCTYPE html>\n<html lang=\"en\"><head>{head}</head><body>{body}</body></html>\n"
