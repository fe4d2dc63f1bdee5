"""`StoreBase`: the byte operations and the publication protocol every backend shares.

`Store` (``store.py``) adds the protocols that are built from these operations: named
locks and event logs. The split keeps the imports one-way: locks and event logs are
written against `StoreBase`, and `Store` is assembled on top of all three.

A store is a key -> bytes map rooted at a URL. Backends differ in what they can promise,
and say so in `Capabilities`; the protocols built on top (publication, locking, event
logs) pick their strategy from those flags, never from the backend's type:

* ``atomic_rename`` - a directory can be renamed into place atomically, refusing a
  non-empty target (POSIX). Publication is then "stage, rename". Without it (S3, memory),
  publication is "upload under a unique prefix, then exclusively create a commit record
  that names it".
* ``kernel_locks`` - ``flock`` is honoured by every process that can reach the store
  (local disk). Without it, locks are leases with an expiry and a fencing generation.
* ``native_append`` - appends are O_APPEND writes that survive ``os._exit()``. Without it,
  a writer's log segment is rewritten whole on each append (segments are per writer).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import posixpath
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from .errors import StoreError
from .keys import join, validate_key, validate_prefix
from .records import COMMIT_RECORDS, CommitRecord, Record, RecordError, encode

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; annotations only

COMMIT_RECORD = ".commit"
VERSIONS_DIR = ".v"
STAGING_DIR = ".staging"
LOCKS_DIR = ".locks"
TRASH_DIR = ".trash"


@dataclass(frozen=True)
class Capabilities:
    """What a store can promise; protocols choose their strategy from these flags."""

    profile: str
    atomic_rename: bool
    kernel_locks: bool
    native_append: bool
    local_paths: bool


@dataclass(frozen=True)
class FileInfo:
    """Size and modification time (seconds since the epoch) of one stored file."""

    key: str
    size: int
    mtime: float


class Appender(ABC):
    """A single writer's handle on one log segment."""

    @abstractmethod
    def write(self, data: bytes) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def fileno(self) -> int:
        """A descriptor on which one `os.write(fd, data)` is exactly `write(data)`, or -1.

        Lets the event log skip a method call per record on its hot path.
        """
        return -1


class SegmentAppender(Appender):
    """Appends by rewriting the writer's whole segment object (stores without native append).

    Correct because a segment has exactly one writer; each rewrite is an atomic write, so a
    reader sees a prefix of the writer's records, never a torn line.
    """

    def __init__(self, store: StoreBase, key: str, truncate: bool) -> None:
        self._store, self._key = store, key
        existing = None if truncate else store.read(key)
        self._buffer = bytearray(existing or b"")
        if truncate:
            store.write(key, b"")

    def write(self, data: bytes) -> None:
        self._buffer += data
        self._store.write(self._key, bytes(self._buffer))

    def close(self) -> None:
        pass


