"""`copy_verified`: copy files between two stores, checking each one's size and checksum.

What a compile cache fetch is: every file of a remote entry copied into a local staging
area, each checked as it is copied and never re-read from the source. The check is
BLAKE3 when the expected digest has it, else SHA-256 (a digest recorded before BLAKE3).

Two paths, chosen from the stores' capabilities, never from their types:

* **kernel copy** (both stores have ``local_paths``, BLAKE3 expected, a file of
  `KERNEL_COPY_MIN` bytes or more): the kernel copies (`copy_file_range`, falling back to
  `sendfile`, then `pread`/`pwrite`) into a destination reserved with `fallocate`, and
  BLAKE3 is computed from the destination as it lands (see `_copy_and_hash`);
* **stream** (anything else): each chunk is read once, hashed and written.

A file that is missing, of the wrong size or fails its checksum raises `IntegrityError`
naming it; an I/O error of either store is raised as it is (the caller tells "the source
is corrupt" from "the source is unreachable" by the type).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Protocol

from blake3 import blake3 as Blake3

from ._kernel_copy import KERNEL_COPY_STEP, PIPELINE_MIN, SourceShrank, copy_and_hash
from .digests import Expected
from .errors import IntegrityError, NotRegularFile
from .faults import fault_point
from .keys import join
from .operations import where as where_of
from .regular import open_regular, open_regular_inside
from .staging import Staging
from .transfer import Progress, ProgressCounter

if TYPE_CHECKING:
    from .base import StoreBase

__all__ = ["COPY_CHUNK", "KERNEL_COPY_MIN", "KERNEL_COPY_STEP", "PIPELINE_MIN", "check_verified",
           "copy_verified"]

COPY_CHUNK = 4 << 20
"""Bytes per read on the streaming path."""
KERNEL_COPY_MIN = 1 << 20
"""Files from this size on, local disk to local disk with BLAKE3 expected, are copied by
the kernel; smaller ones go through memory in one read."""


class _Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


OnBytes = Callable[[int], None] | None
"""Told of each chunk of a file as it lands (progress within a file); None: not counted."""


def _kernel_copy(src_path: str, dst_path: str, rel: str, expected: Expected, where: str,
                 *, pipelined: bool, on_bytes: OnBytes = None,
                 real_root: str | None = None) -> None:  # fmt: skip
    """Copy one file between two local-disk paths, checking its size and BLAKE3.

    The source is opened as untrusted (`regular.open_regular`): a link, a FIFO or a device
    is this file's defect, never followed nor waited on; exactly its recorded size is
    copied, and a source that grew meanwhile is a defect too."""
    src_fd, size = _open_regular_source(src_path, rel, where, real_root)
    try:
        if size != expected.size:
            raise IntegrityError(where, rel, f"has {size} bytes, expected {expected.size}")
        os.makedirs(os.path.dirname(dst_path), exist_ok=True)
        dst_fd = os.open(dst_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC, 0o644)
        try:
            if on_bytes is None:  # the call every fetch makes, unchanged
                actual = copy_and_hash(src_fd, dst_fd, size, pipelined=pipelined)
            else:
                actual = copy_and_hash(src_fd, dst_fd, size, pipelined=pipelined,
                                       on_bytes=on_bytes)
        except SourceShrank:
            raise IntegrityError(where, rel, "shrank while it was being copied") from None
        finally:
            os.close(dst_fd)
        if os.fstat(src_fd).st_size != size:
            raise IntegrityError(where, rel, "changed size while it was being copied")
    finally:
        os.close(src_fd)
    if actual != expected.blake3:
        raise IntegrityError(where, rel, "fails its BLAKE3 check")


def _open_regular_source(path: str, rel: str, where: str,
                         real_root: str | None = None) -> tuple[int, int]:  # fmt: skip
    """``(descriptor, size)`` of a local source file; `IntegrityError` naming `rel` when it
    is missing or not a regular file (a link, a FIFO, a device: `regular.open_regular`), or,
    given the tier's `real_root`, when the file opened lies outside it (a linked directory:
    checked on the descriptor then read, `regular.open_regular_inside`)."""
    try:
        if real_root is not None:
            return open_regular_inside(real_root, path)
        return open_regular(path)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise IntegrityError(where, rel, "is missing") from None
    except NotRegularFile as exc:
        raise IntegrityError(where, rel, exc.problem) from None


def _open_source(store: StoreBase, key: str, rel: str, where: str,
                 real_root: str | None = None) -> IO[bytes]:  # fmt: skip
    path = store.local_path(key)
    if path is None:
        try:
            return store.open_read(key)
        except FileNotFoundError:
            raise IntegrityError(where, rel, "is missing") from None
    # Unbuffered on local disk: readinto() of a large buffer is then one read(2).
    return open(_open_regular_source(path, rel, where, real_root)[0], "rb", buffering=0)


def _hasher_for(expected: Expected, where: str, rel: str) -> tuple[_Hasher, str, str]:
    """(hasher, the digest it must give, its name): BLAKE3 when expected, else SHA-256."""
    if expected.blake3 is not None:
        return Blake3(), expected.blake3, "BLAKE3"
    if expected.sha256 is not None:
        return hashlib.sha256(), expected.sha256, "SHA-256"
    raise ValueError(f"{where}: {rel} has no checksum to verify")


def _stream(src: StoreBase, src_key: str, dst: Staging, rel: str, expected: Expected,
            where: str, on_bytes: OnBytes = None, real_root: str | None = None) -> None:
    """Copy one file through memory in one pass: each chunk read, hashed and written."""
    hasher, digest, name = _hasher_for(expected, where, rel)
    size = 0
    reader = _open_source(src, src_key, rel, where, real_root)
    dst_path = dst.store.local_path(dst.key(rel))
    with reader:
        if dst_path is not None:
            os.makedirs(os.path.dirname(dst_path), exist_ok=True)
            fd = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC, 0o644)
            try:
                buf = bytearray(min(COPY_CHUNK, expected.size + 1))
                view = memoryview(buf)
                while n := reader.readinto(buf):  # type: ignore[attr-defined]
                    hasher.update(view[:n])  # releases the GIL: other files copy meanwhile
                    chunk = view[:n]
                    while chunk:
                        chunk = chunk[os.write(fd, chunk):]
                    size += n
                    if on_bytes is not None:
                        on_bytes(n)
                    if size > expected.size:
                        break  # longer than expected: already wrong
            finally:
                os.close(fd)
        else:
            data = reader.read(expected.size + 1)  # never more than one byte too many
            hasher.update(data)
            size = len(data)
            dst.write(rel, data)
            if on_bytes is not None:
                on_bytes(size)
    if size != expected.size:
        raise IntegrityError(where, rel, f"has {size} bytes, expected {expected.size}")
    if hasher.hexdigest() != digest:
        raise IntegrityError(where, rel, f"fails its {name} check")


def _copy_one(src: StoreBase, src_key: str, dst: Staging, rel: str, expected: Expected,
              where: str, pipelined: bool, on_bytes: OnBytes = None,
              real_root: str | None = None) -> None:  # fmt: skip
    if (expected.blake3 is not None and expected.size >= KERNEL_COPY_MIN
            and src.capabilities.local_paths and dst.store.capabilities.local_paths):
        src_path, dst_path = src.local_path(src_key), dst.store.local_path(dst.key(rel))
        if src_path is not None and dst_path is not None:
            _kernel_copy(src_path, dst_path, rel, expected, where, pipelined=pipelined,
                         on_bytes=on_bytes, real_root=real_root)
            fault_point("fetch.mid-copy")  # in the copying thread: the others are mid-way
            return
    _stream(src, src_key, dst, rel, expected, where, on_bytes, real_root)
    fault_point("fetch.mid-copy")


def _real_root(src: StoreBase) -> str | None:
    """On a folder store, the real path of its root: every file copied from it must lie
    inside (a linked directory of an entry would lead the copy, and the sizes an error
    names, to node-local files). Checked on each file's descriptor as it is opened, never
    by path before (`regular.open_regular_inside`: a check by path, then an open by name,
    could be told apart by a swap in between). None on a store without local paths."""
    root = src.local_path("") if src.capabilities.local_paths else None
    return None if root is None else os.path.realpath(root)


def copy_verified(src: StoreBase, src_prefix: str, dst: Staging, files: Mapping[str, Expected],
                  *, workers: int = 0, progress: Progress | None = None) -> None:
    """Copy `files` (keys relative to `src_prefix`) into `dst`, checking size and checksum.

    Files in parallel (hashing and kernel copies release the GIL), largest first. A file
    larger than its share of the work (its size times `workers` exceeds the total) is
    pipelined within itself: a second thread copies while this one hashes, since the other
    files could not keep the other cores busy meanwhile. `IntegrityError` names the first
    file that is missing, has the wrong size or the wrong checksum; the staging area is
    then the caller's to abort. `progress(done, total)` is called as chunks land, within
    each file too (see `transfer.Progress`); without it nothing is counted.
    """
    where = where_of(src, src_prefix)
    items = sorted(files.items(), key=lambda item: -item[1].size)
    if not items:
        return
    real_root = _real_root(src)
    workers = workers or min(len(items), max(2, os.cpu_count() or 2), 8)
    total = sum(expected.size for _, expected in items)
    on_bytes = None if progress is None else ProgressCounter(total, progress).add
    jobs = [(join(src_prefix, rel), rel, expected,
             workers == 1 or expected.size * workers > total) for rel, expected in items]
    if workers == 1:
        for key, rel, expected, pipelined in jobs:
            _copy_one(src, key, dst, rel, expected, where, pipelined, on_bytes, real_root)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_copy_one, src, key, dst, rel, expected, where, pipelined,
                               on_bytes, real_root) for key, rel, expected, pipelined in jobs]
        for future in futures:
            future.result()


def check_verified(store: StoreBase, prefix: str, files: Mapping[str, Expected]) -> None:
    """Check `files` (keys relative to `prefix`) as `copy_verified` checks what it copies -
    the size, then BLAKE3 when expected, else SHA-256 - without copying: one read of each.
    `IntegrityError` names the first that is missing, of the wrong size or corrupt. What a
    load from a copy derived from an entry checks before each use (compile/tiers/unpacked.py)."""
    where = where_of(store, prefix)
    for rel, expected in files.items():
        hasher, digest, name = _hasher_for(expected, where, rel)
        reader = _open_source(store, join(prefix, rel), rel, where)
        size = 0
        with reader:
            while chunk := reader.read(COPY_CHUNK):
                hasher.update(chunk)  # releases the GIL
                size += len(chunk)
                if size > expected.size:
                    break  # longer than expected: already wrong
        if size != expected.size:
            raise IntegrityError(where, rel, f"has {size} bytes, expected {expected.size}")
        if hasher.hexdigest() != digest:
            raise IntegrityError(where, rel, f"fails its {name} check")
