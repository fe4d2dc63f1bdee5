"""Appenders: a single writer's handle on one event-log segment."""

from __future__ import annotations

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
