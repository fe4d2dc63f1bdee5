"""`ByteStore`: what the layer's helpers need of a store, below `StoreBase`.

The helpers that `StoreBase` is built from - the generic operations (`operations.py`),
the publication protocol (`publication.py`), staging areas (`staging.py`), segment
appenders (`appenders.py`) and the record codec (`records.py`) - are written against
this structural type, not against `StoreBase`, so every import in the layer runs one
way: `base.py` imports them, none of them imports `base.py`. `StoreBase` (every backend)
satisfies it.

`Capabilities` and `FileInfo` live here too, since the protocol names them; `base.py`
re-exports both.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Protocol

import msgspec

from .digests import FileDigest


@dataclass(frozen=True)
class Capabilities:
    """What a store can promise; protocols choose their strategy from these flags."""

    profile: str
    atomic_rename: bool
    kernel_locks: bool
    native_append: bool
    local_paths: bool
    durable: bool = False


class FileInfo(msgspec.Struct, frozen=True, gc=False):
    """Size and modification time (seconds since the epoch) of one stored file.

    A msgspec struct, not a frozen dataclass: `info` is on the manifest emit's path once
    per entry, and a frozen dataclass's ``__init__`` costs more than the `stat` itself.
    """

    key: str
    size: int
    mtime: float


class ByteStore(Protocol):
    """The operations of a store that the layer's helper modules call (see `StoreBase`)."""

    url: str
    capabilities: Capabilities

    # primitives
    def read(self, key: str, *, max_size: int | None = None) -> bytes | None: ...
    def write(self, key: str, data: bytes, *, mode: int | None = None) -> None: ...
    def create(self, key: str, data: bytes) -> bool: ...
    def info(self, key: str) -> FileInfo | None: ...
    def list(self, prefix: str = "") -> builtins.list[str]: ...
    def list_dir(self, prefix: str = "", *,
                 max_names: int | None = None) -> builtins.list[str]: ...
    def delete(self, key: str) -> bool: ...
    def delete_tree(self, prefix: str) -> int: ...
    def put_file(self, key: str, local_path: str) -> None: ...
    def open_read(self, key: str) -> IO[bytes]: ...
    def write_from(self, key: str, reader: IO[bytes]) -> int: ...
    def local_path(self, key: str) -> str | None: ...
    def iter_files(self, prefix: str) -> Iterator[FileInfo]: ...

    # operations built on them
    def digest(self, key: str) -> FileDigest | None: ...
    def digest_tree(self, prefix: str) -> dict[str, FileDigest]: ...
    def published(self, final: str) -> str | None: ...

    # the backend's side of publication
    def _write_unpublished(self, key: str, data: bytes) -> None: ...
    def _put_file_unpublished(self, key: str, local_path: str) -> None: ...
    def _write_from_unpublished(self, key: str, reader: IO[bytes]) -> int: ...
    def _commit_staged(self, final: str, prefix: str) -> bool: ...
    def _is_dir(self, key: str) -> bool: ...
    def _rename_dir(self, src: str, dst: str, *, publish: bool = False) -> bool: ...
    def _dir_version(self, key: str) -> str | None: ...
