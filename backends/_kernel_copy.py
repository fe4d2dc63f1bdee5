"""The fast path of `copy_verified`: a kernel copy between two local files, hashed as it lands.

Between two stores on local disk (`Capabilities.local_paths` on both), a verified copy
must not cost much more than a plain one. So the bytes never pass through Python: the
kernel copies them, and BLAKE3 (which releases the GIL) hashes the destination's pages
while they are still in the page cache, on another core when the file is large.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import threading
from collections.abc import Callable

from blake3 import blake3 as Blake3

KERNEL_COPY_STEP = 8 << 20
"""Bytes per kernel copy call: how often the copier tells the hasher what it may hash."""
PIPELINE_MIN = 2 * KERNEL_COPY_STEP
"""A file this large that the other files cannot keep the cores busy beside (see
`copy_verified`) is copied by a second thread while this one hashes."""
HASH_PIECE_MAX = 64 << 20
_PWRITE_CHUNK = 4 << 20


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


def preallocate(fd: int, size: int) -> None:
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


class SourceShrank(Exception):
    """The source ended before the range being copied did (truncated under the copy)."""


class KernelCopy:
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
                raise SourceShrank
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
        data = os.pread(self.src_fd, min(count, _PWRITE_CHUNK), offset)
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


def copy_and_hash(src_fd: int, dst_fd: int, size: int, *, pipelined: bool,
                  on_bytes: Callable[[int], None] | None = None) -> str:
    """Copy `size` bytes src -> dst in the kernel, and BLAKE3 of the bytes now in dst.

    The hashed bytes are read back from the destination (through a read-only mapping of
    it; the pages were just written, so they come from the page cache, not the disk),
    never from the source: what is hashed is exactly what the destination will hold, even
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
    `SourceShrank` when the source ends early. `on_bytes(n)`, when given, is told of every
    `KERNEL_COPY_STEP` bytes as they land (a progress bar moving within one large file);
    without it the unpipelined copy stays one call.
    """
    preallocate(dst_fd, size)
    copier = KernelCopy(src_fd, dst_fd)
    if size == 0:
        return Blake3().hexdigest()  # mmap refuses an empty mapping
    with mmap.mmap(dst_fd, size, prot=mmap.PROT_READ) as mapped, memoryview(mapped) as view:
        if not pipelined or size < PIPELINE_MIN:
            if on_bytes is None:
                copier.copy(0, size)
            else:
                for offset in range(0, size, KERNEL_COPY_STEP):
                    step = min(KERNEL_COPY_STEP, size - offset)
                    copier.copy(offset, step)
                    on_bytes(step)
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
                    if on_bytes is not None:
                        on_bytes(step)
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
