"""`vllm-neuron report` on any tier a user points it at (issue 27): a remote tier's folder
(entries, ``.locks``, ``.staging``, no event log) and an ``s3://`` tier are recognised by
their entries and labelled remote; every tier lists its entries (key, piece, size, age,
toolchain, signer, problems) under its totals. Each page is opened in headless chromium and
read back from the DOM it built. (The demo's own output: tests/cli/test_demo.py, which
runs the demo once for both.)

The tiers are made with the real writers: a node's cache compiles five keys (two naming a
piece of the model), `save_cache` promotes them to the remote, one gets a builder's
signature, a host leaves a load-failure note on another, one is quarantined, and one has
a file rewritten short - all through the `Store`, so the S3 tier is made exactly as the folder is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cache_workers import FILE_NAMES, fake_compile
from report_browser import Element, descendants, load, parse, select
from report_deployment import run_report

from vllm_neuron.backends import join, open_store
from vllm_neuron.compile.entry.load_failure_notes import note_load_failure
from vllm_neuron.compile.entry.record import read_record
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.promote import save_cache
from vllm_neuron.compile.tiers.quarantine import quarantine_entry
from vllm_neuron.compile.trust.signing import SIGNATURE_FILE, generate_key_pair, load_signer
from vllm_neuron.report.tier_table import ROW_CAP, render_entries
from vllm_neuron.report.tiers import EntryRow, TierEntries, read_entries

KEYS = tuple(f"{i:x}" * 32 for i in range(10, 15))  # aaaa..., bbbb..., ... eeee...
SIGNED, NOT_LOADED, QUARANTINED, SHORT, PLAIN = KEYS
PIECE = "[backbone] range 1-2048 subgraph 0"
PIECES = {SIGNED: PIECE, NOT_LOADED: PIECE}  # one piece, two variants (per-rank graphs)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A node's VLLM_CACHE_ROOT whose local tier compiled the five keys."""
    root = tmp_path_factory.mktemp("node")
    cache = TwoTierCache(str(root / "neuron" / "compile_cache"))
    for key in KEYS:
        cache.get_or_compile(key, lambda out, k=key: fake_compile(out, key=k),
                             piece=PIECES.get(key))  # fmt: skip
    return root


def fill_remote(node: Path, remote: str, keys_dir: Path) -> str:
    """Promote the node's entries to `remote` and leave on it what a fleet leaves; the
    signing key's id."""
    local = str(node / "neuron" / "compile_cache")
    for key in KEYS:
        assert save_cache(local, remote, key)
    store = open_store(remote, create=False)
    private, _, key_id = generate_key_pair(str(keys_dir))
    # As a builder's promotion leaves it, signed (`sign_tier` never signs a remote's entries:
    # their origin is unknown to this process).
    signed_at = store.published(SIGNED)
    assert signed_at is not None
    store.write(join(signed_at, SIGNATURE_FILE),
                load_signer(private).sign_bytes(read_record(store, signed_at)))
    note_load_failure(store, NOT_LOADED, "cannot load AOTInductor package: bad magic")
    assert quarantine_entry(store, QUARANTINED, "graph.bin fails its sha256 check", warn=False)
    prefix = store.published(SHORT)
    assert prefix is not None
    store.write(join(prefix, FILE_NAMES[0]), b"short")  # a file of the wrong size
    return key_id


def tiers_of(dom: list[Element]) -> dict[str, Element]:
    return {s.attrs["data-cache"]: s for s in select(dom, "section", class_="cache")}


def entry_rows(section: Element) -> list[Element]:
    return [e for e in descendants(section) if e.tag == "tr" and "data-key" in e.attrs]


def cells(row: Element) -> list[str]:
    return [c.text.strip() for c in row.children if c.tag == "td"]


def totals(section: Element) -> dict[str, int]:
    return {e.attrs["data-total"]: json.loads(e.attrs["data-value"])
            for e in descendants(section) if "data-total" in e.attrs}  # fmt: skip


def opened(page: Path, scratch: Path) -> list[Element]:
    """The page as chromium built it; it logged nothing (no refused load, no markup)."""
    loaded = load(page, scratch)
    assert loaded.console == []
    return parse(loaded.dom)


