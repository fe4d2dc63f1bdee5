"""`StoreBase`: the byte operations and the publication protocol every backend shares.

`Store` (``store.py``) adds the protocols that are built from these operations: named
locks and event logs. The split keeps the imports one-way: locks and event logs are
written against `StoreBase`, and `Store` is assembled on top of all three. Below it, the
helpers `StoreBase` is assembled from (`operations.py`, `publication.py`, `staging.py`,
`appenders.py`, `records.py`, `debris.py`) are written against `protocol.ByteStore`.

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
* ``local_paths`` - every key is a file on this machine. Two stores that both have it copy
  verified files in the kernel (`verified_copy`); the hot-path checks are plain `stat`s.
* ``durable`` - what a write or a publication made visible has reached stable storage
  (fsync before the rename on NFS/Lustre; an acknowledged PUT on S3). Callers never fsync
  themselves: the operations that write do it when this flag says so.

Besides the primitives, the operations domain code needs are here too, so that nothing
above the layer touches a store's files (the generic versions are in `operations.py`,
backends override them where they can do better): `read_published` and `check_sizes`
(the cache-hit hot path), `digest`/`digest_tree`, `open_write`/`write_from`,
and the two documented doors to real directories, `local_dir_of` (a
toolchain loading a published entry) and `local_output` / `Staging.output_dir` (a tool
writing its own output files).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import posixpath
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import IO, TYPE_CHECKING, Any

from . import debris, debris_removal, operations, publication
from ._atomic import replacing
from .appenders import Appender, SegmentAppender
from .debris import Debris, Removal, Seen, Survey, Upload
from .digests import Expected, FileDigest, digest_stream
from .errors import StoreError, too_many_names
from .keys import join, validate_key, validate_prefix
from .layout import COMMIT_RECORD, LOCKS_DIR, STAGING_DIR, TRASH_DIR, VERSIONS_DIR
from .protocol import Capabilities, FileInfo
from .publication import Publication
from .records import RECORD_MAX_BYTES, Record, encode
from .staging import Staging

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; annotations only

__all__ = [  # the names other modules of the layer (and its tests) import from here
    "COMMIT_RECORD",
    "LOCKS_DIR",
    "STAGING_DIR",
    "TRASH_DIR",
    "VERSIONS_DIR",
    "Appender",
    "Capabilities",
    "FileInfo",
    "Publication",
    "SegmentAppender",
    "Staging",
    "StoreBase",
]


def bounded_names(store: StoreBase, prefix: str, names: builtins.list[str],
                  max_names: int | None) -> builtins.list[str]:  # fmt: skip
    """`names` (a listing of `prefix`), or `ListingTooLarge` when more than `max_names`."""
    if max_names is not None and len(names) > max_names:
        raise too_many_names(store.url, prefix, max_names)
    return names


PRIVATE_FILE = 0o600
"""A `StoreBase.write` mode: readable and writable by this user only, for every file that can
hold a command line or an environment (a run spec, a manifest), redacted or not."""


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
    def read(self, key: str, *, max_size: int | None = None) -> bytes | None:
        """The bytes stored at `key`, or None when there is no such key.

        `max_size`: a reader of records gives `records.RECORD_MAX_BYTES` (`RecordCodec.read`
        and `read_published` do): a larger file is `RecordTooLarge` and never read whole
        (on S3 one ranged GET of the bound plus one byte). Without it the whole file is
        read (streams, content). On a folder store anything but a regular file at `key` -
        a symbolic link (never followed), a FIFO (never waited on), a device, a socket -
        is `NotRegularFile` (`regular.py`); both are `RecordError`s, a defect of that key.
        """

    @abstractmethod
    def write(self, key: str, data: bytes, *, mode: int | None = None) -> None:
        """Store `data` at `key` atomically: readers see the old or the new bytes.

        `mode`: the file's permission bits on a folder store, whatever the umask (``0o600``
        for a file that holds a command line or an environment); None: the store's usual
        ones. A store without file modes (S3, memory) ignores it.
        """

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

    def list_dir(self, prefix: str = "", *,
                 max_names: int | None = None) -> builtins.list[str]:  # fmt: skip
        """Names of the immediate children (files and directories) of `prefix`.

        `max_names`: a folder of a shared tier holding more is `ListingTooLarge` (the
        in-memory store lists it whole first; S3 and folders stop reading past it)."""
        base = self._path(prefix)
        try:
            entries = self.fs.ls(base, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = {posixpath.basename(str(e).rstrip("/")) for e in entries}
        return bounded_names(self, prefix, sorted(n for n in names if n), max_names)

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
        try:
            with self.open_read(key) as src, replacing(local_path, durable=False) as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
        except FileNotFoundError:
            return False
        return True

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
    # The protocol itself is `publication.py`; these are its doors.
    def stage(self, final: str) -> Staging:
        """Start building the directory `final`; see `Staging`."""
        validate_key(final)
        return Staging(self, final, publication.staging_prefix(self, final))

    def published(self, final: str) -> str | None:
        """The prefix holding the published content of `final`, or None if unpublished.

        The hot path (one `stat`, or one read of the commit record): a broken commit
        record reads as unpublished here; `publication` tells it apart.
        """
        return publication.published(self, final)

    def publication(self, final: str) -> Publication:
        """What `final` is now: absent, published or broken, with its prefix and version.

        A commit record that does not read, or names a version without files, is broken
        (`Publication.problem` says how). Costs what `published` does, plus one listing
        of the version on a commit-record store.
        """
        return publication.publication(self, final)

    def published_children(self, parent: str = "") -> builtins.list[str]:
        """Names under `parent` holding a publication: directories (rename stores), or
        names with a commit record (commit-record stores), broken ones included."""
        names = [n for n in self.list_dir(parent) if not n.startswith(".")]
        if self.capabilities.atomic_rename:
            return [n for n in names if self._is_dir(join(parent, n))]
        return [n for n in names if self.exists(join(parent, n, COMMIT_RECORD))]

    def unpublish(self, final: str, version: str | None = None) -> bool:
        """Withdraw `final` atomically, then delete its files; True if this call did.

        With `version` (`Publication.version` of what the caller judged), only while
        `final` is still that publication: one republished meanwhile stays, and of two
        withdrawals of one version one at most returns True. Without, whatever is
        published (a broken commit record too). Readers holding the old content prefix
        may fail to read it afterwards; they must treat that as a miss.
        """
        return publication.unpublish(self, final, version)

    def _commit_staged(self, final: str, prefix: str) -> bool:
        return publication.commit_staged(self, final, prefix)

    def _write_unpublished(self, key: str, data: bytes) -> None:
        """Write a file inside a staging area (atomicity is provided by the commit)."""
        self.write(key, data)

    def _put_file_unpublished(self, key: str, local_path: str) -> None:
        self.put_file(key, local_path)

    def _write_from_unpublished(self, key: str, reader: IO[bytes]) -> int:
        return self.write_from(key, reader)

    def _is_dir(self, key: str) -> bool:
        try:
            return bool(self.fs.isdir(self._path(key)))
        except FileNotFoundError:
            return False

    def _rename_dir(self, src: str, dst: str, *, publish: bool = False) -> bool:
        raise StoreError(f"{self.url} cannot rename directories atomically")

    def _dir_version(self, key: str) -> str | None:
        """The identity of the directory at `key` (None when absent): rename stores."""
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

    # ------------------------------------------- operations the domain code needs
    def read_published(self, final: str, rel: str, *, max_size: int | None = RECORD_MAX_BYTES
                       ) -> tuple[str, bytes | None] | None:  # fmt: skip
        """`(prefix, bytes of rel in it)` for a published `final`, else None.

        The bytes are None when `final` is published but has no file `rel` (a defective
        publication, not a missing one). The first step of a cache hit in one call: on
        local disk one read of the file, the directory looked at only when it is absent.
        `rel` is a record (entry.json, unpacked.json): read with `max_size`, by default
        `RECORD_MAX_BYTES` (see `read`; `RecordTooLarge`, `NotRegularFile`).
        """
        return operations.read_published(self, final, rel, max_size)

    def check_sizes(self, prefix: str, files: Mapping[str, Expected]) -> None:
        """Every one of `files` (keys relative to `prefix`) exists with its expected size.

        `IntegrityError` names the first that does not. The batch stat of a cache hit: one
        `stat` per file on local disk, one listing of the prefix on S3.
        """
        operations.check_sizes(self, prefix, files)

    def digest(self, key: str) -> FileDigest | None:
        """Size, SHA-256 and BLAKE3 of the file at `key`, from one read; None when absent."""
        try:
            with self.open_read(key) as reader:
                return digest_stream(reader)
        except FileNotFoundError:
            return None

    def digest_tree(self, prefix: str) -> dict[str, FileDigest]:
        """`digest` of every file under `prefix`, by key relative to it."""
        return operations.digest_tree(self, prefix)

    def open_write(self, key: str) -> AbstractContextManager[IO[bytes]]:
        """A binary file whose bytes appear at `key`, atomically, when the block exits.

        For writers that stream (tensor encoders): on local disk a temp file beside the key
        (fsynced when `durable`) renamed into place; elsewhere one object write. Nothing
        appears at `key` if the block raises.
        """
        return operations.open_write(self, key)

    def write_from(self, key: str, reader: IO[bytes]) -> int:
        """Store everything `reader` yields at `key` atomically; returns the byte count."""
        data = reader.read()
        self.write(key, data)
        return len(data)

    def local_output(self, prefix: str) -> AbstractContextManager[str]:
        """A real directory for a tool that writes its own output files (the Neuron
        runtime's tensor serializer); they are the files under `prefix` after the block.

        A documented door around the store (docs/storage.md), for writers that only take a
        directory: on local disk the directory of `prefix` itself, elsewhere a scratch
        directory uploaded when the block exits normally. The caller neither reads nor
        writes there itself; it asks the store what the tool wrote. If the block raises,
        what the tool wrote may remain under `prefix` on local disk (`delete_tree` it).
        """
        return operations.local_output(self, prefix)

    def local_dir_of(self, prefix: str) -> str | None:
        """The real directory holding the published `prefix`, or None without local paths.

        The one door around the store for reading (docs/storage.md): a toolchain that can
        only load a compiled artifact from a directory is handed this. Nothing else reads
        or writes store files through it.
        """
        return self.local_path(validate_key(prefix))

    def rename(self, src: str, dst: str) -> bool:
        """Move the file or the directory at `src` to `dst`; False when nothing is there.

        For content whose place changes after it was written (a profile run sets a
        rejected window's traces and an earlier launch's log aside). A file at `dst` is
        replaced; a directory is moved to a `dst` that does not exist yet. One `rename(2)`
        on local disk; elsewhere a copy of each file, then `src` deleted (not atomic).
        """
        return operations.rename(self, src, dst)

    # ------------------------------------------- what is there (garbage collection)
    def survey(
        self, *, older_than: float, lease_grace: float = 600.0, now: float | None = None
    ) -> Survey:
        """Everything under the root from one walk (`debris.py`): the publications
        directly under it, what nobody will use again (`Debris`) untouched for
        `older_than` seconds (leases: released or expired `lease_grace` seconds ago), what
        was looked at and kept, and every other file with its size and time."""
        return debris.survey(self, older_than=older_than, lease_grace=lease_grace, now=now)

    def remove_debris(self, item: Debris) -> Removal:
        """Remove one `Debris` of `survey`, unless it changed since (then "changed")."""
        return debris_removal.remove(self, item)

    def _walk(self, prefix: str = "") -> builtins.list[Seen]:
        """Every file under `prefix` with size and time (local disk: directories too)."""
        return debris.generic_walk(self, prefix)

    def _unfinished_uploads(self) -> builtins.list[Upload]:
        """Multipart uploads under the root never completed nor aborted (S3)."""
        return []

    def _abort_upload(self, key: str, upload_id: str) -> bool:
        raise StoreError(f"{self.url} has no multipart uploads")

    def _remove_empty_dir(self, prefix: str) -> None:
        """Remove the directory of `prefix` if it is empty (stores with directories)."""
        debris_removal.remove_empty_dir(self.local_path(prefix))
