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
import os
import shutil
import stat
from collections.abc import Iterator, Mapping
from typing import IO

from fsspec.implementations.local import LocalFileSystem

from ._atomic import (
    copy_replacing,
    fsync_dir,
    fsync_tree,
    is_temp,
    replace_into,
    replacing,
    write_temp,
)
from .appenders import FdAppender
from .base import Appender, Capabilities, FileInfo
from .debris import Seen
from .digests import Expected, FileDigest, file_digest
from .errors import IntegrityError, too_many_names
from .keys import GOOD_KEYS, remember_good, validate_key, validate_prefix
from .operations import where
from .records import RECORD_MAX_BYTES
from .regular import kind_of, open_regular, read_regular
from .store import Store

PROFILES = ("local", "nfs", "lustre")

EMPTY_MARKER = ".empty"
"""The one file of a published directory that was staged empty (see `_rename_dir`)."""


def read_local_file(path: str, max_size: int | None = None) -> bytes | None:
    """The bytes of the local file at `path`, or None when there is no such file.

    The one way this package reads a whole local file (`regular.read_regular`): regular
    files only, a final symbolic link never followed, a FIFO never waited on
    (`NotRegularFile`), and at most `max_size` bytes (`RecordTooLarge`). A descriptor, one
    `fstat` and one `os.read`, which keeps reading thousands of small records (cache
    entries at manifest emit) cheap.
    """
    return read_regular(path, max_size)


