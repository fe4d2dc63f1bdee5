"""The generic implementations of the store operations that domain code needs.

`StoreBase` exposes each as a method that calls the function here; a backend overrides
the method where it can do better (`LocalStore`: one `stat` per file, kernel copies,
writes straight into place; `S3Store`: one listing instead of a request per file). Kept
apart from `base.py` so that the primitives and the publication protocol stay readable
on their own.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import IO

from .digests import Expected, FileDigest
from .errors import IntegrityError
from .keys import join, validate_key, validate_prefix
from .protocol import ByteStore


def where(store: ByteStore, prefix: str) -> str:
    """`prefix` of `store` as error messages name it: the store's URL and the key."""
    base = store.url if store.url.endswith("/") else store.url + "/"
    return base + prefix


def read_published(store: ByteStore, final: str, rel: str,
                   max_size: int | None) -> tuple[str, bytes | None] | None:  # fmt: skip
    validate_key(rel)  # refused whether or not `final` is published
    prefix = store.published(final)
    if prefix is None:
        return None
    return prefix, store.read(join(prefix, rel), max_size=max_size)


def check_sizes(store: ByteStore, prefix: str, files: Mapping[str, Expected]) -> None:
    prefix = validate_prefix(prefix)
    for rel, expected in files.items():
        info = store.info(join(prefix, validate_key(rel)))
        if info is None:
            raise IntegrityError(where(store, prefix), rel, "is missing")
        if info.size != expected.size:
            raise IntegrityError(where(store, prefix), rel,
                                 f"has {info.size} bytes, expected {expected.size}")


def compare_sizes(store: ByteStore, prefix: str, files: Mapping[str, Expected],
                  sizes: Mapping[str, int]) -> None:
    """`check_sizes` against sizes already known (one listing of the prefix, say)."""
    for rel, expected in files.items():
        size = sizes.get(validate_key(rel))
        if size is None:
            raise IntegrityError(where(store, prefix), rel, "is missing")
        if size != expected.size:
            raise IntegrityError(where(store, prefix), rel,
                                 f"has {size} bytes, expected {expected.size}")


def digest_tree(store: ByteStore, prefix: str) -> dict[str, FileDigest]:
    base = validate_prefix(prefix)
    out: dict[str, FileDigest] = {}
    for key in store.list(base):
        digest = store.digest(key)
        if digest is not None:  # deleted meanwhile: not part of the tree any more
            out[key[len(base) + 1:] if base else key] = digest
    return out


@contextlib.contextmanager
def open_write(store: ByteStore, key: str) -> Iterator[IO[bytes]]:
    """Buffer in memory, then one atomic `write` (stores whose writes are whole objects)."""
    validate_key(key)
    buffer = io.BytesIO()
    yield buffer
    store.write(key, buffer.getvalue())


@contextlib.contextmanager
def local_output(store: ByteStore, prefix: str) -> Iterator[str]:
    """A scratch directory whose files are uploaded under `prefix` when the block exits."""
    prefix = validate_prefix(prefix)
    scratch = tempfile.mkdtemp(prefix="vn-output-")
    try:
        yield scratch
        for dirpath, _dirs, names in os.walk(scratch):
            for name in names:
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, scratch).replace(os.sep, "/")
                store.put_file(join(prefix, rel), path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def rename(store: ByteStore, src: str, dst: str) -> bool:
    """Copy the file at `src`, or every file under it, to `dst`, then delete `src`.

    For stores where nothing renames (objects, memory): a reader may see both copies for
    a moment, never neither. A file already at a destination key is replaced.
    """
    src, dst = validate_key(src), validate_key(dst)
    if store.info(src) is not None:
        moves = [(src, dst)]
    else:
        moves = [(key, join(dst, key[len(src) + 1:])) for key in store.list(src)]
        if not moves:
            return False
    for old, new in moves:
        with store.open_read(old) as reader:
            store.write_from(new, reader)
    if moves[0][0] == src:
        store.delete(src)
    else:
        store.delete_tree(src)
    return True
