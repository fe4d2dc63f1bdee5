"""Compile-cache files written before the record layer was unified still read.

The files under ``data/records/`` were written by the code of commit 6d14dc9 (an
``entry.json`` whose ``meta`` is a host ``CompiledArtifact``, artifact metadata, a
quarantine note, a failure note, an event segment) and are never regenerated: a cache
outlives the version that filled it.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from vllm_neuron.backends import encode, open_store
from vllm_neuron.compile.entry.events import EVENTS_STREAM, read_stats
from vllm_neuron.compile.entry.failure_notes import (
    FAILURES_DIR,
    describe,
    recent_failure,
    write_failure_note,
)
from vllm_neuron.compile.entry.record import decode_record
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.quarantine import (
    QUARANTINE_DIR,
    QuarantineNote,
    quarantine_entry,
    read_quarantine_note,
)
from vllm_neuron.compile.toolchains.base import ARTIFACTS, CompiledArtifact

DATA = Path(__file__).resolve().parents[1] / "data" / "records"
KEY = "0123456789abcdef0123456789abcdef"


def fixture(name: str) -> bytes:
    return (DATA / name).read_bytes()


def test_an_old_entry_record_reads_with_its_artifact() -> None:
    record = decode_record(fixture("entry.json"))
    assert (record.schema, record.key, record.toolchain) == (1, KEY, "host")
    assert record.files["graph.pt2"].size == 240 and record.files["graph.pt2"].blake3
    artifact = ARTIFACTS.convert(record.meta, source="entry.json meta")
    assert artifact.files == ("graph.pt2",) and artifact.derived_inputs == (4,)
    assert msgspec.convert(record.meta, CompiledArtifact) == artifact  # untagged converts too


def test_old_artifact_metadata_reads() -> None:
    host = ARTIFACTS.decode(fixture("compiled-artifact-host.json"))
    assert host.output_shapes == ("4, 8", "") and host.hlo_file is None
    neuron = ARTIFACTS.decode(fixture("compiled-artifact-neuron.json"))
    assert (neuron.toolchain, neuron.hlo_file, neuron.num_inputs) == ("neuron", "graph.hlo.pb", 3)


def test_artifact_metadata_is_now_a_tagged_record() -> None:
    host = ARTIFACTS.decode(fixture("compiled-artifact-host.json"))
    meta = msgspec.to_builtins(host)  # what the runtime stores as the entry's meta
    assert (meta["type"], meta["v"]) == ("compiled-artifact", 1)
    assert ARTIFACTS.convert(meta) == host == ARTIFACTS.decode(encode(host))


def test_an_old_quarantine_note_reads() -> None:
    store = open_store("memory://")
    store.write(f"{QUARANTINE_DIR}/{KEY}.json", fixture("quarantine-note.json"))
    note = read_quarantine_note(store, KEY)
    assert note is not None and note.key == KEY and "240" in note.reason and note.at > 0


def test_a_new_quarantine_note_is_a_tagged_record() -> None:
    store = open_store("memory://")
    with store.stage(KEY) as staging:
        staging.write("x", b"x")
        staging.commit()
    assert quarantine_entry(store, KEY, "x has 2 bytes, the record says 1")
    note = read_quarantine_note(store, KEY)
    assert isinstance(note, QuarantineNote) and note.reason == "x has 2 bytes, the record says 1"
    assert msgspec.json.decode(store.read(f"{QUARANTINE_DIR}/{KEY}.json") or b"")["type"] == (
        "quarantine-note")
    assert read_quarantine_note(store, "f" * 32) is None


def test_an_old_failure_note_is_seen_by_a_waiter(tmp_path: Path) -> None:
    os.makedirs(tmp_path / FAILURES_DIR)
    (tmp_path / FAILURES_DIR / f"{KEY}.json").write_bytes(fixture("failure-note.json"))
    failure = recent_failure(open_store(str(tmp_path)), KEY, since=0)
    assert failure is not None
    assert failure.error == "RuntimeError: neuronx-cc exited with status 70"


def test_an_old_event_segment_folds(tmp_path: Path) -> None:
    os.makedirs(tmp_path / EVENTS_STREAM)
    (tmp_path / EVENTS_STREAM / "old.jsonl").write_bytes(fixture("events.jsonl"))
    stats = read_stats(str(tmp_path))
    assert stats.skipped_lines == 0
    # The segment's fetch is a hit of the remote tier: two hits, one per tier.
    assert (stats.hits, stats.misses, stats.compiles, stats.compile_failures) == (2, 1, 1, 1)
    assert stats.hits_by_tier == {"local": 1, "remote": 1}
    assert (stats.fetches, stats.promotions, stats.verification_failures) == (1, 1, 1)
    assert stats.remote_outages == 1 and stats.lock_wait_seconds == 0.5


def test_the_quarantine_dir_is_where_old_notes_are() -> None:
    store = open_store("memory://")
    store.write(f"{QUARANTINE_DIR}/{KEY}.json", fixture("quarantine-note.json"))
    assert store.list(QUARANTINE_DIR) == [f"{QUARANTINE_DIR}/{KEY}.json"]


def test_an_entry_record_of_a_later_schema_is_a_miss_and_quarantined(tmp_path: Path) -> None:
    record = msgspec.json.decode(fixture("entry.json"))
    entry = tmp_path / KEY
    entry.mkdir()
    (entry / "graph.pt2").write_bytes(b"\x00fixture artifact bytes\n" * 10)
    (entry / "entry.json").write_bytes(encode({**record, "schema": 2}))
    assert TwoTierCache(str(tmp_path)).local_tier.lookup(KEY) is None
    note = read_quarantine_note(open_store(str(tmp_path)), KEY)
    assert note is not None
    assert f"{KEY}/entry.json: schema 2 is not supported" in note.reason


def test_a_new_failure_note_is_a_tagged_record(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    write_failure_note(store, KEY, describe(RuntimeError("boom")))
    failure = recent_failure(store, KEY, since=0)
    assert failure is not None and failure.error == "RuntimeError: boom"
    assert failure.pid == os.getpid()
    raw = msgspec.json.decode((tmp_path / FAILURES_DIR / f"{KEY}.json").read_bytes())
    assert raw["type"] == "compile-failure"
    assert recent_failure(store, KEY, since=failure.at + 1) is None
