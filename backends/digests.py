"""What a file's content is: its size, SHA-256 and BLAKE3, both digests from one read.

`FileDigest` is what `StoreBase.digest` returns and what the compile cache keeps per file
in its entry records (so it is a msgspec struct, encoded exactly as those records always
have been). Two digests: SHA-256 (what every record has; a full verification checks it)
and BLAKE3 (cryptographic too, and about twice as fast here: what a verified copy checks,
so that it keeps up with a plain copy). A digest without BLAKE3 is one recorded before
BLAKE3 was added.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Protocol

import msgspec
from blake3 import blake3 as Blake3

DIGEST_CHUNK = 4 << 20
"""Bytes per read when digesting; a file no larger than this is digested from one read."""


# gc=False: digests hold only strings and numbers (no cycles), and decoding entry records
# that hold them is on the hot path of every cache hit; untracked structs decode markedly
# faster (about 1.8x in a msgspec measurement).
# omit_defaults: a digest without BLAKE3 encodes exactly as before the field existed.
class FileDigest(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """Size, SHA-256 and (when recorded) BLAKE3 of one file."""

    size: int
    sha256: str
    blake3: str | None = None  # absent from records written before BLAKE3 was added


class Expected(Protocol):
    """What a check needs to know of a file: its size, and the digests it must match.

    `FileDigest` is one; a checksum that is None is not checked.
    """

    @property
    def size(self) -> int: ...

    @property
    def sha256(self) -> str | None: ...

    @property
    def blake3(self) -> str | None: ...


def digest_bytes(data: bytes | memoryview) -> FileDigest:
    return FileDigest(size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                      blake3=Blake3(data).hexdigest())


def digest_stream(reader: IO[bytes]) -> FileDigest:
    """Size, SHA-256 and BLAKE3 of everything `reader` yields, read once in chunks."""
    sha, b3 = hashlib.sha256(), Blake3()
    size = 0
    while chunk := reader.read(DIGEST_CHUNK):
        sha.update(chunk)
        b3.update(chunk)
        size += len(chunk)
    return FileDigest(size=size, sha256=sha.hexdigest(), blake3=b3.hexdigest())


def file_digest(path: str) -> FileDigest:
    """Size, SHA-256 and BLAKE3 of one local file, from one read of it.

    Each chunk feeds both hashers; on a large file SHA-256 (the slower) runs in a helper
    thread while BLAKE3 and the read of the next chunk run in this one (both hashers
    release the GIL), so the two digests cost about what SHA-256 alone used to.
    FileNotFoundError when there is no such file; `NotRegularFile` when it is a symbolic
    link, a FIFO, a device or a socket (`regular.open_regular`: never followed, never
    waited on).
    """
    from .regular import open_regular  # here: regular -> errors, never back to digests

    sha, b3 = hashlib.sha256(), Blake3()
    size = 0
    fd, first_size = open_regular(path)
    with open(fd, "rb", buffering=0) as f:
        if first_size <= DIGEST_CHUNK:
            return digest_bytes(f.read(DIGEST_CHUNK + 1))
        buffers = [bytearray(DIGEST_CHUNK), bytearray(DIGEST_CHUNK)]
        with ThreadPoolExecutor(max_workers=1) as helper:
            n = f.readinto(buffers[0])
            i = 0
            while n:
                chunk = memoryview(buffers[i])[:n]
                pending = helper.submit(sha.update, chunk)
                b3.update(chunk)
                size += n
                i ^= 1
                n = f.readinto(buffers[i])  # the other buffer: SHA-256 may still read this one
                pending.result()
    return FileDigest(size=size, sha256=sha.hexdigest(), blake3=b3.hexdigest())


def mismatch(expected: Expected, actual: FileDigest) -> str | None:
    """Which digest of `expected` `actual` fails ("SHA-256", "BLAKE3"), or None.

    A digest that `expected` does not have is not checked.
    """
    if expected.sha256 is not None and actual.sha256 != expected.sha256:
        return "SHA-256"
    if expected.blake3 is not None and actual.blake3 != expected.blake3:
        return "BLAKE3"
    return None
