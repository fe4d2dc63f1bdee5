"""Copy a tree of files between two stores, in parallel, with progress.

Used to promote a cache entry to the remote tier (`copy_verified` in `verified_copy.py`
is the checked copy a fetch uses). Each file goes through the destination's own write
operation, so the destination decides how a file becomes visible (on local disk: the
storage layer's one temp-and-replace; inside a staging area: written in place, the
publication being atomic): from a source with local paths `put_file` (`shutil.copyfile`,
sendfile on Linux), otherwise `write_from` a stream of the source, so a large artifact
never has to fit in memory twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO

from .faults import fault_point
from .keys import join, validate_prefix
from .regular import lstat_regular, open_regular
from .staging import Staging
from .store import Store

Progress = Callable[[int, int], None]
"""Called with (bytes_done, bytes_total) as the bytes land: after every chunk of a file,
so a single large file moves the count (a 1.4 GiB artifact must not sit at 0 % for its
whole copy), from whichever copying thread landed them."""

PROGRESS_STEP = 8 << 20
"""Bytes per progress report within a file (when a callback is given)."""


class ProgressCounter:
    """The running byte count of a copy, shared by its copying threads.

    Only built when the caller asked for progress: without a callback the copies take
    their plain path and nothing is counted.
    """

    def __init__(self, total: int, progress: Progress) -> None:
        self.total, self.done, self._progress = total, 0, progress
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            self._progress(self.done, self.total)


class _CountingReader:
    """A reader that reports each chunk read to `on_bytes` (the destination's write
    operation reads its source in chunks; one that reads it whole gets chunks too)."""

    def __init__(self, raw: IO[bytes], on_bytes: Callable[[int], None]) -> None:
        self._raw, self._on_bytes = raw, on_bytes

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            parts = []
            while data := self.read(PROGRESS_STEP):
                parts.append(data)
            return b"".join(parts)
        data = self._raw.read(n)
        if data:
            self._on_bytes(len(data))
        return data

    def readable(self) -> bool:
        return True


@dataclass(frozen=True)
class CopyResult:
    files: int
    bytes: int


def copy_file(src: Store, src_key: str, dst: Store | Staging, dst_key: str,
              on_bytes: Callable[[int], None] | None = None) -> int:
    """Copy one file; returns its size. `dst` may be a store or a staging area.

    A reader of a store destination never sees a partial file (the destination's write
    operations are atomic). `on_bytes(n)` is told of the bytes as they land. Into a store
    on local disk the copy then streams through the destination's `write_from` chunk by
    chunk instead of its one-call `put_file`; into an object store it stays `put_file`
    (a streamed write there holds the whole file in memory, a 1.4 GiB NEFF twice over,
    where `put_file` uploads in parts from disk) and the file is counted when it is up.
    Without `on_bytes` nothing changes.
    """
    src_path = src.local_path(src_key)
    if on_bytes is not None and (
            dst.store if isinstance(dst, Staging) else dst).capabilities.local_paths:
        reader = (open(open_regular(src_path)[0], "rb")  # noqa: SIM115 - a link never followed
                  if src_path is not None else src.open_read(src_key))
        with reader:
            size = dst.write_from(dst_key, _CountingReader(reader, on_bytes))  # type: ignore[arg-type]
        fault_point("promote.mid-upload")
        return size
    if src_path is not None:
        st = lstat_regular(src_path)  # a link or a FIFO is never uploaded (NotRegularFile)
        if st is None:
            raise FileNotFoundError(src_path)
        size = st.st_size
        dst.put_file(dst_key, src_path)
        fault_point("promote.mid-upload")  # in the copying thread: the others are mid-way
    else:
        with src.open_read(src_key) as reader:
            size = dst.write_from(dst_key, reader)
    if on_bytes is not None:
        on_bytes(size)
    return size


def copy_tree(
    src: Store,
    src_prefix: str,
    dst: Store | Staging,
    dst_prefix: str = "",
    *,
    workers: int = 8,
    progress: Progress | None = None,
    keys: list[str] | None = None,
) -> CopyResult:
    """Copy every file under `src_prefix` to `dst_prefix`, `workers` files at a time.

    `keys` (relative to `src_prefix`) restricts the copy to those files.
    """
    # Validate both prefixes before any I/O: `join` alone would turn "/abs" into "abs".
    validate_prefix(src_prefix)
    validate_prefix(dst_prefix)
    if keys is None:
        base = src_prefix.rstrip("/")
        keys = [k[len(base) + 1 :] if base else k for k in src.list(src_prefix)]
    sizes = {}
    for rel in keys:
        info = src.info(join(src_prefix, rel))
        sizes[rel] = info.size if info else 0
    total = sum(sizes.values())
    counter = None if progress is None else ProgressCounter(total, progress)
    on_bytes = None if counter is None else counter.add

    def one(rel: str) -> int:
        return copy_file(src, join(src_prefix, rel), dst, join(dst_prefix, rel), on_bytes)

    copied = 0
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(keys) or 1))) as pool:
        for size in pool.map(one, keys):
            copied += size
    return CopyResult(files=len(keys), bytes=copied)
