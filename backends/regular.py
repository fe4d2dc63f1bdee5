"""Reading a folder tier's files as untrusted input: regular files only, bounded.

A shared folder tier (NFS, FSx) can be written by anyone with write access to it, key or
no key. What such a writer leaves must never stop, stall or grow a reader, nor make it
read a node-local file. So every read of a folder store's file - records, notes, leases,
commit records, artifacts copied or digested - opens it here:

* ``O_NOFOLLOW``: a symbolic link as the file itself is refused (ELOOP), never followed to
  ``/dev/zero``, a FIFO, or a node-local file whose size or bytes would then travel into
  a note on the shared tier;
* ``O_NONBLOCK``: opening a FIFO (or a device) never waits for a writer, so it cannot
  hang the node while it holds a key's lock; ``fstat`` then refuses it;
* ``fstat`` on the descriptor: anything but a regular file (FIFO, character or block
  device, socket) is refused - `NotRegularFile`, a `RecordError`, so callers take it for
  the defective record (or artifact) it is, never for an `OSError` of the disk or the
  remote; a directory reads as no file, as on every store;
* a size bound where the caller gives one (`RECORD_MAX_BYTES` for records): a larger file
  is `RecordTooLarge` and at most the bound plus one byte is read.

Only the last component of a path is held to this. A directory inside a tier that is a
link is followed: the tier's root is routinely a link an operator made (``/cache ->
/fsx/cache``), and checking every component would cost a system call per component on
every cache hit. What a linked directory could lead a reader to is still held to these
rules (regular files, bounded), and each file a fetch copies is checked, on the very
descriptor it is copied from, to lie inside the tier (`open_regular_inside`, from
`copy_verified`).

No store imports: `_local.py`, `digests.py`, `verified_copy.py` and `transfer.py` use it.
"""

from __future__ import annotations

import errno
import os
import stat

from .errors import NotRegularFile, RecordTooLarge

O_UNTRUSTED_READ = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                    | getattr(os, "O_CLOEXEC", 0))  # fmt: skip
"""How a store's file is opened for reading: never through a final symbolic link, never
waiting on a FIFO or a device, never inherited by a child process."""


