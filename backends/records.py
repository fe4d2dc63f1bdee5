"""The project's one event codec: frozen, tagged msgspec records as JSON lines.

Every record the layer persists subclasses `Record`. The tag (``"type"``) lets one decoder
read a stream that mixes record kinds; ``v`` is the schema version, so a reader can upcast
an old record explicitly (`register_upcaster`) instead of guessing.

A line that does not decode is skipped and counted (`Decoded.skipped`): a torn line from a
killed writer or one written by a newer version must never make a whole stream unreadable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

R = TypeVar("R", bound="Record")


class Record(msgspec.Struct, frozen=True, tag_field="type", kw_only=True, gc=False):
    """Base of every persisted record. Subclasses set ``tag=`` and may bump ``v``.

    ``gc=False``: records hold only builtins and cannot form reference cycles, so the
    garbage collector need not track them; decoding a large stream is then about twice as
    fast (measured with msgspec), and a fold over 100,000 ledger lines does not trigger GC
    passes.
    """

    v: int = 1


_ENCODER = msgspec.json.Encoder()
encode_into = _ENCODER.encode_into
"""Encode a record into a reused bytearray (truncated to the record): the hot paths that
append a line per event (`EventLog.append`, the manifest ledger) avoid allocating it."""

# (tag, version) -> function turning the raw dict of that version into the current one.
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
_UPCASTERS: dict[tuple[str, int], Upcaster] = {}


def register_upcaster(tag: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    """Register a function that rewrites a version-`from_version` record of `tag` as v+1.

    Versioned documents (`decode_document` with ``tag=``) use the same registry, with a tag
    of their own (e.g. ``"profile-manifest"``) and their version field in place of ``v``.
    """

    def deco(fn: Upcaster) -> Upcaster:
        _UPCASTERS[(tag, from_version)] = fn
        return fn

    return deco


def encode(record: Record) -> bytes:
    """Encode one record as compact JSON (no newline)."""
    return _ENCODER.encode(record)


def encode_line(record: Record) -> bytes:
    """Encode one record as a JSON line ending in a newline."""
    return _ENCODER.encode(record) + b"\n"


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


class RecordCodec:
    """Decodes lines into a closed set of record types (a tagged union)."""

    def __init__(self, types: Sequence[type[Record]]) -> None:
        if not types:
            raise ValueError("RecordCodec needs at least one record type")
        self._types = tuple(types)
        union: Any = self._types[0] if len(self._types) == 1 else _union(self._types)
        self._decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(union)
        self._by_tag = {t.__struct_config__.tag: t for t in self._types}

    def decode(self, data: bytes) -> Any:
        """Decode one JSON document into its record type (raises on a bad document)."""
        try:
            return self._decoder.decode(data)
        except msgspec.ValidationError:
            upcast = self._upcast(data)
            if upcast is None:
                raise
            return upcast

    def _upcast(self, data: bytes) -> Any:
        raw = msgspec.json.decode(data)
        if not isinstance(raw, dict):
            return None
        tag, version = raw.get("type"), raw.get("v", 1)
        if not isinstance(tag, str) or tag not in self._by_tag or not isinstance(version, int):
            return None
        changed = False
        while (tag, version) in _UPCASTERS:
            raw = _UPCASTERS[(tag, version)](dict(raw))
            version += 1
            raw["v"] = version
            changed = True
        if not changed:
            return None
        return msgspec.convert(raw, self._by_tag[tag])

    def decode_lines(self, data: bytes | Iterable[bytes]) -> Decoded:
        """Decode a JSONL blob (or an iterable of lines), skipping lines that don't decode.

        A clean blob is decoded in one call (msgspec's JSON-lines decoder), several times
        faster than line by line; only a blob with a bad line pays for the per-line path.
        """
        if isinstance(data, bytes):
            try:
                return Decoded(records=self._decoder.decode_lines(data))
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                pass
        out = Decoded()
        lines = data.split(b"\n") if isinstance(data, bytes) else data
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                out.records.append(self.decode(line))
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                out.skipped += 1
                if len(out.errors) < 20:
                    out.errors.append(f"line {lineno}: {exc}")
        return out


def _union(types: tuple[type[Record], ...]) -> Any:
    from typing import Union

    return Union[types]  # noqa: UP007 - a runtime union over a tuple of classes


# ------------------------------------------------------------------ documents
# Whole JSON documents (manifests, run specs) rather than event lines: indented for people,
# versioned by a named field, refused rather than misread when the version is unknown.

_DOC = TypeVar("_DOC")


def encode_document(value: Any, *, indent: int = 2) -> bytes:
    """A human-readable JSON document, newline-terminated."""
    return msgspec.json.format(_ENCODER.encode(value), indent=indent) + b"\n"


def decode_document(
    data: bytes,
    type_: type[_DOC],
    *,
    version_field: str,
    supported: object,
    what: str,
    error: type[ValueError] = ValueError,
    tag: str | None = None,
    missing_version: int | None = None,
) -> _DOC:
    """Decode a versioned document; `error` names `what` and the field on any mismatch.

    With `tag`, an older integer version is upcast step by step through the functions
    registered with `register_upcaster(tag, version)` (the same registry as the records'),
    until it reaches `supported`. `missing_version` is the version a document *without*
    `version_field` is taken to be: a format another writer defines without a version
    field (the Neuron plugin's profile manifest) is version 0 of ours and is upcast like
    any old version, instead of being refused. Without it, a missing field is refused as
    before. An upcaster that rejects the document raises ValueError (msgspec's
    ValidationError is one); it is reported as `error`, naming `what`.
    """
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise error(f"{what}: not JSON: {exc}") from exc
    version = raw.get(version_field) if isinstance(raw, dict) else None
    if isinstance(raw, dict) and version_field not in raw and missing_version is not None:
        version = missing_version
    if (
        version != supported
        and tag is not None
        and isinstance(raw, dict)
        and type(version) is int
        and (tag, version) in _UPCASTERS
    ):
        try:
            while version != supported and (tag, version) in _UPCASTERS:
                raw = _UPCASTERS[(tag, version)](dict(raw))
                version += 1
                raw[version_field] = version
        except ValueError as exc:
            raise error(f"{what}: {exc}") from exc
    if version != supported:
        raise error(
            f"{what}: {version_field} {version!r} is not supported "
            f"(this version reads {supported!r})"
        )
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as exc:
        raise error(f"{what}: {exc}") from exc
