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
and `copy_verified`, which checks every file of a fetch as it copies it (BLAKE3 when
recorded, else SHA-256; see `_copy_local_blake3` for the local-disk path).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, Protocol

import msgspec
from blake3 import blake3 as Blake3

from vllm_neuron.backends import Staging, Store, join

ENTRY_RECORD = "entry.json"
ENTRY_SCHEMA_VERSION = 1


# gc=False: records hold only strings and numbers (no cycles), and decoding them is on the
# hot path of every local hit; untracked structs decode markedly faster (about 1.8x in a
# msgspec measurement).
# omit_defaults: a digest without BLAKE3 encodes exactly as before the field existed.
class FileDigest(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    size: int
    sha256: str
    blake3: str | None = None  # absent from records written before BLAKE3 was added


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


DIGEST_CHUNK = 4 << 20


def file_digest(path: str) -> FileDigest:
    """Size, SHA-256 and BLAKE3 of one file, from one read of it.

    Each chunk feeds both hashers; on a large file SHA-256 (the slower) runs in a helper
    thread while BLAKE3 and the read of the next chunk run in this one (both hashers
    release the GIL), so the two digests cost about what SHA-256 alone used to.
    """
    sha, b3 = hashlib.sha256(), Blake3()
    size = 0
    with open(path, "rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size <= DIGEST_CHUNK:
            data = f.read()
            return FileDigest(size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                              blake3=Blake3(data).hexdigest())
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


def digest_directory(path: str) -> dict[str, FileDigest]:
    """Size, SHA-256 and BLAKE3 of every file under `path` ('/'-separated relative keys)."""
    out: dict[str, FileDigest] = {}
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, path).replace(os.sep, "/")
            if rel == ENTRY_RECORD:
                continue
            out[rel] = file_digest(full)
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


def _mismatch(digest: FileDigest, actual: FileDigest) -> str | None:
    """Which recorded digest `actual` fails, or None (BLAKE3 only when recorded)."""
    if actual.sha256 != digest.sha256:
        return "SHA-256"
    if digest.blake3 is not None and actual.blake3 != digest.blake3:
        return "BLAKE3"
    return None


def check_checksums(store: Store, prefix: str, record: EntryRecord) -> None:
    """Every listed file matches its recorded size and SHA-256, and BLAKE3 when recorded.

    Both digests come from one read of each file. Checking BLAKE3 too means that an entry
    which passes `cache verify` (or is promoted) also passes a fetch, which checks BLAKE3.
    """
    check_sizes(store, prefix, record)
    local = store.local_path(prefix)
    for rel, digest in record.files.items():
        if local is not None:
            actual = file_digest(os.path.join(local, rel))
        else:
            data = store.read(join(prefix, rel)) or b""
            actual = FileDigest(size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                                blake3=Blake3(data).hexdigest())
        failed = _mismatch(digest, actual)
        if failed is not None:
            raise EntryProblem(f"{store.url}/{prefix}: {rel} fails its {failed} check")


# ------------------------------------------------------------------------------ fetch

COPY_CHUNK = 4 << 20
"""Bytes per read on the streaming path (a store without local paths, or no BLAKE3)."""
KERNEL_COPY_MIN = 1 << 20
"""Files from this size on, local disk to local disk with BLAKE3 recorded, are copied by
the kernel (`_copy_local_blake3`); smaller ones go through memory in one read."""
KERNEL_COPY_STEP = 8 << 20
"""Bytes per kernel copy call: how often the copier tells the hasher what it may hash."""
PIPELINE_MIN = 2 * KERNEL_COPY_STEP
"""A file this large that the other files cannot keep the cores busy beside (see
`copy_verified`) is copied by a second thread while this one hashes."""
HASH_PIECE_MAX = 64 << 20


class _Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def _open_source(store: Store, key: str) -> IO[bytes]:
    path = store.local_path(key)
    # Unbuffered on local disk: readinto() of a large buffer is then one read(2).
    return open(path, "rb", buffering=0) if path is not None else store.open_read(key)


def _write_all(fd: int, chunk: memoryview) -> None:
    while chunk:
        chunk = chunk[os.write(fd, chunk):]


def _fallocate_function() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).fallocate64
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int
    return function


_FALLOCATE = _fallocate_function()


def _preallocate(fd: int, size: int) -> None:
    """Give the empty file `fd` its final size, reserving its blocks where that is cheap.

    With the blocks reserved up front (fallocate(2): unwritten extents, nothing zeroed),
    the copy that follows skips the file system's per-page delayed allocation: on ext4 a
    256 MiB copy took about a quarter less time. fallocate(2) is called directly, not
    `os.posix_fallocate`, whose glibc fallback writes every block of a file system that
    lacks it; there, and off Linux, the file is only extended (`ftruncate`). A full disk
    is reported at once rather than after copying as much as fits.
    """
    if _FALLOCATE is not None:
        if _FALLOCATE(fd, 0, 0, size) == 0:
            return
        code = ctypes.get_errno()
        if code in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(code, os.strerror(code))
    os.ftruncate(fd, size)


