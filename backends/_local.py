"""Local-disk stores: plain local disk, and the NFS and FSx/Lustre profiles of it.

All three are POSIX: publication is a directory `os.rename` (atomic, and it refuses a
non-empty target, so the first writer wins; a directory staged empty is published holding
one hidden `.empty` file, because rename replaces an empty target), atomic writes are
temp-file + `os.replace`, exclusive creates are `os.link` of a complete temp file (never
a half-written file under the final name), and appends are raw `os.write` on an
`O_APPEND` descriptor, which survives `os._exit()`.

The profiles differ in what they may trust (docs/storage.md):

* ``local``  - `flock` is a real kernel lock, dropped by the kernel when the holder dies.
* ``nfs``    - flock is emulated with byte-range locks and some mounts make it a no-op, so
  locks are leases; everything published is fsynced before the rename so other clients
  see complete files (close-to-open consistency).
* ``lustre`` - flock is cluster-wide only with the ``flock`` mount option (``localflock``
  is node-local, none at all gives ENOSYS), so leases unless the mount says ``flock``;
  fsync as for NFS.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import itertools
import os
import re
import shutil
import stat
import uuid
from typing import IO

from fsspec.implementations.local import LocalFileSystem

from .base import Appender, Capabilities, FileInfo
from .keys import validate_key, validate_prefix
from .store import Store

PROFILES = ("local", "nfs", "lustre")
_O_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)

# Temp-file names: a random per-process token and a counter (cheaper than a uuid4 per
# write); a forked child draws a new token so it never collides with its parent.
_tmp_token = uuid.uuid4().hex[:16] + "-"
_tmp_counter = itertools.count()


def _new_tmp_token() -> None:
    global _tmp_token
    _tmp_token = uuid.uuid4().hex[:16] + "-"


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_tmp_token)

# What `_tmp_for` (token + counter) and the other temp writers (uuid4 hex) name temp files.
_TEMP_RE = re.compile(r"\.(?:[0-9a-f]{16}-[0-9]+|[0-9a-f]{32})\.partial\Z")


def _is_temp(name: str) -> bool:
    """An in-flight (or crashed) writer's temp file: never listed as a key."""
    return name.endswith(".partial") and _TEMP_RE.search(name) is not None


EMPTY_MARKER = ".empty"
"""The one file of a published directory that was staged empty (see `_rename_dir`)."""


def read_local_file(path: str) -> bytes | None:
    """The bytes of the local file at `path`, or None when there is no such file.

    The one way this package reads a whole local file: a descriptor, one `fstat` and one
    `os.read` (no buffered file object), which is what makes reading thousands of small
    records (cache entries at manifest emit) cheap.
    """
    try:
        fd = os.open(path, _O_READ)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    try:
        # Files are replaced, never rewritten in place, so the size is final, and a read
        # asking for one byte more that comes back short has reached EOF.
        size = os.fstat(fd).st_size
        data = os.read(fd, size + 1)
        if len(data) == size:
            return data
        # The file grew (an appended log segment) or the read was short (> 2 GiB on
        # Linux): read on to EOF.
        parts = [data]
        while chunk := os.read(fd, 1 << 24):
            parts.append(chunk)
        return b"".join(parts)
    except IsADirectoryError:
        return None
    finally:
        os.close(fd)


class _FdAppender(Appender):
    """O_APPEND descriptor; each `write` is one `os.write`, so lines survive `os._exit()`."""

    __slots__ = ("_fd", "_pid", "_path")

    def __init__(self, path: str, truncate: bool) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        self._path = path
        self._fd = os.open(path, flags, 0o644)
        self._pid = os.getpid()

    def write(self, data: bytes) -> None:
        os.write(self._fd, data)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


