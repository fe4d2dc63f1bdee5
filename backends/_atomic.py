"""The storage layer's one temp-and-replace: how a local file is replaced atomically.

Every atomic write to local disk in the storage layer - `LocalStore.write`, `put_file`,
`open_write`, `write_from`, `StoreBase.get_file` and the tree copies built on them - names
its temp file with `temp_name`, fills it, fsyncs it when the store is durable, and
publishes it with `replace_into`. One place, so a reader never sees a half-written file
whichever operation wrote it, and a crashed writer's leftover always has a name that
`is_temp` recognises (listings never show it as a key).

No store imports: `base.py` (`get_file`) and `_local.py` both use it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from typing import BinaryIO

O_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)

# Temp-file names: a random per-process token and a counter (cheaper than a uuid4 per
# write); a forked child draws a new token so it never collides with its parent.
_tmp_token = uuid.uuid4().hex[:16] + "-"
_tmp_counter = itertools.count()


def _new_tmp_token() -> None:
    global _tmp_token
    _tmp_token = uuid.uuid4().hex[:16] + "-"


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_tmp_token)

# What `temp_name` makes (token + counter), and the uuid4 hex names of earlier versions.
_TEMP_RE = re.compile(r"\.(?:[0-9a-f]{16}-[0-9]+|[0-9a-f]{32})\.partial\Z")


def temp_name(path: str) -> str:
    """A fresh temp-file name beside `path`, in the form `is_temp` recognises."""
    return f"{path}.{_tmp_token}{next(_tmp_counter)}.partial"


def is_temp(name: str) -> bool:
    """An in-flight (or crashed) writer's temp file: never listed as a key."""
    return name.endswith(".partial") and _TEMP_RE.search(name) is not None


def _open_new(path: str, mode: int = 0o644) -> tuple[str, int]:
    """A new temp file beside `path` (its directory made on first use): (name, fd)."""
    tmp = temp_name(path)
    try:
        fd = os.open(tmp, O_NEW, mode)
    except FileNotFoundError:  # first file in this directory
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(tmp, O_NEW, mode)
    return tmp, fd


def write_temp(path: str, data: bytes, *, durable: bool, mode: int | None = None) -> str:
    """Write `data` to a new temp file beside `path` (fsynced when `durable`); its name.

    Raw descriptor writes, no buffered file object: this is the path of every small
    record the project writes. `mode`: the file's permission bits, set exactly (whatever
    the umask) before a byte is written, so a file that holds a command line or an
    environment is never readable by others, not even for a moment; None: 0644 less the
    umask.
    """
    tmp, fd = _open_new(path, 0o644 if mode is None else mode & 0o600)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quietly(tmp)
        raise
    os.close(fd)
    return tmp


def replace_into(tmp: str, path: str, *, durable: bool) -> None:
    """Publish the complete temp file `tmp` as `path` (removing `tmp` if that fails)."""
    try:
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(path))


@contextlib.contextmanager
def replacing(path: str, *, durable: bool) -> Iterator[BinaryIO]:
    """A binary file whose bytes replace `path` when the block exits normally.

    On an exception nothing changes at `path` and the temp file is removed.
    """
    tmp, fd = _open_new(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        unlink_quietly(tmp)
        raise
    replace_into(tmp, path, durable=durable)


def copy_replacing(src: str, path: str, *, durable: bool) -> int:
    """Replace `path` with a copy of the local file `src` (`shutil.copyfile`: sendfile on
    Linux); returns the bytes copied."""
    tmp, fd = _open_new(path)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        if durable:
            fsync_path(tmp)
        size = os.stat(tmp).st_size
    except BaseException:
        unlink_quietly(tmp)
        raise
    replace_into(tmp, path, durable=durable)
    return size


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def fsync_path(path: str) -> None:
    fd = os.open(path, O_READ)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """fsync a directory; best-effort (some file systems refuse it for directories)."""
    with contextlib.suppress(OSError):
        fsync_path(path)


def fsync_tree(path: str) -> None:
    """fsync every file and directory under `path` (before publishing it on NFS/Lustre)."""
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fsync_path(os.path.join(dirpath, name))
        fsync_dir(dirpath)
