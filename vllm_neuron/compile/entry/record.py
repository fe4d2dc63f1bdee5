"""A compile-cache entry's commit record, and how an entry is checked.

Every entry directory holds ``entry.json``: the key, the per-component key hashes (so two
keys can be explained), which toolchain produced it, the toolchain's own metadata (artifact
file name, output shapes, ...), and every other file with its size, SHA-256 and BLAKE3.
The record is written last inside the staged directory, and the directory is published
atomically, so an entry without a readable record is never complete.

Two digests per file, both computed from one read when the entry is built: SHA-256 (the
digest every record has; `cache verify` and promotion check it) and BLAKE3 (cryptographic
too, and about twice as fast here: what a fetch checks, so that a verified fetch keeps up
with a plain copy). Records written before BLAKE3 was added have SHA-256 only; they load,
fetch and verify with SHA-256.

Three levels of checking, by cost: `check_sizes` (one stat per file; every local hit),
`check_checksums` (every promotion, and `cache verify`: SHA-256, and BLAKE3 when recorded),
and the storage layer's `copy_verified`, which checks every file of a fetch as it copies
it (BLAKE3 when recorded, else SHA-256). All three are store operations: this module
reads and checks no file itself, so an entry is checked the same way on every backend.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec

from vllm_neuron.backends import FileDigest, IntegrityError, Store, join
from vllm_neuron.backends.digests import mismatch
from vllm_neuron.backends.records import (
    RECORD_MAX_BYTES,
    Document,
    RecordCodec,
    RecordError,
    encode,
)

ENTRY_RECORD = "entry.json"
ENTRY_SCHEMA_VERSION = 1
ENTRY_TAG = "compile-entry"  # the upcaster registry's name for entry.json


class FetchedFrom(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """In a local tier's copy of a fetched entry: the remote it came from, when, and the
    trusted key that verified its signature then (None: fetched unsigned or untrusted,
    under a policy that let it in). A local hit judges a fetched entry by this alone -
    no file read, no signature check - so a key removed from the trusted set revokes its
    entries at no cost to a hit (docs/trust.md)."""

    remote: str
    at: float
    verified_by: str | None = None


# gc=False: records hold only strings and numbers (no cycles), and decoding them is on the
# hot path of every local hit; untracked structs decode markedly faster (about 1.8x in a
# msgspec measurement). A file's digest is the storage layer's `FileDigest` (size,
# SHA-256, and BLAKE3 when recorded), which `Store.digest` computes.
class EntryRecord(Document, frozen=True, kw_only=True, gc=False):
    """The commit record of one cache entry.

    A `Document` of the record layer: docs/compile-cache.md fixes its fields, and its
    version is ``schema``, now checked (a later version is refused, or upcast once an
    upcaster for ``ENTRY_TAG`` is registered). Every record we wrote has ``schema``; one
    without it is taken as version 1, which keeps the typed decode on every local hit.
    """

    record_tag = ENTRY_TAG
    version_field = "schema"
    missing_version = ENTRY_SCHEMA_VERSION

    schema: int = ENTRY_SCHEMA_VERSION
    key: str
    components: dict[str, str] = msgspec.field(default_factory=dict)
    toolchain: str
    target: str
    created: float
    compile_seconds: float
    files: dict[str, FileDigest]
    meta: dict[str, Any] = msgspec.field(default_factory=dict)
    # Only in a local tier's copy of a fetched entry; never written otherwise (UNSET fields
    # are left out of the encoding), and left out of what a signature covers.
    fetched: FetchedFrom | msgspec.UnsetType = msgspec.UNSET
    # Only in a local tier's copy of an entry this node compiled (the host's name): its own
    # code, trusted without a signature. Never leaves the node (a promotion strips it).
    compiled_on: str | msgspec.UnsetType = msgspec.UNSET
    # Only in a local tier's record: this node's seal over the rest of the record (an
    # HMAC under the tier's node key, compile/trust/origin.py), without which `fetched` and
    # `compiled_on` mean nothing (the entry is of unknown origin). Never leaves the node.
    sealed: str | msgspec.UnsetType = msgspec.UNSET

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files.values())


ENTRY_RECORDS = RecordCodec(EntryRecord)


def encode_record(record: EntryRecord) -> bytes:
    return encode(record)


def decode_record(data: bytes, *, source: str = ENTRY_RECORD) -> EntryRecord:
    """`data` as a commit record; `RecordError` naming `source` when it does not read."""
    return ENTRY_RECORDS.decode(data, source=source)


class EntryProblem(Exception):
    """An entry failed a check; the message names the entry and the file."""


def build_record(
    *,
    key: str,
    components: Mapping[str, str],
    toolchain: str,
    target: str,
    compile_seconds: float,
    files: Mapping[str, FileDigest],
    meta: Mapping[str, Any],
) -> EntryRecord:
    """The commit record for a freshly compiled entry whose files have these digests.

    The record itself is never one of its files (a toolchain writing an ``entry.json``
    of its own would have it replaced by the record).
    """
    return EntryRecord(
        key=key,
        components=dict(components),
        toolchain=toolchain,
        target=target,
        created=time.time(),
        compile_seconds=compile_seconds,
        files={rel: d for rel, d in sorted(files.items()) if rel != ENTRY_RECORD},
        meta=dict(meta),
    )


def read_record(store: Store, prefix: str) -> EntryRecord:
    """The commit record under `prefix`; `EntryProblem` when missing or unreadable (also
    when larger than `RECORD_MAX_BYTES` or not a regular file: refused unread)."""
    try:
        data = store.read(join(prefix, ENTRY_RECORD), max_size=RECORD_MAX_BYTES)
    except RecordError as exc:
        raise EntryProblem(f"{exc.source} is unreadable: {exc.problem}") from exc
    if data is None:
        raise EntryProblem(f"{store.url}/{prefix}: {ENTRY_RECORD} is missing")
    try:
        return decode_record(data, source=f"{store.url}/{prefix}/{ENTRY_RECORD}")
    except RecordError as exc:
        raise EntryProblem(f"{exc.source} is unreadable: {exc.problem}") from exc


def check_sizes(store: Store, prefix: str, record: EntryRecord) -> None:
    """Every listed file exists with its recorded size (one stat each on local disk).

    The hot path of every local hit: one store operation for the whole entry.
    """
    try:
        store.check_sizes(prefix, record.files)
    except IntegrityError as exc:
        raise EntryProblem(str(exc)) from None


def check_checksums(store: Store, prefix: str, record: EntryRecord) -> None:
    """Every listed file matches its recorded size and SHA-256, and BLAKE3 when recorded.

    Both digests come from one read of each file (`Store.digest`). Checking BLAKE3 too
    means that an entry which passes `cache verify` (or is promoted) also passes a fetch,
    which checks BLAKE3.
    """
    check_sizes(store, prefix, record)
    for rel, digest in record.files.items():
        actual = store.digest(join(prefix, rel))
        if actual is None:
            raise EntryProblem(f"{store.url}/{prefix}: {rel} is missing")
        failed = mismatch(digest, actual)
        if failed is not None:
            raise EntryProblem(f"{store.url}/{prefix}: {rel} fails its {failed} check")