def check_remote(section: Element, remote: str, key_id: str, *, pieces: bool) -> None:
    """The remote tier as the fleet left it: labelled remote, its totals, one row per entry
    (problems first), each with what `cache ls` and the notes say of it."""
    assert section.attrs["data-tier"] == "remote"
    heading = next(e for e in section.children if e.tag == "h3")
    assert heading.text.endswith(f"Remote tier {remote}")
    assert "keeps no event log" in section.text
    assert not select(descendants(section), "div", class_="cache-stats")
    assert totals(section) == {"entries": 4, "bytes": totals(section)["bytes"],
                               "with_problems": 2, "signed": 1, "quarantined": 1}
    store = open_store(remote, create=False)
    records = {k: read_record(store, store.published(k) or k)
               for k in (SIGNED, NOT_LOADED, PLAIN)}  # fmt: skip
    rows = entry_rows(section)
    by_key = {r.attrs["data-key"]: r for r in rows}
    assert set(by_key) == set(KEYS)
    # problems first (newest first among them), then the quarantined, then the rest
    order = [r.attrs["data-key"] for r in rows]
    assert set(order[:2]) == {NOT_LOADED, SHORT} and order[2] == QUARANTINED
    assert set(order[3:]) == {SIGNED, PLAIN}
    key, piece, size, age, toolchain, signer, problems = cells(by_key[SIGNED])
    assert (key, toolchain, signer, problems) == (SIGNED, "host", key_id, "")
    assert piece == (PIECE if pieces else "-")
    assert int(by_key[SIGNED].attrs["data-size"]) == records[SIGNED].total_size
    assert float(by_key[SIGNED].attrs["data-created"]) == records[SIGNED].created
    assert size.endswith("KiB") and age[-1] in "smhd"
    assert cells(by_key[PLAIN])[1] == "-" and cells(by_key[PLAIN])[5] == "unsigned"
    assert "did not load on" in by_key[NOT_LOADED].text and "bad magic" in by_key[NOT_LOADED].text
    assert by_key[NOT_LOADED].attrs.get("class") == "bad"
    assert section.text.count("bad magic") == 1  # in its entry's row, not again for the tier
    assert FILE_NAMES[0] in cells(by_key[SHORT])[6]
    gone = by_key[QUARANTINED]
    assert gone.attrs["data-quarantined"] == "true" and "withdrawn" in cells(gone)[3]
    assert "quarantined: graph.bin fails its sha256 check" in cells(gone)[6]
    assert [cells(gone)[i] for i in (2, 4, 5)] == ["-", "-", "-"]  # no record left to read


def test_a_remote_folder_beside_its_node(node: Path, tmp_path: Path) -> None:
    """``report NODE REMOTE``: the node's tier is local (its event log), the folder remote
    (entries, .locks, .staging, no event log); the remote's rows name the pieces the node's
    compile events recorded. ``--cache-dir REMOTE`` alone reads it as remote too."""
    remote = tmp_path / "remote"
    key_id = fill_remote(node, str(remote), tmp_path / "keys")
    assert not (remote / ".events").exists() and (remote / ".staging").exists()
    page = tmp_path / "r.html"
    done = run_report(str(node), str(remote), "-o", str(page))
    assert done.returncode == 0, done.stderr
    assert "2 tiers (1 local, 1 remote) holding 9 entries" in done.stdout
    dom = opened(page, tmp_path)
    tiers = tiers_of(dom)
    local = tiers[str(node / "neuron" / "compile_cache")]
    assert local.attrs["data-tier"] == "local" and local.attrs["id"] == "cache-1"
    assert "Local tier" in next(e for e in local.children if e.tag == "h3").text
    assert totals(local)["entries"] == 5 and totals(local)["with_problems"] == 0
    assert {cells(r)[1] for r in entry_rows(local)} == {PIECE, "-"}
    check_remote(tiers[str(remote)], str(remote), key_id, pieces=True)
    (card,) = select(dom, "div", data_card="cache entries")
    assert card.text.strip().startswith("5")  # distinct keys published in either tier
    origins = [cells(r) for r in select(dom, "tr") if r in descendants(
        select(dom, "table", class_="sources")[0])]  # fmt: skip
    assert [str(remote), "remote", str(remote)] in origins

    done = run_report("--cache-dir", str(remote), "-o", str(page))
    assert done.returncode == 0, done.stderr
    dom = parse(page.read_text())
    (only,) = tiers_of(dom).values()
    check_remote(only, str(remote), key_id, pieces=False)
    assert any("No local tier was read" in e.text for e in select(dom, "p"))