class LocalStore(Store):
    """A store rooted at a local (or NFS / Lustre mounted) directory."""

    def __init__(
        self,
        url: str,
        root: str,
        *,
        profile: str = "local",
        kernel_locks: bool | None = None,
        fsync: bool | None = None,
    ) -> None:
        if profile not in PROFILES:
            raise ValueError(f"unknown local store profile {profile!r}; expected one of {PROFILES}")
        super().__init__(url, LocalFileSystem(), os.path.abspath(root))
        self._on_sub()
        if kernel_locks is None:
            kernel_locks = profile == "local"
        self.fsync = (profile != "local") if fsync is None else fsync
        self.capabilities = Capabilities(
            profile=profile,
            atomic_rename=True,
            kernel_locks=kernel_locks,
            native_append=True,
            local_paths=True,
        )

    def _path(self, key: str) -> str:
        key = validate_prefix(key)
        return os.path.join(self.root, key) if key else self.root

    def _key_path(self, key: str) -> str:
        """The path of a file key (validated; the hot-path version of `_path`)."""
        return self._root_slash + validate_key(key)

    def _on_sub(self) -> None:
        self._root_slash = self.root.rstrip("/") + "/"

    # ------------------------------------------------------------ primitives
    def read(self, key: str) -> bytes | None:
        return read_local_file(self._key_path(key))

    def _tmp_for(self, path: str) -> str:
        return f"{path}.{_tmp_token}{next(_tmp_counter)}.partial"

    def _write_tmp(self, path: str, data: bytes) -> str:
        tmp = self._tmp_for(path)
        try:
            fd = os.open(tmp, _O_NEW, 0o644)
        except FileNotFoundError:  # first file in this directory
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(tmp, _O_NEW, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return tmp

    def write(self, key: str, data: bytes) -> None:
        path = self._key_path(key)
        tmp = self._write_tmp(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        if self.fsync:
            _fsync_dir(os.path.dirname(path))

    def create(self, key: str, data: bytes) -> bool:
        path = self._key_path(key)
        tmp = self._write_tmp(path, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if self.fsync:
            _fsync_dir(os.path.dirname(path))
        return True

    def info(self, key: str) -> FileInfo | None:
        try:
            st = os.stat(self._path(validate_key(key)))
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return FileInfo(key, st.st_size, st.st_mtime)

    def list(self, prefix: str = "") -> list[str]:
        """Every file key under `prefix`; a writer's in-flight temp files are not keys."""
        base = self._path(prefix)
        out: list[str] = []
        for dirpath, _dirs, files in os.walk(base):
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in files:
                if not _is_temp(name):
                    out.append(name if rel_dir == "." else f"{rel_dir}/{name}")
        return sorted(out)

    def list_dir(self, prefix: str = "") -> builtins.list[str]:
        try:
            return sorted(n for n in os.listdir(self._path(prefix)) if not _is_temp(n))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, key: str) -> bool:
        try:
            os.unlink(self._path(validate_key(key)))
            return True
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
            # unlink() of a directory is EISDIR on Linux, EPERM on some other systems.
            if isinstance(exc, PermissionError) and not os.path.isdir(self._path(key)):
                raise
            return False

    def delete_tree(self, prefix: str) -> int:
        path = self._path(validate_key(prefix))
        count = sum(len(files) for _, _, files in os.walk(path))
        shutil.rmtree(path, ignore_errors=True)
        return count

    def put_file(self, key: str, local_path: str) -> None:
        path = self._path(validate_key(key))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = self._tmp_for(path)
        try:
            shutil.copyfile(local_path, tmp)
            if self.fsync:
                _fsync_path(tmp)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def open_read(self, key: str) -> IO[bytes]:
        return open(self._path(validate_key(key)), "rb")

    def open_appender(self, key: str, *, truncate: bool) -> Appender:
        return _FdAppender(self._path(validate_key(key)), truncate)

    # ---------------------------------------------------------- publication
    def _write_unpublished(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def _put_file_unpublished(self, key: str, local_path: str) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        shutil.copyfile(local_path, path)

    def _is_dir(self, key: str) -> bool:
        return os.path.isdir(self._path(key))

    def _rename_dir(self, src: str, dst: str, *, publish: bool = False) -> bool:
        src_path, dst_path = self._path(src), self._path(dst)
        if not os.path.isdir(src_path) and not publish:
            return False
        if publish and (not os.path.isdir(src_path) or not os.listdir(src_path)):
            # rename(2) silently replaces an existing *empty* directory, so an empty
            # publication would let a later writer win. Never publish an empty directory.
            os.makedirs(src_path, exist_ok=True)
            with open(os.path.join(src_path, EMPTY_MARKER), "wb"):
                pass
        if publish and self.fsync:
            _fsync_tree(src_path)
        os.makedirs(os.path.dirname(dst_path), exist_ok=True)
        try:
            os.rename(src_path, dst_path)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR):
                return False
            raise
        if self.fsync:
            _fsync_dir(os.path.dirname(dst_path))
        return True


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        _fsync_path(path)


def _fsync_tree(path: str) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            _fsync_path(os.path.join(dirpath, name))
        _fsync_dir(dirpath)