# copy_file_range / sendfile refusing this pair of files (another file system, an old
# kernel, a file system without the operation): fall back to the next way of copying.
_NO_KERNEL_COPY = frozenset(
    {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOTSOCK}
)


class _SourceShrank(Exception):
    pass


class _KernelCopy:
    """Copies byte ranges between two open files without passing them through Python.

    `copy_file_range` first (a plain in-kernel copy on ext4; a reflink on XFS or btrfs),
    then `sendfile` (any two regular files on Linux; what `shutil.copyfile` uses), then
    `pread`/`pwrite`, each tried when the one before refuses this pair of files.
    """

    def __init__(self, src_fd: int, dst_fd: int) -> None:
        self.src_fd, self.dst_fd = src_fd, dst_fd
        if hasattr(os, "copy_file_range"):
            self.method = "copy_file_range"
        elif sys.platform.startswith("linux"):
            self.method = "sendfile"
        else:
            self.method = "pwrite"

    def copy(self, offset: int, count: int) -> None:
        """Copy bytes [offset, offset + count) to the same offsets of the destination."""
        end = offset + count
        while offset < end:
            n = self._once(offset, end - offset)
            if n == 0:
                raise _SourceShrank
            offset += n

    def _once(self, offset: int, count: int) -> int:
        if self.method == "copy_file_range":
            try:
                return os.copy_file_range(self.src_fd, self.dst_fd, count, offset, offset)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                self.method = "sendfile" if sys.platform.startswith("linux") else "pwrite"
        if self.method == "sendfile":
            try:
                os.lseek(self.dst_fd, offset, os.SEEK_SET)  # sendfile writes at the position
                return os.sendfile(self.dst_fd, self.src_fd, offset, count)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                self.method = "pwrite"
        data = os.pread(self.src_fd, min(count, COPY_CHUNK), offset)
        view = memoryview(data)
        while view:
            view = view[os.pwrite(self.dst_fd, view, offset + len(data) - len(view)):]
        return len(data)