def _dir_identity(st: os.stat_result) -> str:
    """A directory's version (`LocalStore._dir_version`): device, inode, mtime."""
    return f"{st.st_dev:x}-{st.st_ino:x}-{st.st_mtime_ns:x}"


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
        self._durable = (profile != "local") if fsync is None else bool(fsync)
        self.capabilities = Capabilities(
            profile=profile,
            atomic_rename=True,
            kernel_locks=kernel_locks,
            native_append=True,
            local_paths=True,
            durable=self._durable,
        )

    def _path(self, key: str) -> str:
        key = validate_prefix(key)
        return os.path.join(self.root, key) if key else self.root

    def _key_path(self, key: str) -> str:
        """The path of a file key (validated; the hot-path version of `_path`)."""
        try:
            if key not in GOOD_KEYS:
                remember_good(key)
        except TypeError:  # unhashable, so not a str: InvalidKey
            remember_good(key)
        return self._root_slash + key

    def _on_sub(self) -> None:
        self._root_slash = self.root.rstrip("/") + "/"

    # ------------------------------------------------------------ primitives
    def read(self, key: str, *, max_size: int | None = None) -> bytes | None:
        return read_regular(self._key_path(key), max_size)

    def write(self, key: str, data: bytes, *, mode: int | None = None) -> None:
        path = self._key_path(key)
        replace_into(write_temp(path, data, durable=self._durable, mode=mode), path,
                     durable=self._durable)  # fmt: skip

    def create(self, key: str, data: bytes) -> bool:
        path = self._key_path(key)
        tmp = write_temp(path, data, durable=self._durable)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if self._durable:
            fsync_dir(os.path.dirname(path))
        return True

    def info(self, key: str) -> FileInfo | None:
        # lstat: a symbolic link at a key is no file of the store (never followed).
        try:
            st = os.lstat(self._key_path(key))
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
                if not is_temp(name):
                    out.append(name if rel_dir == "." else f"{rel_dir}/{name}")
        return sorted(out)

    def list_dir(self, prefix: str = "", *,
                 max_names: int | None = None) -> builtins.list[str]:  # fmt: skip
        try:
            if max_names is None:
                return sorted(n for n in os.listdir(self._path(prefix)) if not is_temp(n))
            names: builtins.list[str] = []
            scanned = 0
            with os.scandir(self._path(prefix)) as entries:  # read no further than the bound
                for entry in entries:
                    # Every name read counts, temp-looking ones too: a writer of the tier
                    # can name millions of files like a temp file.
                    if scanned == max_names:
                        raise too_many_names(self.url, prefix, max_names)
                    scanned += 1
                    if not is_temp(entry.name):
                        names.append(entry.name)
            return sorted(names)
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
        copy_replacing(local_path, self._key_path(key), durable=self._durable)

    def open_read(self, key: str) -> IO[bytes]:
        # Regular files only (`NotRegularFile`), a final link never followed.
        fd, _size = open_regular(self._path(validate_key(key)))
        return os.fdopen(fd, "rb")

    def open_appender(self, key: str, *, truncate: bool) -> Appender:
        return FdAppender(self._path(validate_key(key)), truncate)

    # ------------------------------------------- operations the domain code needs
    def read_published(self, final: str, rel: str, *, max_size: int | None = RECORD_MAX_BYTES
                       ) -> tuple[str, bytes | None] | None:  # fmt: skip
        # The hot path of every cache hit: the keys are checked (cached), the path joined
        # by hand, and the directory is only stat'ed when the file is not there.
        try:
            if final not in GOOD_KEYS:
                remember_good(final)
            if rel not in GOOD_KEYS:
                remember_good(rel)
        except TypeError:  # unhashable, so not a str: InvalidKey
            remember_good(final)
            remember_good(rel)
        data = read_regular(f"{self._root_slash}{final}/{rel}", max_size)
        if data is not None:
            return final, data
        return (final, None) if os.path.isdir(self._root_slash + final) else None

    def check_sizes(self, prefix: str, files: Mapping[str, Expected]) -> None:
        # One stat per file and nothing else: the second half of every cache hit.
        try:
            known = prefix in GOOD_KEYS
        except TypeError:  # unhashable, so not a str: InvalidKey below
            known = False
        if not known:
            prefix = validate_prefix(prefix)  # the root ("") and a trailing "/" too
        base = f"{self._root_slash}{prefix}/" if prefix else self._root_slash
        # lstat: as cheap as stat, and a link is never followed; anything but a regular
        # file (a FIFO, a device, a link to one) is this entry's defect, like a wrong size.
        lstat_, good, regular = os.lstat, GOOD_KEYS, stat.S_ISREG
        for rel, expected in files.items():
            if rel not in good:
                remember_good(rel)
            try:
                st = lstat_(base + rel)
            except OSError:
                raise IntegrityError(where(self, prefix), rel, "is missing") from None
            if not regular(st.st_mode):
                raise IntegrityError(where(self, prefix), rel,
                                     f"is {kind_of(st.st_mode)}, not a regular file")
            size = st.st_size
            if size != expected.size:
                raise IntegrityError(where(self, prefix), rel,
                                     f"has {size} bytes, expected {expected.size}")

    def digest(self, key: str) -> FileDigest | None:
        try:
            return file_digest(self._key_path(key))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def open_write(self, key: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return replacing(self._key_path(key), durable=self._durable)

    def write_from(self, key: str, reader: IO[bytes]) -> int:
        with self.open_write(key) as out:
            shutil.copyfileobj(reader, out, 8 << 20)
            return out.tell()

    @contextlib.contextmanager
    def _local_output(self, prefix: str) -> Iterator[str]:
        directory = self._path(validate_key(prefix))
        os.makedirs(directory, exist_ok=True)
        yield directory
        if self._durable:  # what the tool wrote is as durable as what the store writes
            fsync_tree(directory)

    def local_output(self, prefix: str) -> contextlib.AbstractContextManager[str]:
        return self._local_output(prefix)

    def local_dir_of(self, prefix: str) -> str | None:
        return self._key_path(prefix)

    def _walk(self, prefix: str = "") -> builtins.list[Seen]:
        # One scandir walk, symbolic links not followed; directories too (a staging area
        # just created for old files is in use), and writers' temp files, flagged.
        out: list[Seen] = []
        base = validate_prefix(prefix)
        stack = [(self._path(base), base)]
        while stack:
            path, rel = stack.pop()
            try:
                entries = list(os.scandir(path))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                key = f"{rel}/{entry.name}" if rel else entry.name
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    version = "" if rel else _dir_identity(st)  # saves a stat per entry
                    out.append(Seen(key, 0, st.st_mtime, directory=True, version=version))
                    stack.append((entry.path, key))
                elif stat.S_ISREG(st.st_mode):
                    out.append(Seen(key, st.st_size, st.st_mtime, temp=is_temp(entry.name)))
        return out

    # ---------------------------------------------------------- publication
    # Inside a staging directory nothing needs a temp file: the directory is published
    # (and fsynced first, when durable) as a whole.
    def _write_unpublished(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def _put_file_unpublished(self, key: str, local_path: str) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        shutil.copyfile(local_path, path)

    def _write_from_unpublished(self, key: str, reader: IO[bytes]) -> int:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as out:
            shutil.copyfileobj(reader, out, 8 << 20)
            return out.tell()

    def _is_dir(self, key: str) -> bool:
        return os.path.isdir(self._path(key))

    def _dir_version(self, key: str) -> str | None:
        # What a conditional withdrawal compares once it has renamed the directory aside:
        # rename(2) keeps the inode and the modification time; a directory published in
        # its place is another inode, or the same number reused with another time.
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISDIR(st.st_mode):
            return None
        return _dir_identity(st)

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
        if publish and self._durable:
            fsync_tree(src_path)
        os.makedirs(os.path.dirname(dst_path), exist_ok=True)
        try:
            os.rename(src_path, dst_path)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR):
                return False
            raise
        if self._durable:
            fsync_dir(os.path.dirname(dst_path))
        return True

    def rename(self, src: str, dst: str) -> bool:
        # One rename(2): atomic, whatever the size; the destination's directory is made
        # only when the first attempt says it is missing (the common case pays nothing).
        src_path, dst_path = self._path(validate_key(src)), self._path(validate_key(dst))
        try:
            os.replace(src_path, dst_path)
        except FileNotFoundError:
            if not os.path.lexists(src_path):
                return False
            os.makedirs(os.path.dirname(dst_path), exist_ok=True)
            os.replace(src_path, dst_path)
        if self._durable:
            fsync_dir(os.path.dirname(dst_path))
        return True
