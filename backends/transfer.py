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

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .faults import fault_point
from .keys import join, validate_prefix
from .staging import Staging
from .store import Store

Progress = Callable[[int, int], None]
"""Called with (bytes_done, bytes_total) after each file."""


@dataclass(frozen=True)
class CopyResult:
    files: int
    bytes: int


def copy_file(src: Store, src_key: str, dst: Store | Staging, dst_key: str) -> int:
    """Copy one file; returns its size. `dst` may be a store or a staging area.

    A reader of a store destination never sees a partial file (the destination's write
    operations are atomic).
    """
    src_path = src.local_path(src_key)
    if src_path is not None:
        size = os.stat(src_path).st_size
        dst.put_file(dst_key, src_path)
        fault_point("promote.mid-upload")  # in the copying thread: the others are mid-way
        return size
    with src.open_read(src_key) as reader:
        return dst.write_from(dst_key, reader)


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
    done = 0

    def one(rel: str) -> int:
        return copy_file(src, join(src_prefix, rel), dst, join(dst_prefix, rel))

    copied = 0
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(keys) or 1))) as pool:
        for size in pool.map(one, keys):
            copied += size
            done += size
            if progress is not None:
                progress(done, total)
    return CopyResult(files=len(keys), bytes=copied)