class _Progress:
    """How far the copier thread got, shared with the hashing thread."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.done = 0
        self.error: BaseException | None = None
        self.stop = False


def _copy_and_hash(src_fd: int, dst_fd: int, size: int, *, pipelined: bool) -> str:
    """Copy `size` bytes src -> dst in the kernel, and BLAKE3 of the bytes now in dst.

    The hashed bytes are read back from the destination (through a read-only mapping of
    it; the pages were just written, so they come from the page cache, not the disk),
    never from the source: what is hashed is exactly what the local entry will hold, even
    if the source changed under the copy. The destination is a file in this process's own
    staging directory, which no one else writes or truncates, so reading it through a
    mapping is safe; the source (on a shared remote tier, perhaps NFS) is never mapped,
    because a file truncated by another client under a mapping kills the reader with
    SIGBUS. The source is read once, by the kernel, as a plain copy reads it.

    `pipelined` (a large file with nothing else to do beside it): a second thread copies
    `KERNEL_COPY_STEP` bytes at a time and publishes how far it got, while this thread
    hashes whatever has been copied, with several threads once the copier is done. The
    wall time is then about max(copy, hash), or less, rather than their sum. Otherwise the
    file is copied, then hashed on one thread: the other files' copies and hashes keep the
    other cores busy, and several multithreaded hashes at once only cost more CPU.
    """
    _preallocate(dst_fd, size)
    copier = _KernelCopy(src_fd, dst_fd)
    with mmap.mmap(dst_fd, size, prot=mmap.PROT_READ) as mapped, memoryview(mapped) as view:
        if not pipelined or size < PIPELINE_MIN:
            copier.copy(0, size)
            return Blake3(view).hexdigest()
        hasher = Blake3(max_threads=Blake3.AUTO)
        progress = _Progress()

        def copy_all() -> None:
            try:
                offset = 0
                while offset < size and not progress.stop:
                    step = min(KERNEL_COPY_STEP, size - offset)
                    copier.copy(offset, step)
                    offset += step
                    with progress.cond:
                        progress.done = offset
                        progress.cond.notify()
            except BaseException as exc:  # noqa: BLE001 - handed to the hashing thread
                with progress.cond:
                    progress.error = exc
                    progress.cond.notify()

        thread = threading.Thread(target=copy_all, name="vllm-neuron-fetch-copy", daemon=True)
        thread.start()
        hashed = 0
        try:
            while hashed < size:
                with progress.cond:
                    while progress.done == hashed and progress.error is None:
                        progress.cond.wait()
                    if progress.error is not None:
                        raise progress.error
                    done = progress.done
                end = min(done, hashed + HASH_PIECE_MAX)
                hasher.update(view[hashed:end])
                hashed = end
        finally:
            with progress.cond:
                progress.stop = True
            thread.join()
    return hasher.hexdigest()


def _copy_local_blake3(src_path: str, dst_path: str, rel: str, digest: FileDigest,
                       where: str, *, pipelined: bool) -> None:
    """Copy one file between two local-disk paths, checking its size and BLAKE3.

    See `_copy_and_hash` for how: a kernel copy, and BLAKE3 of the copy as it lands.
    """
    try:
        src_fd = os.open(src_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise EntryProblem(f"{where}: {rel} is missing") from None
    try:
        size = os.fstat(src_fd).st_size
        if size != digest.size:
            raise EntryProblem(f"{where}: {rel} has {size} bytes, the record says {digest.size}")
        os.makedirs(os.path.dirname(dst_path), exist_ok=True)
        dst_fd = os.open(dst_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC
                         | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            actual = _copy_and_hash(src_fd, dst_fd, size, pipelined=pipelined)
        except _SourceShrank:
            raise EntryProblem(f"{where}: {rel} shrank while it was being copied") from None
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)
    if actual != digest.blake3:
        raise EntryProblem(f"{where}: {rel} fails its BLAKE3 check")


def _copy_one(src: Store, src_key: str, dst: Staging, rel: str, digest: FileDigest,
              where: str, pipelined: bool = False) -> None:
    """Copy one file into the staging area, checking its size and checksum.

    BLAKE3 when the record has it, else SHA-256 (a record from before BLAKE3). Between
    two local-disk tiers a file of `KERNEL_COPY_MIN` bytes or more with BLAKE3 recorded
    is copied by the kernel (`_copy_local_blake3`); anything else streams through memory
    in one pass: each chunk is read, hashed and written, so the copy is never read back.
    """
    dst_path = dst.store.local_path(dst.key(rel))
    if digest.blake3 is not None and dst_path is not None and digest.size >= KERNEL_COPY_MIN:
        src_path = src.local_path(src_key)
        if src_path is not None:
            _copy_local_blake3(src_path, dst_path, rel, digest, where, pipelined=pipelined)
            return
    hasher: _Hasher
    if digest.blake3 is not None:
        hasher, expected, name = Blake3(), digest.blake3, "BLAKE3"
    else:
        hasher, expected, name = hashlib.sha256(), digest.sha256, "SHA-256"
    size = 0
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
                    hasher.update(view[:n])  # releases the GIL: other files copy meanwhile
                    _write_all(fd, view[:n])
                    size += n
                    if size > digest.size:
                        break  # longer than its record: already wrong
            finally:
                os.close(fd)
        else:
            data = reader.read()
            hasher.update(data)
            size = len(data)
            dst.write(rel, data)
    if size != digest.size:
        raise EntryProblem(f"{where}: {rel} has {size} bytes, the record says {digest.size}")
    if hasher.hexdigest() != expected:
        raise EntryProblem(f"{where}: {rel} fails its {name} check")


def copy_verified(
    src: Store, src_prefix: str, dst: Staging, record: EntryRecord, *, workers: int = 0
) -> None:
    """Copy every file of `record` from `src_prefix` into `dst`, checking size and checksum.

    Each file is checked as it is copied, never re-read from the source (`_copy_one`),
    files in parallel (hashing and kernel copies release the GIL), largest first. A file
    larger than its share of the work (its size times `workers` exceeds the entry's) is
    pipelined within itself (`_copy_and_hash`): the other files could not keep the other
    cores busy while it is copied and hashed.
    `EntryProblem` names the first file that is missing, has the wrong size or the wrong
    checksum; the staging area is then the caller's to abort.
    """
    where = f"{src.url}/{src_prefix}"
    items = sorted(record.files.items(), key=lambda item: -item[1].size)
    if not items:
        return
    workers = workers or min(len(items), max(2, os.cpu_count() or 2), 8)
    total = record.total_size
    jobs = [(join(src_prefix, rel), rel, digest, workers == 1 or digest.size * workers > total)
            for rel, digest in items]
    if workers == 1:
        for job in jobs:
            _copy_one(src, job[0], dst, job[1], job[2], where, job[3])
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_copy_one, src, key, dst, rel, digest, where, pipelined)
                   for key, rel, digest, pipelined in jobs]
        for future in futures:
            future.result()
