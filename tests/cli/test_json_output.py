"""Every reporting command's ``--json``: one document on stdout that says what the human
output says, with the same exit status.

Table-driven: each row is a command (on a fresh world of real tiers, since some change
it), and a check that the JSON and the human output agree on the facts that matter.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_world import KEY_A, KEY_B, build_world, run

from vllm_neuron.backends.faults import POINTS

Check = Callable[[Any, str], None]


def keys_in(text: str) -> set[str]:
    """The entry keys a table names (the environment's line, whose version digests look like
    keys - the compiler's identity - is not a row)."""
    rows = [line for line in text.splitlines() if not line.startswith("this environment:")]
    return set(re.findall(r"\b[0-9a-f]{32}\b", "\n".join(rows)))


def ls_check(doc: Any, human: str) -> None:
    assert {e["key"] for e in doc} == keys_in(human) == {KEY_A, KEY_B}
    assert all(e["problem"] is None and e["age_seconds"] >= 0 for e in doc)
    assert f"{len(doc)} entries" in human


def verify_check(doc: Any, human: str) -> None:
    assert {r["key"]: r["ok"] for r in doc} == {KEY_A: True, KEY_B: True}
    assert human.count("ok ") == 2 and "2 entries checked, 0 corrupt" in human


def promote_check(doc: Any, human: str) -> None:
    outcomes = {e["key"]: e["outcome"] for e in doc["entries"]}
    assert outcomes == {KEY_A: "present", KEY_B: "promoted"} and doc["promoted"] == 1
    assert f"{KEY_A}: already in the remote tier" in human and f"{KEY_B}: promoted" in human
    assert "1 of 2 entries promoted" in human


def prune_check(doc: Any, human: str) -> None:
    deleted = [e["key"] for e in doc["delete"]]
    assert deleted == [KEY_A] and doc["dry_run"] is True
    assert f"would delete {KEY_A}" in human and KEY_B not in human
    assert f"dry run: {len(deleted)} entries" in human


def explain_check(doc: Any, human: str) -> None:
    names = [c["name"] for c in doc["components"]]
    assert names == ["graph", "inputs", "target"] and not doc["identical"]
    assert doc["components"][2]["values"]["target"] == {"a": "cpu", "b": "trn2"}
    lines = human.splitlines()
    for name in names:
        assert any(line.startswith(name) for line in lines)
    assert any("target" in line and "cpu" in line and "trn2" in line for line in lines)


def gc_check(doc: Any, human: str) -> None:
    assert doc["dry_run"] is True and doc["plan"] == []
    assert "dry run: 0 items" in human


def stats_check(doc: Any, human: str) -> None:
    assert doc["compiles"] == 2
    assert re.search(r"compiles\s+2 ", human)
    # The world's compiles name no piece: no per-rank variants, and the row still says so.
    assert (doc["rank_specific_compiles"], doc["pieces_compiled"], doc["keys_by_piece"]) == (
        0, 0, {})
    assert re.search(r"per-rank variants\s+0 extra compile\(s\) over 0 piece\(s\)", human)


def pin_list_check(doc: Any, human: str) -> None:
    assert [p["key"] for p in doc["pins"]] == [] and "0 pinned entries" in human


def pin_check(doc: Any, human: str) -> None:
    assert doc["pinned"] == [{"key": KEY_A, "new": True, "in_tier": True}]
    assert f"pinned {KEY_A}" in human


def unpin_check(doc: Any, human: str) -> None:
    assert doc["removed"] == [] and doc["not_pinned"] == [KEY_B]
    assert "0 of 1 pins removed" in human


def warm_check(doc: Any, human: str) -> None:
    assert doc["fetched"] == [KEY_A] and doc["missing"] == [KEY_B]
    assert f"MISSING   {KEY_B}" in human and "1 fetched" in human and "1 missing" in human


def manifest_check_check(doc: Any, human: str) -> None:
    """The manifest names no artifact per graph: a problem each, in both outputs."""
    assert doc["ok"] is False and doc["graphs"] == 2 and len(doc["problems"]) == 2
    assert [f"FAIL {p}" for p in doc["problems"]] == human.splitlines()[:2]
    assert "2 problem(s)" in human


def manifest_check_remote(doc: Any, human: str) -> None:
    assert doc["ok"] is True and doc["sources"] == {KEY_A: "local", KEY_B: "local"}
    assert "would start without compiling (2 graphs local" in human


def manifest_show_check(doc: Any, human: str) -> None:
    assert [g["graph_hash"][:12] for g in doc["graphs"]] == [KEY_A[:12], KEY_B[:12]]
    assert KEY_A[:12] in human and "2 graphs" in human


def manifest_diff_check(doc: Any, human: str) -> None:
    assert doc["added"] == [] and doc["removed"] == [] and "identical" in human


def compat_check(doc: Any, human: str) -> None:
    """The world's records carry no compiler_args component: neither entry is judged."""
    assert {e["key"]: e["compatible"] for e in doc["entries"]} == {KEY_A: None, KEY_B: None}
    assert keys_in(human) == {KEY_A, KEY_B}
    assert doc["environment"]["toolchain"] in human.splitlines()[0]
    assert "2 entries: 2 usable here, 0 never hit here" in human


def validate_check(doc: Any, human: str) -> None:
    assert doc["ok"] is False
    assert [f"FAIL {f}" for f in doc["failures"]] == [
        line for line in human.splitlines() if line.startswith("FAIL")]
    assert f"{len(doc['failures'])} failure(s)" in human


def faults_check(doc: Any, human: str) -> None:
    assert [p["name"] for p in doc] == list(POINTS)
    assert all(name in human for name in POINTS)


def snapshot_ls_check(doc: Any, human: str) -> None:
    assert doc["bundles"] == [] and "0 bundles" in human


def profile_list_check(doc: Any, human: str) -> None:
    assert doc == [] and human.splitlines()[0].split() == ["RUN", "RECIPE", "STATUS", "VALID",
                                                            "STARTED"]


# argv (``{local}``, ``{remote}``, ``{manifest}``, ``{root}`` filled), exit status, check.
CASES: list[tuple[str, list[str], int, Check]] = [
    ("cache ls", ["cache", "--cache-dir", "{local}", "ls"], 0, ls_check),
    ("cache verify", ["cache", "--cache-dir", "{local}", "verify", "--keep"], 0, verify_check),
    ("cache promote", ["cache", "--cache-dir", "{local}", "promote", "--to", "{remote}",
                       "--all"], 0, promote_check),
    ("cache prune", ["cache", "--cache-dir", "{local}", "prune", "--max-size", "20K",
                     "--dry-run"], 0, prune_check),
    ("cache explain", ["cache", "--cache-dir", "{local}", "explain", KEY_A, KEY_B], 0,
     explain_check),
    ("cache gc", ["cache", "--cache-dir", "{local}", "gc", "--dry-run"], 0, gc_check),
    ("cache stats", ["cache", "--cache-dir", "{local}", "stats"], 0, stats_check),
    ("cache pin (list)", ["cache", "--cache-dir", "{local}", "pin"], 0, pin_list_check),
    ("cache pin", ["cache", "--cache-dir", "{local}", "pin", KEY_A], 0, pin_check),
    ("cache unpin", ["cache", "--cache-dir", "{local}", "unpin", KEY_B], 0, unpin_check),
    ("cache compat", ["cache", "--cache-dir", "{local}", "compat"], 0, compat_check),
    ("cache warm", ["cache", "--cache-dir", "{root}/node", "warm", "{manifest}", "--remote",
                    "{remote}"], 1, warm_check),
    ("manifest check", ["manifest", "check", "{manifest}", "--cache-dir", "{local}"], 1,
     manifest_check_check),
    ("manifest check --remote", ["manifest", "check", "{manifest}", "--cache-dir", "{local}",
                                 "--remote", "{remote}"], 0, manifest_check_remote),
    ("manifest show", ["manifest", "show", "{manifest}"], 0, manifest_show_check),
    ("manifest diff", ["manifest", "diff", "{manifest}", "{manifest}"], 0, manifest_diff_check),
    ("debug faults", ["debug", "faults"], 0, faults_check),
    ("snapshot ls", ["snapshot", "ls", "{root}"], 0, snapshot_ls_check),
    ("profile validate", ["profile", "validate", "{root}"], 1, validate_check),
    ("profile list", ["profile", "list", "--project-root", "{root}"], 0, profile_list_check),
]


@pytest.mark.parametrize(("name", "argv", "code", "check"), CASES, ids=[c[0] for c in CASES])
def test_json_parses_and_says_what_the_table_says(
    name: str, argv: list[str], code: int, check: Check, tmp_path: Path, capsys: Any,
    no_remote_env: None,
) -> None:
    human_world = build_world(tmp_path / "human")
    json_world = build_world(tmp_path / "json")
    human_code, human, _ = run(capsys, human_world.cli(*argv))
    json_code, out, err = run(capsys, json_world.cli(*argv, "--json"))
    assert (human_code, json_code) == (code, code), (human, out, err)
    doc = json.loads(out)  # the whole of stdout is one document
    assert "\r" not in err  # no progress bar outside a terminal
    # Each run has a world of its own: their directories are written alike to compare.
    doc = json.loads(out.replace(str(json_world.root), "<root>"))
    check(doc, human.replace(str(human_world.root), "<root>"))


def test_every_reporting_command_takes_json() -> None:
    """Every sub-command that prints a report accepts ``--json`` (the table above covers
    each; this catches a command added without it)."""
    import argparse

    from vllm_neuron.cli import build_parser

    without = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            if not any("--json" in a.option_strings for a in parser._actions):
                without.append(" ".join(path))
            return
        for name, child in subs[0].choices.items():
            walk(child, [*path, name])

    walk(build_parser(), [])
    # demo runs processes and prints a verdict; report writes an HTML page.
    assert sorted(without) == ["demo", "report"]