def test_the_notes_of_a_remote_are_read_into_its_rows(node: Path, tmp_path: Path) -> None:
    """What the page shows of the notes, read without a browser: a host's load-failure note
    is its entry's problem, and a quarantined entry is listed by its note (both read
    through the registry of per-key notes, `compile/entry/notes.py`)."""
    remote = tmp_path / "remote"
    fill_remote(node, str(remote), tmp_path / "keys")
    read = read_entries(str(remote), {})
    assert read.error is None
    by_key = {r.key: r for r in read.rows}
    assert set(by_key) == set(KEYS)
    (problem,) = by_key[NOT_LOADED].problems
    assert problem.startswith("did not load on ") and problem.endswith("bad magic")
    gone = by_key[QUARANTINED]
    assert gone.withdrawn is not None and gone.problems == (
        "quarantined: graph.bin fails its sha256 check",)
    assert [r.key for r in read.rows if r.withdrawn is not None] == [QUARANTINED]


def test_an_s3_tier(node: Path, tmp_path: Path, s3_env: str, s3_store_url: str) -> None:
    """``report s3://bucket/prefix`` on a remote tier the fleet filled: recognised by its
    entries (commit records, read through the store), labelled remote, listed."""
    key_id = fill_remote(node, s3_store_url, tmp_path / "keys")
    page = tmp_path / "r.html"
    done = run_report(s3_store_url, "-o", str(page))
    assert done.returncode == 0, done.stderr
    assert "1 tiers (0 local, 1 remote) holding 4 entries" in done.stdout
    (section,) = tiers_of(opened(page, tmp_path)).values()
    check_remote(section, s3_store_url, key_id, pieces=False)


def test_remote_names_a_remote_tier_whatever_it_holds(node: Path, tmp_path: Path) -> None:
    """``--remote`` reads a tier as remote even with an event log; beside a root that holds
    the same tier, it is read once, as first named."""
    tier = str(node / "neuron" / "compile_cache")
    page = tmp_path / "r.html"
    done = run_report("--remote", tier, "-o", str(page))
    assert done.returncode == 0, done.stderr
    (section,) = tiers_of(parse(page.read_text())).values()
    assert section.attrs["data-tier"] == "remote" and totals(section)["entries"] == 5
    done = run_report(str(node), "--remote", tier, "-o", str(page))
    assert done.returncode == 0, done.stderr
    assert "1 tiers (0 local, 1 remote)" in done.stdout


def test_a_huge_tier_shows_its_totals_and_caps_its_rows() -> None:
    many = TierEntries(tuple(EntryRow(key=f"{i:032x}", size=10, files=1, created=1.0e9 + i,
                                      toolchain="host")
                             for i in range(ROW_CAP + 57)))  # fmt: skip
    dom = parse(render_entries(many, "s3://b/tier", 1.0e9 + 10_000))
    (table,) = select(dom, "table", class_="entries")
    assert len([r for r in descendants(table) if "data-key" in r.attrs]) == ROW_CAP
    (more,) = select(dom, "p", data_more="57")
    assert "57 more entries not shown" in more.text and "cache ls s3://b/tier" in more.text
    sums = {e.attrs["data-total"]: json.loads(e.attrs["data-value"])
            for e in dom if "data-total" in e.attrs}  # fmt: skip
    assert sums["entries"] == ROW_CAP + 57 and sums["bytes"] == 10 * (ROW_CAP + 57)
    # the totals come before the table
    assert dom.index(select(dom, "table", class_="tier-totals")[0]) < dom.index(table)


def test_a_tier_that_cannot_be_listed_is_said_on_the_page() -> None:
    dom = parse(render_entries(TierEntries(error="StoreUnavailable: no answer"), "s3://b/t", 0.0))
    assert any("cannot be listed" in e.text and "no answer" in e.text for e in dom)
