"""A tier's entries on the page: the totals, then one table row per entry.

Why totals first and a cap: a fleet's remote tier holds thousands of entries; what a reader
wants first is how many, how big, how many have a problem and how many are signed, then
the entries that need looking at. So rows come problems first (`report.tiers` sorts them),
then newest first, and past `ROW_CAP` rows the table ends with a line saying how many more
there are (every one is in the totals, and `cache ls` lists them all). Each row carries the
entry's identity and numbers in ``data-*`` attributes, as every table of the page does.
"""

from __future__ import annotations

import json

from vllm_neuron.compile.entry.text import human_age, human_size

from .markup import Markup, el, join
from .sections import problem_list
from .tiers import EntryRow, TierEntries

__all__ = ["ROW_CAP", "TIER_CSS", "render_entries"]

ROW_CAP = 200  # entry rows shown per tier; the rest are counted

TIER_CSS = """
table.entries td ul { margin: 0; padding-left: 16px; }
table.entries td.problems { overflow-wrap: anywhere; min-width: 240px; }
p.more { font-style: italic; }
"""

_TOTALS = (("entries", "entries"), ("bytes", "size"), ("with_problems", "with a problem"),
           ("signed", "signed"), ("quarantined", "quarantined"))  # fmt: skip
_HEADERS = ("key", "piece", "size", "age", "toolchain", "signer", "problems")


def _totals(entries: TierEntries, location: str) -> Markup:
    totals = entries.totals()
    cells = []
    for name, label in _TOTALS:
        value = totals[name]
        shown = human_size(value) if name == "bytes" else str(value)
        cells.append(el("td", shown, class_="num", data_total=name, data_value=json.dumps(value),
                        title=label))  # fmt: skip
    return el("table", el("tr", *(el("th", label) for _, label in _TOTALS)), el("tr", *cells),
              class_="tier-totals", data_cache=location)  # fmt: skip


def _age(row: EntryRow, now: float) -> str:
    if row.withdrawn is not None:
        return f"withdrawn {human_age(now - row.withdrawn)} ago"
    return "-" if row.created <= 0 else human_age(now - row.created)


def _row(row: EntryRow, now: float) -> Markup:
    problems = (el("ul", join(el("li", p) for p in row.problems)) if row.problems
                else Markup(""))  # fmt: skip
    gone = row.withdrawn is not None  # only its quarantine note is left: no record to read
    return el(
        "tr",
        el("td", row.key, class_="mono"),
        el("td", "; ".join(row.pieces) or "-", class_=None if row.pieces else "muted"),
        el("td", "-" if gone else human_size(row.size), class_="num"),
        el("td", _age(row, now), class_="num"),
        el("td", "-" if gone else row.toolchain, title=None if gone else f"target {row.target}"),
        el("td", "-" if gone else row.signer or "unsigned",
           class_="mono" if row.signer else "muted"),
        el("td", problems, class_="problems"),
        class_="bad" if row.problems else None, data_key=row.key, data_size=row.size,
        data_created=row.created, data_signer=row.signer, data_problems=len(row.problems),
        data_quarantined="true" if gone else None,
    )  # fmt: skip


def render_entries(entries: TierEntries | None, location: str, now: float) -> Markup:
    """The tier's entries: totals, then the table (at most `ROW_CAP` rows, then how many
    more). `now`: the report's time, which ages are counted to."""
    if entries is None:
        return join([])
    if entries.error is not None:
        return problem_list("The entries of this tier cannot be listed", [entries.error])
    head = el("h4", "Entries")
    if not entries.rows:
        return join([head, el("p", "No entries.", class_="muted")])
    shown, more = entries.rows[:ROW_CAP], len(entries.rows) - ROW_CAP
    table = el("table", el("tr", *(el("th", h) for h in _HEADERS)),
               join(_row(r, now) for r in shown), class_="entries",
               data_cache=location)  # fmt: skip
    tail = (el("p", f"{more} more entries not shown (counted in the totals above; "
                    f"vllm-neuron cache ls {location} lists every one)",
               class_="more muted", data_more=more)
            if more > 0 else join([]))  # fmt: skip
    return join([head, _totals(entries, location), table, tail])
