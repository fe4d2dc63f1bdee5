"""Appenders: a single writer's handle on one event-log segment."""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod

from .protocol import ByteStore


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

    def __init__(self, store: ByteStore, key: str, truncate: bool) -> None:
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


class FdAppender(Appender):
    """O_APPEND descriptor; each `write` is one `os.write`, so lines survive `os._exit()`.

    Created ``0600``: what is appended is a process's own output (a profiled server's log,
    which prints its command line and may print its environment), for its user only."""

    __slots__ = ("_fd", "_pid", "_path")

    def __init__(self, path: str, truncate: bool) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        self._path = path
        self._fd = os.open(path, flags, 0o600)
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

    def __del__(self) -> None:
        # A log nobody closed (a dropped cache, a CLI's store) gives its descriptor back when
        # collected - only in the process that opened it (a forked child may have reused the
        # number); `_pid` is unset when the open failed.
        if getattr(self, "_pid", -1) == os.getpid():
            self.close()