_O_PATH = getattr(os, "O_PATH", 0)
"""Linux's handle-only open (0 elsewhere: `open_regular` then opens without blocking and
checks after)."""
_O_NOCTTY = getattr(os, "O_NOCTTY", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def kind_of(mode: int) -> str:
    """What a file that is not regular is, as errors name it."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def not_regular(path: str, mode: int) -> NotRegularFile:
    return NotRegularFile(path, f"is {kind_of(mode)}, not a regular file; refused unread")


def open_regular(path: str) -> tuple[int, int]:
    """``(descriptor, size)`` of the regular file at `path`, opened for reading.

    `FileNotFoundError` (or `NotADirectoryError`, or `IsADirectoryError`: a directory is no
    file at a key, on every store) when there is none; `NotRegularFile` when the path is a
    symbolic link, a FIFO, a device or a socket. The descriptor is the caller's to close.
    """
    if _O_PATH:  # Linux: the type is known before the file itself is ever opened
        return _open_regular_by_handle(path)
    try:
        fd = os.open(path, O_UNTRUSTED_READ | _O_NOCTTY)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a final symbolic link
            raise NotRegularFile(path, "is a symbolic link, not a regular file; not "
                                       "followed") from None  # fmt: skip
        if exc.errno == errno.ENXIO:  # a socket (or a device without its driver)
            raise NotRegularFile(path, "is not a regular file (ENXIO on open)") from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):  # no file at that key, as on every other store
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(path, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _open_regular_by_handle(path: str) -> tuple[int, int]:
    """`open_regular` on Linux: an ``O_PATH`` handle first (opens nothing: no driver is
    called, so a tty never becomes the controlling terminal, a tape never rewinds), its type
    checked, then the regular file it names opened through ``/proc/self/fd`` (the very
    inode checked: no swap between check and open), or by name again where ``/proc`` is
    not mounted (``O_NOCTTY``, and the inode compared)."""
    try:
        handle = os.open(path, _O_PATH | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise NotRegularFile(path, "is not a regular file (ENXIO on open)") from None
        raise
    try:
        st = os.fstat(handle)
        if stat.S_ISDIR(st.st_mode):  # no file at that key, as on every other store
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        if not stat.S_ISREG(st.st_mode):  # a link too: O_PATH|O_NOFOLLOW holds the link
            raise not_regular(path, st.st_mode)
        try:  # the very inode checked: one fstat in all, as without O_PATH
            return os.open(f"/proc/self/fd/{handle}", O_UNTRUSTED_READ & ~_NOFOLLOW
                           | _O_NOCTTY), st.st_size  # fmt: skip
        except FileNotFoundError:  # no /proc: by name, the inode compared below
            fd = os.open(path, O_UNTRUSTED_READ | _O_NOCTTY)
    finally:
        os.close(handle)
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (
                st.st_dev, st.st_ino):  # fmt: skip
            raise NotRegularFile(path, "was replaced while it was opened; refused unread")
    except BaseException:
        os.close(fd)
        raise
    return fd, opened.st_size


def read_regular(path: str, max_size: int | None = None) -> bytes | None:
    """The bytes of the regular file at `path`, None when there is none.

    `NotRegularFile` for anything else at `path` (see `open_regular`); `RecordTooLarge`
    when `max_size` is given and the file is larger (read no further than one byte past
    the bound, even if it grows meanwhile). A descriptor, one `fstat` and one `os.read`
    for the common small file: reading thousands of records stays cheap.
    """
    try:
        fd, size = open_regular(path)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    try:
        if max_size is not None and size > max_size:
            raise RecordTooLarge(path, f"has {size} bytes, more than the {max_size} a "
                                       "record may have; not read")  # fmt: skip
        # Files are replaced, never rewritten in place, so the size is final, and a read
        # asking for one byte more that comes back short has reached EOF.
        data = os.read(fd, size + 1)
        if len(data) == size:
            return data
        # The file grew (an appended log segment) or the read was short (> 2 GiB on
        # Linux): read on to EOF, or to one byte past the bound.
        parts, total = [data], len(data)
        while max_size is None or total <= max_size:
            step = 1 << 24 if max_size is None else max_size + 1 - total
            chunk = os.read(fd, step)
            if not chunk:
                break
            parts.append(chunk)
            total += len(chunk)
        if max_size is not None and total > max_size:
            raise RecordTooLarge(path, f"grew past the {max_size} bytes a record may "
                                       "have while it was read")  # fmt: skip
        return b"".join(parts)
    finally:
        os.close(fd)


def lstat_regular(path: str) -> os.stat_result | None:
    """`os.lstat` of `path` when it is a regular file; None when there is nothing there.

    `NotRegularFile` for anything else: the one system call of a size check, a symbolic
    link never followed."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(path, st.st_mode)
    return st


def inside_root(root: str, path: str) -> bool:
    """Whether the directory `path` resolves (links followed) inside the tier at `root`.

    For a lease folder before a record is written there (backends/locks.py). A file to be
    read is checked on its descriptor instead (`open_regular_inside`): a path checked here
    and then opened by name could be swapped for a link in between."""
    return _within(os.path.realpath(root), os.path.realpath(path))


def _within(real_root: str, real: str) -> bool:
    return real == real_root or real.startswith(real_root.rstrip("/") + "/")


def open_regular_inside(real_root: str, path: str) -> tuple[int, int]:
    """`open_regular`, and the file opened must lie inside the tier whose real path
    (`os.path.realpath` of its root) is `real_root`: `NotRegularFile` otherwise.

    For a fetch's copy (`copy_verified`): a directory of the entry that is a link could
    lead the copy, and the sizes an error names, to node-local files. The check is of the
    descriptor the copy then reads (where ``/proc/self/fd`` says it is), never of the path
    again: a directory swapped for a link after a check by name would otherwise be
    followed by the open. One `readlink` per file copied, never on the path of a hit."""
    fd, size = open_regular(path)
    try:
        if not _within(real_root, _location(fd, path)):
            raise NotRegularFile(path, "is reached through a directory that resolves outside "
                                       "the tier (a link); refused unread")  # fmt: skip
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def _location(fd: int, path: str) -> str:
    """The real path of the file open at `fd`: from ``/proc/self/fd``; without ``/proc``,
    `path` resolved now, and only when that is still the inode open at `fd` ("" if not:
    then it is inside nothing)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        pass
    real = os.path.realpath(path)
    try:
        now, opened = os.lstat(real), os.fstat(fd)
    except OSError:
        return ""
    return real if (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino) else ""
