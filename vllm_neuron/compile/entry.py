"""A compile-cache entry's commit record, and how an entry is checked.

Every entry directory holds ``entry.json``: the key, the per-component key hashes (so two
keys can be explained), which toolchain produced it, the toolchain's own metadata (artifact
file name, output shapes, ...), and every other file with its size and SHA-256. The record
is written last inside the staged directory, and the directory is published atomically, so
an entry without a readable record is never complete.

Three levels of checking, by cost: `check_sizes` (one stat per file; every local hit),
`check_checksums` (every fetch and promotion, and `cache verify`).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from vllm_neuron.backends import Store, join

ENTRY_RECORD = "entry.json"
ENTRY_SCHEMA_VERSION = 1


class FileDigest(msgspec.Struct, frozen=True):
    size: int
    sha256: str


class EntryRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The commit record of one cache entry."""

    schema: int = ENTRY_SCHEMA_VERSION
    key: str
    components: dict[str, str] = msgspec.field(default_factory=dict)
    toolchain: str
    target: str
    created: float
    compile_seconds: float
    files: dict[str, FileDigest]
    meta: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files.values())


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(EntryRecord)


def encode_record(record: EntryRecord) -> bytes:
    return _ENCODER.encode(record)


def decode_record(data: bytes) -> EntryRecord:
    return _DECODER.decode(data)


class EntryProblem(Exception):
    """An entry failed a check; the message names the entry and the file."""


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def digest_directory(path: str) -> dict[str, FileDigest]:
    """Size and SHA-256 of every file under `path` (keys are '/'-separated, relative)."""
    out: dict[str, FileDigest] = {}
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, path).replace(os.sep, "/")
            if rel == ENTRY_RECORD:
                continue
            out[rel] = FileDigest(size=os.path.getsize(full), sha256=sha256_file(full))
    return dict(sorted(out.items()))


def build_record(
    *,
    key: str,
    components: Mapping[str, str],
    toolchain: str,
    target: str,
    compile_seconds: float,
    directory: str,
    meta: Mapping[str, Any],
) -> EntryRecord:
    """The commit record for a freshly compiled entry staged in `directory`."""
    return EntryRecord(
        key=key,
        components=dict(components),
        toolchain=toolchain,
        target=target,
        created=time.time(),
        compile_seconds=compile_seconds,
        files=digest_directory(directory),
        meta=dict(meta),
    )


def read_record(store: Store, prefix: str) -> EntryRecord:
    """The commit record under `prefix`; `EntryProblem` when missing or unreadable."""
    data = store.read(join(prefix, ENTRY_RECORD))
    if data is None:
        raise EntryProblem(f"{store.url}/{prefix}: {ENTRY_RECORD} is missing")
    try:
        return decode_record(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EntryProblem(f"{store.url}/{prefix}: {ENTRY_RECORD} is unreadable: {exc}") from exc


def check_sizes(store: Store, prefix: str, record: EntryRecord) -> None:
    """Every listed file exists with its recorded size (one stat each)."""
    local = store.local_path(prefix)
    for rel, digest in record.files.items():
        if local is not None:
            try:
                size = os.stat(os.path.join(local, rel)).st_size
            except OSError:
                raise EntryProblem(f"{store.url}/{prefix}: {rel} is missing") from None
        else:
            info = store.info(join(prefix, rel))
            if info is None:
                raise EntryProblem(f"{store.url}/{prefix}: {rel} is missing")
            size = info.size
        if size != digest.size:
            raise EntryProblem(
                f"{store.url}/{prefix}: {rel} has {size} bytes, the record says {digest.size}"
            )


def check_checksums(store: Store, prefix: str, record: EntryRecord) -> None:
    """Every listed file matches its recorded size and SHA-256."""
    check_sizes(store, prefix, record)
    local = store.local_path(prefix)
    for rel, digest in record.files.items():
        if local is not None:
            actual = sha256_file(os.path.join(local, rel))
        else:
            data = store.read(join(prefix, rel))
            actual = hashlib.sha256(data or b"").hexdigest()
        if actual != digest.sha256:
            raise EntryProblem(f"{store.url}/{prefix}: {rel} fails its SHA-256 check")
