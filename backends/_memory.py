"""In-memory store: the fast backend the domain logic is property-tested against.

Built on fsspec's MemoryFileSystem with its own private file table (fsspec's default is a
class-level global store, and its "xb" is check-then-write). Each `memory://name`
gets one table, shared by every `open_store` of that name in this process and by nothing
else; `memory://` alone is anonymous and always fresh.

It deliberately has S3's weaknesses (no directory rename, no native append, no kernel
locks), so the commit-record and lease protocols run against it in every fast test and a
bug that only the slow backend would show cannot hide here.
"""

from __future__ import annotations

import builtins
import io
import threading
import time
from typing import IO

from fsspec.implementations.memory import MemoryFileSystem

from .base import Appender, Capabilities, FileInfo, SegmentAppender
from .debris import Seen
from .errors import RecordTooLarge
from .keys import validate_key
from .store import Store

_TABLES: dict[str, MemoryFileSystem] = {}
_TABLES_LOCK = threading.Lock()


def _filesystem_for(name: str) -> MemoryFileSystem:
    if not name:
        return MemoryFileSystem(global_store=False, skip_instance_cache=True)
    with _TABLES_LOCK:
        fs = _TABLES.get(name)
        if fs is None:
            fs = _TABLES[name] = MemoryFileSystem(global_store=False, skip_instance_cache=True)
        return fs


def forget_memory_store(name: str) -> None:
    """Drop the table behind `memory://name` (tests use it to simulate a fresh machine)."""
    with _TABLES_LOCK:
        _TABLES.pop(name, None)


class MemoryStore(Store):
    """A store in this process's memory, isolated per `memory://name`."""

    def __init__(self, url: str, name: str) -> None:
        fs = _filesystem_for(name)
        super().__init__(url, fs, "/" + name if name else "/anon")
        # One mutex per table: MemoryFileSystem is not thread-safe for check-then-write.
        self._mutex: threading.RLock = fs.__dict__.setdefault("_vn_mutex", threading.RLock())
        self._mtimes: dict[str, float] = fs.__dict__.setdefault("_vn_mtimes", {})
        self.capabilities = Capabilities(
            profile="memory",
            atomic_rename=False,
            kernel_locks=False,
            native_append=False,
            local_paths=False,
            durable=False,
        )

    def read(self, key: str, *, max_size: int | None = None) -> bytes | None:
        path = self._path(validate_key(key))
        with self._mutex:
            try:
                data = self.fs.cat_file(path, start=0, end=None if max_size is None
                                        else max_size + 1)  # fmt: skip
            except (FileNotFoundError, IsADirectoryError):
                return None
        if max_size is not None and len(data) > max_size:
            raise RecordTooLarge(f"{self.url}/{key}", f"is larger than the {max_size} bytes "
                                                      "a record may have; not read")  # fmt: skip
        return bytes(data)

    def write(self, key: str, data: bytes, *, mode: int | None = None) -> None:
        path = self._path(validate_key(key))
        with self._mutex:
            self.fs.pipe_file(path, bytes(data))
            self._mtimes[path] = time.time()

    def create(self, key: str, data: bytes) -> bool:
        path = self._path(validate_key(key))
        with self._mutex:
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, bytes(data))
            self._mtimes[path] = time.time()
            return True

    def info(self, key: str) -> FileInfo | None:
        path = self._path(validate_key(key))
        with self._mutex:
            try:
                details = self.fs.info(path)
            except FileNotFoundError:
                return None
            if details.get("type") != "file":
                return None
            return FileInfo(key, int(details["size"]), self._mtimes.get(path, 0.0))

    def list(self, prefix: str = "") -> list[str]:
        with self._mutex:
            return super().list(prefix)

    def list_dir(self, prefix: str = "", *,
                 max_names: int | None = None) -> builtins.list[str]:  # fmt: skip
        with self._mutex:
            return super().list_dir(prefix, max_names=max_names)

    def delete(self, key: str) -> bool:
        path = self._path(validate_key(key))
        with self._mutex:
            self._mtimes.pop(path, None)
            return super().delete(key)

    def delete_tree(self, prefix: str) -> int:
        with self._mutex:
            return super().delete_tree(prefix)

    def open_read(self, key: str) -> IO[bytes]:
        data = self.read(key)
        if data is None:
            raise FileNotFoundError(f"{self.url}: no such key {key!r}")
        return io.BytesIO(data)

    def open_appender(self, key: str, *, truncate: bool) -> Appender:
        return SegmentAppender(self, validate_key(key), truncate)

    def _walk(self, prefix: str = "") -> builtins.list[Seen]:
        with self._mutex:
            base = self._path(prefix)
            try:
                found = self.fs.find(base, withdirs=False, detail=True)
            except FileNotFoundError:
                return []
            out = []
            for path, details in found.items():
                rel = self._rel(path)
                if rel and details.get("type") == "file" and rel != prefix.strip("/"):
                    out.append(Seen(rel, int(details.get("size", 0)),
                                    self._mtimes.get(str(path), 0.0)))  # fmt: skip
            return out

    def set_mtime(self, key: str, mtime: float) -> None:
        """Back door for tests of age-based policies (prune, staging garbage collection)."""
        with self._mutex:
            self._mtimes[self._path(validate_key(key))] = mtime
