"""The record layer: one codec for tagged records and fixed-format documents.

What it promises: a current record reads as is; an older one is upcast through the
registry; a newer one, an older one nothing upcasts, garbage and truncated bytes are a
`RecordError` naming the file and the problem; a stream skips and counts such lines.
"""

from __future__ import annotations

import pickle
from typing import Any

import msgspec
import pytest

from vllm_neuron.backends import open_store
from vllm_neuron.backends.records import (
    MAX_DEPTH,
    Document,
    Record,
    RecordCodec,
    RecordError,
    Untagged,
    encode,
    encode_document,
    encode_line,
    nesting_problem,
    register_upcaster,
)


class Tally(Record, tag="test-tally", frozen=True, kw_only=True):
    """Version 2: ``count`` was ``hits`` in version 1, and counted in halves."""

    v: int = 2
    count: int


@register_upcaster("test-tally", 1)
def _tally_v1(raw: dict[str, Any]) -> dict[str, Any]:
    if "hits" not in raw:
        raise ValueError("a version 1 tally has hits")
    return {**raw, "count": 2 * raw.pop("hits")}


class Note(Record, tag="test-note", frozen=True):
    text: str


class Doc(Document, frozen=True, kw_only=True):
    record_tag = "test-doc"
    version_field = "format_version"
    format_version: str = "2"
    name: str


@register_upcaster("test-doc", 1)
def _doc_v1(raw: dict[str, Any]) -> dict[str, Any]:
    return {**raw, "name": raw.pop("title")}


class Seeded(Document, frozen=True, kw_only=True):
    record_tag = "test-seeded"
    version_field = "schema_version"
    missing_version = 0
    schema_version: int = 1
    name: str


@register_upcaster("test-seeded", 0)
def _seeded_v0(raw: dict[str, Any]) -> dict[str, Any]:
    return {**raw, "name": raw.get("name", "from the seed")}


TALLIES: RecordCodec[Record] = RecordCodec([Tally, Note])


def refused(codec: RecordCodec[Any], data: bytes, *parts: str) -> RecordError:
    with pytest.raises(RecordError) as info:
        codec.decode(data, source="/x/f.json")
    message = str(info.value)
    assert message.startswith("/x/f.json: "), message
    for part in parts:
        assert part in message, message
    return info.value


# -- tagged records ---------------------------------------------------------------------------


def test_current_records_read_as_written() -> None:
    assert TALLIES.decode(encode(Tally(count=3))) == Tally(count=3)
    assert TALLIES.decode(encode(Note(text="n"))) == Note(text="n")
    assert encode_line(Note(text="n")) == encode(Note(text="n")) + b"\n"


def test_an_older_record_is_upcast_even_when_it_would_validate_as_is() -> None:
    assert TALLIES.decode(b'{"type":"test-tally","v":1,"hits":2}') == Tally(count=4)
    # ``count`` present in a v1 line is still a v1 line: upcast, never taken as it stands
    with pytest.raises(RecordError, match="a version 1 tally has hits"):
        TALLIES.decode(b'{"type":"test-tally","v":1,"count":2}')


def test_newer_unknown_and_unreadable_records_are_refused_naming_the_file() -> None:
    refused(TALLIES, b'{"type":"test-tally","v":3,"count":1}', "v 3 is not supported",
            "newer version")  # fmt: skip
    refused(TALLIES, b'{"type":"test-note","v":0,"text":"a"}', "nothing upcasts test-note 0")
    refused(TALLIES, b'{"type":"test-note","v":"1","text":"a"}', "v '1' is not supported")
    refused(TALLIES, b'{"type":"what","v":1}', "record type 'what'", "test-note, test-tally")
    refused(TALLIES, b'{"type":"test-note","v":1,"text":', "garbage or truncated")
    refused(TALLIES, b"\xff\x00garbage", "garbage or truncated")
    refused(TALLIES, b"", "garbage or truncated")
    refused(TALLIES, b"[1, 2]", "not a JSON object but a list")
    refused(TALLIES, b'{"type":"test-note","v":1}', "not a valid test-note record",
            "missing required field `text`")  # fmt: skip


def test_a_record_error_survives_pickling() -> None:
    error = RecordError("/x/f.json", "bad")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.source, copy.problem, str(copy)) == ("/x/f.json", "bad", "/x/f.json: bad")
    assert isinstance(copy, ValueError)


def test_a_stream_skips_and_counts_older_newer_and_torn_lines() -> None:
    blob = b"".join([
        encode_line(Tally(count=1)),
        b'{"type":"test-tally","v":1,"hits":5}\n',  # older: upcast
        b'{"type":"test-tally","v":9,"count":1}\n',  # newer: skipped
        encode_line(Note(text="n")),
        b'{"type":"test-note","v":1,"te',  # torn last line
    ])  # fmt: skip
    decoded = TALLIES.decode_lines(blob)
    assert decoded.records == [Tally(count=1), Tally(count=10), Note(text="n")]
    assert decoded.skipped == 2
    assert decoded.errors[0].startswith("line 3: v 9 is not supported")
    assert decoded.errors[1].startswith("line 5: not JSON (garbage or truncated)")


