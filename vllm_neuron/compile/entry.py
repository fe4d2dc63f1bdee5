"""A compile-cache entry's commit record, and how an entry is checked.

Every entry directory holds ``entry.json``: the key, the per-component key hashes (so two
keys can be explained), which toolchain produced it, the toolchain's own metadata (artifact
file name, output shapes, ...), and every other file with its size and SHA-256. The record
is written last inside the staged directory, and the directory is published atomically, so
an entry without a readable record is never complete.

Three levels of checking, by cost: `check_sizes` (one stat per file; every local hit),
`check_checksums` (every promotion, and `cache verify`), and `copy_verified`, which
checks every checksum of a fetch while it copies (one pass over the bytes, not two).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import msgspec

from vllm_neuron.backends import Staging, Store, join

ENTRY_RECORD = "entry.json"
ENTRY_SCHEMA_VERSION = 1


# gc=False: records hold only strings and numbers (no cycles), and decoding them is on the
# hot path of every local hit; untracked structs decode markedly faster (FACTS.md).
class FileDigest(msgspec.Struct, frozen=True, gc=False):
    size: int
    sha256: str


class EntryRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
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


def check_sizes_at(directory: str, record: EntryRecord, where: str) -> None:
    """`check_sizes` for an entry directory on local disk: one `os.stat` per file.

    The hot path of every local hit, hence plain string joins; `where` names the entry in
    the error message.
    """
    stat = os.stat
    base = directory + "/"
    for rel, digest in record.files.items():
        try:
            size = stat(base + rel).st_size
        except OSError:
            raise EntryProblem(f"{where}: {rel} is missing") from None
        if size != digest.size:
            raise EntryProblem(f"{where}: {rel} has {size} bytes, the record says {digest.size}")


def check_sizes(store: Store, prefix: str, record: EntryRecord) -> None:
    """Every listed file exists with its recorded size (one stat each)."""
    local = store.local_path(prefix)
    if local is not None:
        check_sizes_at(local, record, f"{store.url}/{prefix}")
        return
    for rel, digest in record.files.items():
        info = store.info(join(prefix, rel))
        if info is None:
            raise EntryProblem(f"{store.url}/{prefix}: {rel} is missing")
        if info.size != digest.size:
            raise EntryProblem(
                f"{store.url}/{prefix}: {rel} has {info.size} bytes, the record says "
                f"{digest.size}"
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


COPY_CHUNK = 4 << 20


def _open_source(store: Store, key: str) -> IO[bytes]:
    path = store.local_path(key)
    # Unbuffered on local disk: readinto() of a large buffer is then one read(2).
    return open(path, "rb", buffering=0) if path is not None else store.open_read(key)


def _write_all(fd: int, chunk: memoryview) -> None:
    while chunk:
        chunk = chunk[os.write(fd, chunk):]


def _copy_one(src: Store, src_key: str, dst: Staging, rel: str, digest: FileDigest,
              where: str) -> None:
    """Copy one file into the staging area, hashing the bytes on their way through."""
    sha = hashlib.sha256()
    size = 0
    dst_path = dst.store.local_path(dst.key(rel))
    try:
        reader = _open_source(src, src_key)
    except FileNotFoundError:
        raise EntryProblem(f"{where}: {rel} is missing") from None
    with reader:
        if dst_path is not None:
            os.makedirs(os.path.dirname(dst_path), exist_ok=True)
            fd = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                buf = bytearray(min(COPY_CHUNK, digest.size + 1))
                view = memoryview(buf)
                while n := reader.readinto(buf):  # type: ignore[attr-defined]
                    sha.update(view[:n])  # releases the GIL: other files copy meanwhile
                    _write_all(fd, view[:n])
                    size += n
                    if size > digest.size:
                        break  # longer than its record: already wrong
            finally:
                os.close(fd)
        else:
            data = reader.read()
            sha.update(data)
            size = len(data)
            dst.write(rel, data)
    if size != digest.size:
        raise EntryProblem(f"{where}: {rel} has {size} bytes, the record says {digest.size}")
    if sha.hexdigest() != digest.sha256:
        raise EntryProblem(f"{where}: {rel} fails its SHA-256 check")


def copy_verified(
    src: Store, src_prefix: str, dst: Staging, record: EntryRecord, *, workers: int = 0
) -> None:
    """Copy every file of `record` from `src_prefix` into `dst`, checking size and SHA-256.

    One pass over the bytes (each chunk is hashed on its way through, so the copy is never
    read back), files in parallel (hashing releases the GIL), largest first.
    `EntryProblem` names the first file that is missing, has the wrong size or the wrong
    checksum; the staging area is then the caller's to abort.
    """
    where = f"{src.url}/{src_prefix}"
    items = sorted(record.files.items(), key=lambda item: -item[1].size)
    if not items:
        return
    workers = workers or min(len(items), max(2, os.cpu_count() or 2), 8)
    if workers == 1 or len(items) == 1:
        for rel, digest in items:
            _copy_one(src, join(src_prefix, rel), dst, rel, digest, where)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_copy_one, src, join(src_prefix, rel), dst, rel, digest, where)
                   for rel, digest in items]
        for future in futures:
            future.result()
