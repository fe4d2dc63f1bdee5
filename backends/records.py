"""The project's one record layer: every persisted object is a versioned msgspec struct.

Two shapes, read by one codec (`RecordCodec`):

* `Record`: tagged on disk (``"type"``), its version in ``v``. The tag lets one decoder read
  a stream that mixes kinds (event logs, the manifest ledger) as well as a file holding one
  (a lease, a commit record, a note, a snapshot's ``meta.json``).
* `Document`: a format someone else fixes, so nothing is added on disk: the class names its
  registry tag and the field its format keeps the version in (the manifest's
  ``manifest_version``, the profile ``schema_version``, the compile entry's ``schema``).

An older version is upcast explicitly, by the functions registered per (tag, version) with
`register_upcaster`, one registry for both shapes; a version newer than this reader, or an
older one nothing upcasts, is refused rather than misread. Files written before their
records were tagged read through `Untagged`: a JSON object without ``"type"`` is taken as a
given version of a given tag. Every refusal is a `RecordError` naming the file and the
problem; the caller decides what it means (a cache entry: a miss and a quarantine; a line
of an event stream: skipped and counted, since a torn line from a killed writer must never
make a whole stream unreadable).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar, Union

import msgspec

from .errors import NotRegularFile, RecordError, RecordTooLarge
from .protocol import ByteStore

__all__ = [  # RecordError and its kinds live in errors.py (regular.py raises them too)
    "COMMIT_RECORDS", "LEASE_RECORDS", "MAX_DEPTH", "MAX_ERRORS", "RECORD_MAX_BYTES",
    "CommitRecord", "Decoded", "Document", "LeaseRecord",
    "NotRegularFile", "Record", "RecordCodec", "RecordError", "RecordTooLarge", "Untagged",
    "encode", "encode_document", "encode_into", "encode_line", "nesting_problem",
    "register_upcaster", "Upcaster",
]

T = TypeVar("T")
MAX_ERRORS = 20  # error messages a `Decoded` keeps (its count of skipped lines is exact)

RECORD_MAX_BYTES = 1 << 20
"""The most bytes a record may have (entry records, notes, leases, commit records,
signatures, unpacked-copy records; the largest this project writes is an entry record of a
few KiB per hundred files). Every record reader reads at most this many bytes plus one
(`RecordCodec.read`, `Store.read_published`, `Store.read(key, max_size=...)`): a larger
file is a defect of that record (`RecordTooLarge`), never read whole, so a hostile writer
of a shared tier cannot grow a node's memory with it. The one bound of the storage layer
for records; streams (event-log segments, ledgers) and content (tensors, HLO) are read
unbounded by their own readers, or streamed."""
MAX_DEPTH = 64
"""The deepest nesting of JSON arrays and objects a record may have (ours nest at most 4
deep). A deeper one is refused before it is decoded (`RecordCodec.decode`): msgspec
recurses once per level, so 10,000 levels raised `RecursionError`, which no caller took
for a bad record, and a few hundred levels decoded but could not be encoded again deeper
in a stack."""


class Record(msgspec.Struct, frozen=True, tag_field="type", kw_only=True, gc=False):
    """Base of every record tagged on disk. Subclasses set ``tag=`` and may bump ``v``.

    ``v``'s default is the version this code writes; a line without ``v`` is version 1.

    ``gc=False``: records hold only builtins and cannot form reference cycles, so the
    garbage collector need not track them; decoding a large stream is then about twice as
    fast (measured with msgspec), and a fold over 100,000 ledger lines does not trigger GC
    passes.
    """

    v: int = 1


class Document(msgspec.Struct, frozen=True, kw_only=True):
    """Base of a record whose format is fixed elsewhere: no ``type`` on disk.

    A subclass names its tag in the upcaster registry (`record_tag`, never written), the
    field holding its version (`version_field`; its default is the version this code
    writes, ``int`` or a decimal ``str``), and the version a document without that field is
    taken to be (`missing_version`; None refuses such a document).
    """

    record_tag: ClassVar[str]
    version_field: ClassVar[str]
    missing_version: ClassVar[int | str | None] = None


class Untagged(NamedTuple):
    """How a codec reads a JSON object without ``"type"``: as `version` of `tag`.

    For files written before their records were tagged, and for another writer's untagged
    form of one of ours (the Neuron plugin's ``meta.json``); `form` names it in errors.
    """

    tag: str
    version: int
    form: str = "the untagged form"


# ------------------------------------------------------------------ encoding

_ENCODER = msgspec.json.Encoder()
encode_into = _ENCODER.encode_into
"""Encode a record into a reused bytearray (truncated to the record): the hot paths that
append a line per event (`EventLog.append`, the manifest ledger) avoid allocating it."""


def encode(record: Any) -> bytes:
    """One record as compact JSON (no newline)."""
    return _ENCODER.encode(record)


def encode_line(record: Any) -> bytes:
    """One record as a JSON line ending in a newline."""
    return _ENCODER.encode(record) + b"\n"


def encode_document(record: Any, *, indent: int = 2) -> bytes:
    """One record as indented JSON, newline-terminated: for files people read too."""
    return msgspec.json.format(_ENCODER.encode(record), indent=indent) + b"\n"


# ------------------------------------------------------------------ upcasters

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
"""Rewrites the raw dict of one version as the next; a ValueError rejects the record."""
_UPCASTERS: dict[tuple[str, int], Upcaster] = {}


def register_upcaster(tag: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    """Register the function that rewrites version `from_version` of `tag` as the next one.

    `tag` is a `Record`'s tag or a `Document`'s ``record_tag``. The codec sets the version
    field itself after each step; a decimal-string version (the manifest's ``"1"``) is
    registered by its number.
    """

    def deco(fn: Upcaster) -> Upcaster:
        _UPCASTERS[(tag, from_version)] = fn
        return fn

    return deco


# ------------------------------------------------------------------ decoding

_STRUCTURE = bytes.maketrans(b"[{]}", b"(())")
"""Opening brackets as ``(``, closing ones as ``)``; with `_NOT_STRUCTURE` deleted, what is
left of a JSON text is its brackets, its quotes and its backslashes (escapes)."""
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'[]{}"\\')


def nesting_problem(data: bytes, limit: int = MAX_DEPTH) -> str | None:
    """Why `data` nests too deep to be decoded safely (arrays and objects deeper than
    `limit`, or brackets outside strings that do not balance), or None.

    Cheap where it runs on every cache hit (about a microsecond for an entry record of a
    few files; benchmarks/RESULTS.md): C-speed bytes operations only, no Python loop per
    byte. Everything but brackets, quotes and backslashes is deleted in one `translate`;
    at most `limit` opening brackets left cannot nest deeper. Otherwise escapes are
    dropped (when there is a backslash at all), the strings removed (a string without
    brackets is then ``""``) and innermost bracket pairs at most `limit` times: what is
    left then nests deeper than `limit`.
    """
    kept = data.translate(_STRUCTURE, _NOT_STRUCTURE)
    if kept.count(b"(") <= limit:  # so few opening brackets cannot nest deeper
        return None
    if b"\\" in kept:  # escapes: drop escaped backslashes, then escaped quotes
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
        kept = data.translate(_STRUCTURE, _NOT_STRUCTURE)
    kept = kept.replace(b'""', b"")
    if b'"' in kept:  # a string held brackets: every other piece is outside the strings
        kept = b"".join(kept.split(b'"')[::2])
    for _ in range(limit):
        if not kept:
            return None
        fewer = kept.replace(b"()", b"")
        if len(fewer) == len(kept):
            return "not JSON: its brackets do not balance"
        kept = fewer
    return f"nested deeper than {limit} levels" if kept else None


@dataclass
class Decoded:
    """The result of decoding a stream: the records, and how many lines were skipped."""

    records: list[Any] = field(default_factory=list)
    skipped: int = 0
    errors: list[str] = field(default_factory=list)

    def extend(self, other: Decoded) -> None:
        self.records.extend(other.records)
        self.skipped += other.skipped
        self.errors.extend(other.errors)


@dataclass(frozen=True)
class _Kind:
    """What the codec knows of one record type."""

    type: type[Any]
    tag: str
    field: str  # where the version is
    current: int | str  # the version this code writes
    missing: int | str | None  # the version of an object without `field`; None: refused


def _default_of(cls: type[Any], name: str) -> Any:
    for info in msgspec.structs.fields(cls):
        if info.name == name:
            if info.default is msgspec.NODEFAULT:
                break
            return info.default
    raise TypeError(f"{cls.__name__}.{name} must default to the version this code writes")


def _kind_of(cls: type[Any]) -> _Kind:
    if isinstance(cls, type) and issubclass(cls, Record):
        tag = cls.__struct_config__.tag
        if not isinstance(tag, str):
            raise TypeError(f"{cls.__name__} needs a string tag= to be read")
        current = _default_of(cls, "v")
        if cls.__struct_config__.omit_defaults and current != 1:
            raise TypeError(
                f"{cls.__name__}: omit_defaults leaves v={current} out of every line, and a "
                "line without v is version 1; turn omit_defaults off to bump the version"
            )
        return _Kind(cls, tag, "v", current, 1)
    if isinstance(cls, type) and issubclass(cls, Document):
        current = _default_of(cls, cls.version_field)
        return _Kind(cls, cls.record_tag, cls.version_field, current, cls.missing_version)
    raise TypeError(f"{cls!r} is neither a Record nor a Document")


def _number(version: object) -> int | None:
    if type(version) is int:
        return version
    if isinstance(version, str) and version.isdigit():
        return int(version)
    return None


class RecordCodec(Generic[T]):
    """Reads a closed set of record types: several `Record` kinds, or one `Document`.

    Straight into the structs where that cannot misread (every kind's version-less form is
    its current version), checked and upcast otherwise and whenever a record is not current.
    """

    def __init__(self, types: type[T] | Sequence[type[T]], *,
                 untagged: Untagged | None = None) -> None:  # fmt: skip
        classes: tuple[type[Any], ...] = (types,) if isinstance(types, type) else tuple(types)
        if not classes:
            raise ValueError("RecordCodec needs at least one record type")
        kinds = [_kind_of(cls) for cls in classes]
        self._by_tag = {kind.tag: kind for kind in kinds}
        self._by_type = {kind.type: kind for kind in kinds}
        if len(self._by_tag) != len(kinds):
            raise TypeError("two record types of one codec share a tag")
        documents = [kind for kind in kinds if issubclass(kind.type, Document)]
        if documents and (len(kinds) > 1 or untagged is not None):
            raise TypeError("a Document is read alone: no union, no untagged form")
        if untagged is not None and untagged.tag not in self._by_tag:
            raise ValueError(f"untagged form of {untagged.tag!r}, which the codec does not read")
        self._document = documents[0] if documents else None
        self._untagged = untagged
        union: Any = classes[0] if len(classes) == 1 else Union[classes]  # noqa: UP007
        self._decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(union)
        self._typed = all(kind.missing == kind.current for kind in kinds) and (
            untagged is None or untagged.version == self._by_tag[untagged.tag].current
        )
        fields, currents = {k.field for k in kinds}, {k.current for k in kinds}
        self._one_version = (
            (operator.attrgetter(fields.pop()), currents.pop())
            if len(fields) == 1 and len(currents) == 1
            else None
        )

    def _all_current(self, records: list[Any]) -> bool:
        if self._one_version is not None:
            version_of, current = self._one_version
            return operator.countOf(map(version_of, records), current) == len(records)
        by_type = self._by_type
        return all(getattr(r, by_type[type(r)].field) == by_type[type(r)].current for r in records)

    def decode(self, data: bytes, *, source: str = "record") -> T:
        """One record from JSON bytes, upcast to the current version, or `RecordError`
        (also for a record nested deeper than `MAX_DEPTH`: `nesting_problem`)."""
        if isinstance(data, str):
            data = data.encode()
        deep = nesting_problem(data)
        if deep is not None:
            raise RecordError(source, deep)
        if self._typed:
            try:
                record = self._decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                pass
            else:
                one = self._one_version  # inlined: every local cache hit decodes a record
                if one is not None and one[0](record) == one[1]:
                    return record
                if one is None and self._all_current([record]):
                    return record
        try:
            raw = msgspec.json.decode(data)
        except msgspec.DecodeError as exc:
            raise RecordError(source, f"not JSON (garbage or truncated): {exc}") from exc
        except RecursionError:  # deep in a stack: refused here, never seen as a crash
            raise RecordError(source, "nested too deep to decode") from None
        return self.convert(raw, source=source)

    def convert(self, raw: Any, *, source: str = "record") -> T:
        """One record from parsed JSON (a record nested in another's field, or bytes
        already decoded), upcast to the current version, or `RecordError`."""
        if not isinstance(raw, dict):
            raise RecordError(source, f"not a JSON object but a {type(raw).__name__}")
        kind, version, prefix = self._identify(raw, source)
        current = _number(kind.current)
        number = _number(version) if type(version) is type(kind.current) else None
        if version is None:
            raise RecordError(source, f"{prefix}has no {kind.field} "
                                      f"(this version reads {kind.current!r})")  # fmt: skip
        if number is None or current is None or number > current:
            newer = " (written by a newer version?)" if number is not None else ""
            raise RecordError(source, f"{prefix}{kind.field} {version!r} is not supported: "
                                      f"this version reads {kind.current!r}{newer}")  # fmt: skip
        while number < current:
            upcast = _UPCASTERS.get((kind.tag, number))
            if upcast is None:
                raise RecordError(source, f"{prefix}{kind.field} {version!r} is not supported: "
                                          f"this version reads {kind.current!r}, and nothing "
                                          f"upcasts {kind.tag} {number}")  # fmt: skip
            try:
                raw = upcast(dict(raw))
            except ValueError as exc:
                raise RecordError(source, f"{prefix}{exc}") from exc
            number += 1
            raw[kind.field] = number if isinstance(kind.current, int) else str(number)
        try:
            return msgspec.convert(raw, kind.type)
        except msgspec.ValidationError as exc:
            raise RecordError(source, f"{prefix}not a valid {kind.tag} record: {exc}") from exc

    def _identify(self, raw: dict[str, Any], source: str) -> tuple[_Kind, Any, str]:
        """The kind, the version and the error prefix of a raw record."""
        if self._document is not None:
            kind = self._document
            return kind, raw.get(kind.field, kind.missing), ""
        untagged = self._untagged
        if "type" not in raw and untagged is not None:
            prefix = f"no record tag, so it was read as {untagged.form}, and is not that either: "
            return self._by_tag[untagged.tag], untagged.version, prefix
        tag = raw.get("type")
        kind_or_none = self._by_tag.get(tag) if isinstance(tag, str) else None
        if kind_or_none is None:
            known = ", ".join(sorted(self._by_tag))
            raise RecordError(source, f"record type {tag!r} is not one this reader knows ({known})")
        return kind_or_none, raw.get("v", 1), ""

    def decode_lines(self, data: bytes | Iterable[bytes]) -> Decoded:
        """Decode a JSONL blob (or an iterable of lines), skipping lines that don't decode.

        A clean blob is decoded in one call (msgspec's JSON-lines decoder), several times
        faster than line by line; only a blob with a bad or older line pays for the per-line
        path.
        """
        if isinstance(data, bytes) and self._typed:
            try:
                records = self._decoder.decode_lines(data)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                pass  # the per-line path below refuses the deep line alone
            else:
                if self._all_current(records):
                    return Decoded(records=records)
        out = Decoded()
        lines = data.split(b"\n") if isinstance(data, bytes) else data
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                out.records.append(self.decode(line, source=f"line {lineno}"))
            except RecordError as exc:
                out.skipped += 1
                if len(out.errors) < MAX_ERRORS:
                    out.errors.append(str(exc))
        return out

    def read(self, store: ByteStore, key: str) -> T | None:
        """The record at `key` of `store`; None when absent, `RecordError` naming
        ``<store url>/<key>`` when it does not read - a file larger than `RECORD_MAX_BYTES`
        (`RecordTooLarge`, never read whole) or not a regular file (`NotRegularFile`) too."""
        data = store.read(key, max_size=RECORD_MAX_BYTES)
        if data is None:
            return None
        url = store.url if store.url.endswith("/") else store.url + "/"
        return self.decode(data, source=url + key)


# ------------------------------------------------------------------ the layer's own


class CommitRecord(Record, frozen=True, tag="commit"):
    """``<final>/.commit`` on a store without atomic rename: the version published.

    Created with create-if-absent, so the first writer's version is the one published.
    ``empty``: the version was staged without files (otherwise a record naming a version
    that has none is broken, and the next commit replaces it); records written before
    it existed read as False, and readers that predate it ignore it.
    """

    version: str
    committed_at: float
    empty: bool = False


COMMIT_RECORDS = RecordCodec(
    CommitRecord, untagged=Untagged("commit", 1, "a commit record from before records had tags")
)


class LeaseRecord(Record, frozen=True, tag="lease"):
    """One generation of a lease: who holds it, how it renews, whether it was let go.

    ``expires`` is the holder's wall clock plus its period: written for readers that
    predate the monotonic rule (they judge by it) and read only by ``cache gc``, never by a
    waiter (``locks.py``). ``renewal`` goes up with every record the holder writes, so each
    renewal changes the bytes a waiter watches even when the holder's clock stands still;
    ``duration`` is the holder's lease period (it renews every third of it). Both read as 0
    from records written before them (a waiter then uses its own period), and readers that
    predate them ignore them: the version stays 1.
    """

    owner: str
    generation: int
    expires: float  # epoch seconds on the holder's clock; 0 once released
    released: bool = False
    renewal: int = 0
    duration: float = 0.0


LEASE_RECORDS = RecordCodec(
    LeaseRecord, untagged=Untagged("lease", 1, "a lease record from before records had tags")
)