def test_untagged_objects_read_as_the_declared_version() -> None:
    old_form = RecordCodec(Note, untagged=Untagged("test-note", 1, "the old note"))
    assert old_form.decode(b'{"text": "kept"}') == Note(text="kept")
    refused(old_form, b'{"txt": "x"}', "no record tag, so it was read as the old note",
            "missing required field `text`")  # fmt: skip
    seed = RecordCodec(Tally, untagged=Untagged("test-tally", 1, "a seed tally"))
    assert seed.decode(b'{"hits": 3}') == Tally(count=6)
    refused(seed, b'{"count": 3}', "read as a seed tally", "a version 1 tally has hits")


def test_convert_reads_a_record_nested_in_another() -> None:
    assert TALLIES.convert({"type": "test-tally", "v": 1, "hits": 1}) == Tally(count=2)
    with pytest.raises(RecordError, match="^meta: not a JSON object"):
        TALLIES.convert("x", source="meta")


def test_read_names_the_store_and_key() -> None:
    store = open_store("memory://")
    assert TALLIES.read(store, "a/b.json") is None
    store.write("a/b.json", b"{not json")
    with pytest.raises(RecordError, match="^memory://a/b.json: not JSON"):
        TALLIES.read(store, "a/b.json")
    store.write("a/b.json", encode(Note(text="t")))
    assert TALLIES.read(store, "a/b.json") == Note(text="t")


# -- documents --------------------------------------------------------------------------------


def test_a_document_keeps_its_own_version_field_and_upcasts_a_string_version() -> None:
    docs = RecordCodec(Doc)
    data = encode_document(Doc(name="a"))
    assert b'"type"' not in data and data.endswith(b"\n")
    assert msgspec.json.decode(data) == {"format_version": "2", "name": "a"}
    assert docs.decode(data) == Doc(name="a")
    assert docs.decode(b'{"format_version": "1", "title": "old"}') == Doc(name="old")
    refused(docs, b'{"name": "a"}', "has no format_version (this version reads '2')")
    refused(docs, b'{"format_version": 2, "name": "a"}', "format_version 2 is not supported")
    refused(docs, b'{"format_version": "3", "name": "a"}', "'3' is not supported", "newer")


def test_a_document_without_its_version_field_can_be_an_old_version() -> None:
    seeded = RecordCodec(Seeded)
    assert seeded.decode(b"{}") == Seeded(name="from the seed")
    assert seeded.decode(b'{"schema_version": 1, "name": "ours"}') == Seeded(name="ours")


# -- what a codec refuses to be built from ---------------------------------------------------


class NumberTag(Record, tag=7, frozen=True):
    x: int = 0


class Omitting(Record, tag="test-omitting", frozen=True, omit_defaults=True):
    v: int = 2


class NoDefault(Document, frozen=True):
    record_tag = "test-no-default"
    version_field = "version"
    version: int


class SameTag(Record, tag="test-note", frozen=True):
    other: int = 0


@pytest.mark.parametrize(
    ("types", "kwargs", "message"),
    [
        ([], {}, "at least one"),
        ([NumberTag], {}, "needs a string tag"),
        ([Omitting], {}, "omit_defaults leaves v=2 out"),
        ([NoDefault], {}, "must default to the version"),
        ([Doc, Note], {}, "a Document is read alone"),
        ([Note, SameTag], {}, "share a tag"),
        ([Note], {"untagged": Untagged("test-tally", 1)}, "does not read"),
        ([dict], {}, "neither a Record nor a Document"),
    ],
)
def test_bad_codecs_are_refused_when_built(
    types: list[type[Any]], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        RecordCodec(types, **kwargs)


# -- nesting: a record deeper than MAX_DEPTH is a defect of that record -----------------------


class Loose(Record, tag="test-loose", frozen=True):
    """A record with a free-form field, where JSON of any depth would decode."""

    value: Any = None


LOOSE: RecordCodec[Loose] = RecordCodec(Loose)


def _nested(depth: int, inner: str = "1") -> bytes:
    return ('{"type":"test-loose","value":' + "[" * (depth - 1) + inner + "]" * (depth - 1)
            + "}").encode()  # fmt: skip


@pytest.mark.parametrize("depth", [65, 500, 10_000, 100_000])
def test_a_record_nested_too_deep_is_refused_not_a_crash(depth: int) -> None:
    """10,000 levels raised RecursionError from msgspec (which callers took for an outage
    of the remote); a few hundred decoded but could not be encoded again."""
    refused(LOOSE, _nested(depth), "nested deeper than")
    refused(LOOSE, b"[" * depth, "not JSON")  # unbalanced: torn, or hostile
    refused(ENTRYLIKE, _nested(depth), "nested deeper than")


ENTRYLIKE: RecordCodec[Doc] = RecordCodec(Doc)


def test_nesting_up_to_the_bound_reads_and_brackets_in_strings_do_not_count() -> None:
    assert LOOSE.decode(_nested(MAX_DEPTH)).value is not None
    many = '"' + "[{" * 200 + '\\\\\\"' + "]" * 50 + '"'  # brackets, escapes in a string
    record = LOOSE.decode(_nested(MAX_DEPTH, inner=many))
    assert record.value is not None
    assert nesting_problem(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) is None
    assert nesting_problem(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)) is not None


def test_a_stream_skips_a_line_nested_too_deep() -> None:
    good = encode_line(Note(text="kept"))
    decoded = TALLIES.decode_lines(good + b"[" * 10_000 + b"]" * 10_000 + b"\n" + good)
    assert [r.text for r in decoded.records] == ["kept", "kept"] and decoded.skipped == 1