class Staging:
    """A directory being built for publication; visible to readers only after `commit`.

    Write files with `write`/`put_file` (keys relative to the staging root), then call
    `commit()`, which returns True if this writer published `final` and False if another
    writer had already published it (first writer wins; the loser's files are removed).
    Leaving the context without committing removes the staged files.
    """

    def __init__(self, store: StoreBase, final: str, prefix: str) -> None:
        self.store = store
        self.final = final
        self.prefix = prefix
        self._done = False

    def key(self, rel: str) -> str:
        return join(self.prefix, validate_key(rel))

    def write(self, rel: str, data: bytes) -> None:
        self.store._write_unpublished(self.key(rel), data)

    def put_file(self, rel: str, local_path: str) -> None:
        self.store._put_file_unpublished(self.key(rel), local_path)

    def local_dir(self) -> str | None:
        """The staging directory on local disk, when the store has local paths."""
        return self.store.local_path(self.prefix)

    def commit(self) -> bool:
        if self._done:
            raise StoreError(f"staging for {self.final!r} was already committed or aborted")
        self._done = True
        return self.store._commit_staged(self)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self.store.delete_tree(self.prefix)

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class StoreBase(ABC):
    """A key -> bytes store at a URL: what every backend implements (see `store.Store`)."""

    capabilities: Capabilities

    def __init__(self, url: str, fs: Any, root: str) -> None:
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/") if root not in ("", "/") else root

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url} profile={self.capabilities.profile}>"

    # ----------------------------------------------------------------- paths
    def _path(self, key: str) -> str:
        key = validate_prefix(key)
        if not key:
            return self.root
        return posixpath.join(self.root, key) if self.root else key

    def local_path(self, key: str) -> str | None:
        """The local filesystem path of `key`, or None when the store is not on local disk."""
        return self._path(key) if self.capabilities.local_paths else None

    # ------------------------------------------------------------ primitives
    @abstractmethod
    def read(self, key: str) -> bytes | None:
        """The bytes stored at `key`, or None when there is no such key."""

    @abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Store `data` at `key` atomically: readers see the old or the new bytes."""

    @abstractmethod
    def create(self, key: str, data: bytes) -> bool:
        """Store `data` at `key` only if absent; True if this call created it (atomic)."""

    @abstractmethod
    def info(self, key: str) -> FileInfo | None:
        """Size and mtime of the file at `key`, or None when absent."""

    @abstractmethod
    def open_appender(self, key: str, *, truncate: bool) -> Appender:
        """Open the single-writer segment `key` for appends (`truncate` empties it first)."""

    def exists(self, key: str) -> bool:
        return self.info(key) is not None

    def list(self, prefix: str = "") -> list[str]:
        """Every file key under `prefix` (recursive, sorted), relative to the store root."""
        base = self._path(prefix)
        try:
            found = self.fs.find(base, withdirs=False)
        except FileNotFoundError:
            return []
        out = []
        for path in found:
            rel = self._rel(path)
            if rel is not None and rel != validate_prefix(prefix):
                out.append(rel)
        return sorted(out)

    def list_dir(self, prefix: str = "") -> builtins.list[str]:
        """Names of the immediate children (files and directories) of `prefix`."""
        base = self._path(prefix)
        try:
            entries = self.fs.ls(base, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = {posixpath.basename(str(e).rstrip("/")) for e in entries}
        return sorted(n for n in names if n)

    def delete(self, key: str) -> bool:
        """Delete the file at `key`; True if it existed."""
        try:
            self.fs.rm_file(self._path(validate_key(key)))
            return True
        except FileNotFoundError:
            return False

    def delete_tree(self, prefix: str) -> int:
        """Delete every file under `prefix`; returns how many were deleted."""
        keys = self.list(validate_key(prefix))
        for k in keys:
            self.delete(k)
        with contextlib.suppress(FileNotFoundError, OSError):
            self.fs.rm(self._path(prefix), recursive=True)
        return len(keys)

    def put_file(self, key: str, local_path: str) -> None:
        """Upload a local file to `key` atomically."""
        with open(local_path, "rb") as f:
            self.write(key, f.read())

    def get_file(self, key: str, local_path: str) -> bool:
        """Download `key` to `local_path` (written via a temp file + rename); False if absent."""
        tmp = f"{local_path}.{uuid.uuid4().hex}.partial"
        try:
            with self.open_read(key) as src, open(tmp, "wb") as dst:
                while chunk := src.read(8 << 20):
                    dst.write(chunk)
            os.replace(tmp, local_path)
            return True
        except FileNotFoundError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def open_read(self, key: str) -> IO[bytes]:
        """A binary stream over `key` (raises FileNotFoundError when absent)."""
        return self.fs.open(self._path(validate_key(key)), "rb")

    def _rel(self, path: str) -> str | None:
        path = str(path).rstrip("/")
        root = self.root.rstrip("/")
        if not root:
            return path
        if path == root:
            return ""
        if path.startswith(root + "/"):
            return path[len(root) + 1 :]
        return None

    # ------------------------------------------------------------- JSON sugar
    def read_json(self, key: str) -> Any:
        data = self.read(key)
        return None if data is None else json.loads(data)

    # ---------------------------------------------------------- publication
    def stage(self, final: str) -> Staging:
        """Start building the directory `final`; see `Staging`."""
        validate_key(final)
        if self.capabilities.atomic_rename:
            prefix = join(STAGING_DIR, f"{uuid.uuid4().hex}")
        else:
            prefix = join(final, VERSIONS_DIR, uuid.uuid4().hex)
        return Staging(self, final, prefix)

    def published(self, final: str) -> str | None:
        """The prefix holding the published content of `final`, or None if unpublished."""
        validate_key(final)
        if self.capabilities.atomic_rename:
            return final if self._is_dir(final) else None
        record = self._read_commit(final)
        return None if record is None else join(final, VERSIONS_DIR, record.version)

    def published_children(self, parent: str = "") -> builtins.list[str]:
        """Names under `parent` that are published directories."""
        names = [n for n in self.list_dir(parent) if not n.startswith(".")]
        if self.capabilities.atomic_rename:
            return [n for n in names if self._is_dir(join(parent, n))]
        return [n for n in names if self.exists(join(parent, n, COMMIT_RECORD))]

    def unpublish(self, final: str) -> bool:
        """Withdraw a published directory atomically, then delete its files.

        Returns True if this call withdrew it. Readers holding the old content prefix may
        fail to read it afterwards; they must treat that as a miss.
        """
        validate_key(final)
        if self.capabilities.atomic_rename:
            trash = join(TRASH_DIR, uuid.uuid4().hex)
            if not self._rename_dir(final, trash):
                return False
            self.delete_tree(trash)
            return True
        record = self._read_commit(final)
        if record is None:
            return False
        if not self.delete(join(final, COMMIT_RECORD)):
            return False
        self.delete_tree(join(final, VERSIONS_DIR, record.version))
        return True

    def _read_commit(self, final: str) -> CommitRecord | None:
        try:
            record = COMMIT_RECORDS.read(self, join(final, COMMIT_RECORD))
            if record is not None:
                validate_key(record.version)
            return record
        except (RecordError, ValueError):  # unreadable, or naming no key: unpublished
            return None

    def _commit_staged(self, staging: Staging) -> bool:
        if self.capabilities.atomic_rename:
            won = self._rename_dir(staging.prefix, staging.final, publish=True)
            if not won:
                self.delete_tree(staging.prefix)
            return won
        version = staging.prefix.rsplit("/", 1)[-1]
        record = encode(CommitRecord(version=version, committed_at=time.time()))
        won = self.create(join(staging.final, COMMIT_RECORD), record)
        if not won:
            self.delete_tree(staging.prefix)
        return won

    def _write_unpublished(self, key: str, data: bytes) -> None:
        """Write a file inside a staging area (atomicity is provided by the commit)."""
        self.write(key, data)

    def _put_file_unpublished(self, key: str, local_path: str) -> None:
        self.put_file(key, local_path)

    def _is_dir(self, key: str) -> bool:
        try:
            return bool(self.fs.isdir(self._path(key)))
        except FileNotFoundError:
            return False

    def _rename_dir(self, src: str, dst: str, *, publish: bool = False) -> bool:
        raise StoreError(f"{self.url} cannot rename directories atomically")

    def sub(self, prefix: str) -> Self:
        """A view of this store rooted at `prefix` (same backend, same capabilities)."""
        validate_key(prefix)
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.root = self._path(prefix)
        base_url = self.url if self.url.endswith("://") else self.url.rstrip("/") + "/"
        clone.url = base_url + prefix
        clone._on_sub()
        return clone

    def _on_sub(self) -> None:  # noqa: B027 - an optional hook, empty by default
        """Hook for backends that keep per-root state."""

    def write_record(self, key: str, record: Record) -> None:
        """Atomically write one record as a JSON document."""
        self.write(key, encode(record))

    def iter_files(self, prefix: str) -> Iterator[FileInfo]:
        """FileInfo for every file under `prefix`."""
        for key in self.list(prefix):
            info = self.info(key)
            if info is not None:
                yield info
