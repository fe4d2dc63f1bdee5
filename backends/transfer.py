"""Copy a tree of files between two stores, in parallel, with progress.

Used to fetch a cache entry from the remote tier and to promote one to it. Local-to-local
copies go through `shutil.copyfile` (sendfile on Linux); anything else streams through
the stores in 8 MiB chunks, so a large artifact never has to fit in memory twice.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .base import Staging
from .keys import join, validate_prefix
from .store import Store

Progress = Callable[[int, int], None]
"""Called with (bytes_done, bytes_total) after each file."""


@dataclass(frozen=True)
class CopyResult:
    files: int
    bytes: int


def copy_file(src: Store, src_key: str, dst: Store | Staging, dst_key: str) -> int:
    """Copy one file; returns its size. `dst` may be a store or a staging area.

    A local destination is written to a temp file beside it and renamed into place, so a
    reader of the destination never sees a partial file.
    """
    if isinstance(dst, Staging):
        dst_store, dst_full = dst.store, dst.key(dst_key)
    else:
        dst_store, dst_full = dst, dst_key
    src_path = src.local_path(src_key)
    dst_path = dst_store.local_path(dst_full)
    if dst_path is not None:
        os.makedirs(os.path.dirname(dst_path), exist_ok=True)
        # Named like every temp file of the local store, which `list` never shows.
        tmp = f"{dst_path}.{uuid.uuid4().hex}.partial"
        try:
            if src_path is not None:
                shutil.copyfile(src_path, tmp)
            else:
                with src.open_read(src_key) as reader, open(tmp, "xb") as out:
                    shutil.copyfileobj(reader, out, 8 << 20)
            if getattr(dst_store, "fsync", False):  # NFS / Lustre profiles
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            size = os.path.getsize(tmp)
            os.replace(tmp, dst_path)
            return size
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    if src_path is not None:
        dst_store.put_file(dst_full, src_path)
        return os.path.getsize(src_path)
    data = src.read(src_key)
    if data is None:
        raise FileNotFoundError(f"{src.url}: {src_key} vanished during copy")
    dst_store.write(dst_full, data)
    return len(data)


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
