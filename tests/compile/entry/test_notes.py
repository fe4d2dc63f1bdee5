"""`compile/entry/notes.py`: the registry of per-key notes.

On-disk names are a format (notes written by earlier versions must read, and every node of
a fleet must agree on where a note lives), so they are spelled out here; a note's directory
is never taken for an entry by what lists a tier's entries (`cache ls`, `cache verify`, the
report's inventory) and never collides with the storage layer's own names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from vllm_neuron.backends import encode, join, layout, open_store
from vllm_neuron.cli import main
from vllm_neuron.compile.entry.check import KEY_RE
from vllm_neuron.compile.entry.events import EVENTS_STREAM
from vllm_neuron.compile.entry.notes import (
    FAILURES,
    LOAD_FAILURES,
    NOTE_KINDS,
    QUARANTINE,
    UNPACKED,
    Layout,
    LoadFailureNote,
    kind_named,
    kind_of,
)
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.inventory import list_entries, verify_entries

KEY = "0123456789abcdef0123456789abcdef"
OTHER = "9c000000000000000000000000000d0d"
DATA = Path(__file__).resolve().parents[1] / "data" / "records"


def test_the_registered_names_and_tags_are_the_formats_earlier_versions_wrote():
    found = {k.name: (k.directory, k.layout, k.record.__struct_config__.tag)
             for k in NOTE_KINDS}  # fmt: skip
    assert found == {
        "failure-note": (".failures", Layout.PER_KEY, "compile-failure"),
        "quarantine-note": (".quarantine", Layout.PER_KEY, "quarantine-note"),
        "owed-note": (".promote", Layout.PER_KEY, "promotion-owed"),
        "load-failure-note": (".load-failures", Layout.PER_HOST, "load-failure-note"),
        "pin": (".pins", Layout.PER_KEY, "pin"),
        "unpacked": (".unpacked", Layout.COPY, "unpacked-package"),
        "stopped-note": (".stopped", Layout.PER_KEY, "compile-stopped"),
    }


def test_old_notes_read_through_the_registry():
    failure = FAILURES.codec.decode((DATA / "failure-note.json").read_bytes())
    quarantine = QUARANTINE.codec.decode((DATA / "quarantine-note.json").read_bytes())
    assert failure.v == 1 and failure.error and quarantine.key == KEY and quarantine.v == 1


def test_no_note_directory_is_a_storage_name_an_entry_or_the_event_stream():
    """The storage layer keeps its own dot-names (`backends/layout.py`); a note directory
    that took one would be collected, listed or published as the layer's."""
    reserved = {v for n, v in vars(layout).items() if n.isupper() and isinstance(v, str)}
    assert reserved == {".commit", ".v", ".staging", ".locks", ".trash"}
    for kind in NOTE_KINDS:
        assert kind.directory.startswith(".") and "/" not in kind.directory
        assert kind.directory not in reserved | {EVENTS_STREAM}
        assert not KEY_RE.fullmatch(kind.directory)
        assert kind_of(f"{kind.directory}/x") is kind and kind_named(kind.name) is kind


@pytest.mark.parametrize("kind", NOTE_KINDS, ids=lambda k: k.name)
def test_parse_finds_the_key_of_each_note_and_nothing_else(kind):
    if kind.layout is Layout.COPY:
        where = f"{kind.directory}/{KEY}-{'e' * 32}"
        assert kind.parse(f"{where}/unpacked.json") == (where, KEY)
        assert kind.parse(f"{where}/graph/model.so") == (where, KEY)
        assert kind.parse(where) is None  # the directory itself holds no file
        assert kind.parse(f"{kind.directory}/{KEY}-short/unpacked.json") is None
        with pytest.raises(ValueError):
            kind.path(KEY)
    else:
        where = kind.path(KEY, "node-1")
        assert kind.parse(where) == (where, KEY)
        assert kind.parse(f"{where}.0123.partial") is None  # a writer's temp file
        assert kind.parse(join(kind.directory, "not-a-key.json")) is None
    assert kind.parse(f".elsewhere/{KEY}.json") is None


def test_read_all_is_by_key_and_oldest_first_and_skips_a_note_that_does_not_read(tmp_path):
    store = open_store(str(tmp_path / "tier"))
    for host, at in (("b", 20.0), ("a", 10.0)):
        store.write(LOAD_FAILURES.path(KEY, host),
                    encode(LoadFailureNote(key=KEY, at=at, host=host, error="no")))  # fmt: skip
    store.write(LOAD_FAILURES.path(OTHER, "torn"), b'{"type": "load-fail')
    assert {k: [n.host for n in v] for k, v in LOAD_FAILURES.read_all(store).items()} == {
        KEY: ["a", "b"]}
    with pytest.raises(ValueError):
        UNPACKED.read_all(store)


@pytest.fixture
def tier_with_notes(tmp_path: Any, compile_fn: Any) -> str:
    """A tier holding one entry (KEY) and a note of every registered kind about it."""
    cache = TwoTierCache(str(tmp_path / "tier"))
    cache.get_or_compile(KEY, compile_fn(KEY))
    store = cache.local
    for kind in NOTE_KINDS:
        if kind.layout is Layout.COPY:
            store.write(f"{kind.directory}/{OTHER}-{'e' * 32}/unpacked.json", b"{}")
        else:
            store.write(kind.path(OTHER, "node-1"), b"{}")
    return str(tmp_path / "tier")


def test_ls_and_verify_never_take_a_note_for_an_entry(capsys, tier_with_notes):
    store = open_store(tier_with_notes)
    assert [e.key for e in list_entries(store)] == [KEY]
    assert [(r.key, r.ok) for r in verify_entries(store)] == [(KEY, True)]
    assert main(["cache", "ls", tier_with_notes, "--json"]) == 0
    assert [row["key"] for row in json.loads(capsys.readouterr().out)] == [KEY]
    assert main(["cache", "verify", tier_with_notes, "--json"]) == 0
    assert [row["key"] for row in json.loads(capsys.readouterr().out)] == [KEY]
    for kind in NOTE_KINDS:  # and none of them was quarantined or removed meanwhile
        assert store.list(kind.directory), kind.name


def test_records_keep_their_fields():
    """Field names are on disk too: the load-failure note as `cache ls --json` shows it."""
    note = LoadFailureNote(key=KEY, at=1.0, host="h", error="e")
    assert msgspec.json.decode(encode(note)) == {"type": "load-failure-note", "v": 1,
                                                 "key": KEY, "at": 1.0, "host": "h",
                                                 "error": "e"}  # fmt: skip
