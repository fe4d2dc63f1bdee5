"""Append-only event streams: one segment per writer, read back as one folded stream.

A stream ``<stream>/`` holds one segment per writer (``<writer>.jsonl``; the writer id
defaults to the pid, and a forked child gets its own segment automatically). Writers never
share a segment, so appends need no lock; on POSIX each record is one `os.write` on an
O_APPEND descriptor, so a line survives ``os._exit()``. Readers fold every segment; a line
that does not decode (a torn tail, a newer schema) is skipped and counted.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from .keys import join, validate_key
from .records import _ENCODER, Decoded, Record, RecordCodec, RecordError, encode, encode_into

if TYPE_CHECKING:
    from .base import Appender, StoreBase

T = TypeVar("T")
logger = logging.getLogger(__name__)
SEGMENT_SUFFIX = ".jsonl"

# `append` is the hot path (the benchmark's target is >= 300k records/s): bind what it calls.
_encode = _ENCODER.encode
_encode_into = encode_into
_write = os.write
_thread = threading.get_ident
_NEWLINE = b"\n"

# The current pid, refreshed in a forked child: `append` compares against it instead of
# calling os.getpid() (a system call) on every record.
_pid = os.getpid()


# Every live log, so a forked child can give each a fresh slow-path lock (`_after_fork`).
_LOGS: weakref.WeakSet[EventLog] = weakref.WeakSet()


def _after_fork() -> None:
    """In a forked child: refresh the pid, and replace every log's slow-path lock, which a
    thread of the parent may have held at the fork (the child would then wait for it
    forever; that thread does not exist in the child)."""
    global _pid
    _pid = os.getpid()
    for log in list(_LOGS):
        log._slow_path = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class EventLog:
    """Writer and reader of one stream in one store."""

    def __init__(
        self,
        store: StoreBase,
        stream: str,
        *,
        writer: str | None = None,
        truncate_first: bool = False,
    ) -> None:
        self.store = store
        self.stream = stream
        self._fixed_writer = None if writer is None else validate_key(writer)
        self._truncate_first = truncate_first
        self._appender: Appender | None = None
        self._pid = -1
        # Hot path: the appender's raw descriptor when it has one (one os.write a record),
        # and a line buffer reused by the thread that opened it (encoding into a reused
        # buffer is ~2x faster than allocating the bytes of every line). Another thread
        # allocates its own line, so two threads never share the buffer.
        self._fd = -1
        self._line = bytearray()
        self._owner = -1
        self._slow_path = threading.Lock()
        _LOGS.add(self)

    @property
    def writer(self) -> str:
        return self._fixed_writer or str(os.getpid())

    @property
    def segment_key(self) -> str:
        return join(self.stream, self.writer + SEGMENT_SUFFIX)

    def _open(self) -> Appender:
        if self._appender is not None and self._pid == os.getpid():
            self._appender.close()
        self._pid = os.getpid()
        self._appender = self.store.open_appender(self.segment_key, truncate=self._truncate_first)
        self._fd = self._appender.fileno()
        self._owner = _thread() if self._fd >= 0 else -1
        return self._appender

    def append(self, record: Record) -> None:
        """Append one record to this process's segment (durable against `os._exit`)."""
        if self._owner == _thread() and self._pid == _pid:
            # Hot path (the thread that opened the descriptor, in the process that opened
            # it): encode into the reused buffer, one os.write.
            line = self._line
            _encode_into(record, line)  # truncates the buffer to this record
            line.append(10)  # the newline
            _write(self._fd, line)
            return
        # Any other thread (a cache's background upkeep) or the first append: one at a
        # time, so two first appends never open two appenders, one closing the other's
        # descriptor, and an appender that rewrites its segment is never raced.
        line_bytes = _encode(record) + _NEWLINE
        with self._slow_path:
            if self._pid != _pid or self._appender is None:
                self._open()
            if self._fd >= 0:
                _write(self._fd, line_bytes)
            else:
                self._appender.write(line_bytes)  # type: ignore[union-attr]

    def descriptor(self) -> int:
        """This process's segment descriptor when each record is one `os.write` on it (local
        disk), else -1 (S3, memory; or nothing appended yet in this process).

        Appending a record yourself as one ``os.write(fd, encode_line(record))`` is exactly
        `append`; the manifest ledger does so to stay at one Python frame per line.
        """
        return self._fd if self._pid == _pid else -1

    def append_many(self, records: Sequence[Record]) -> None:
        """Append several records with one write."""
        if self._pid != _pid or self._appender is None:
            self._open()
        self._appender.write(b"".join(encode(r) + b"\n" for r in records))  # type: ignore[union-attr]

    def close(self) -> None:
        if self._appender is not None and self._pid == os.getpid():
            self._appender.close()
        self._appender = None
        self._fd = -1
        self._owner = -1

    # ---------------------------------------------------------------- read
    def segments(self) -> list[str]:
        return [k for k in self.store.list(self.stream) if k.endswith(SEGMENT_SUFFIX)]

    def segment_data(self) -> Iterator[tuple[str, bytes]]:
        """Each non-empty segment's key and bytes, in segment order (for folds that work a
        segment at a time: every segment has exactly one writer). A segment that is not a
        regular file (`NotRegularFile`: a FIFO, a link) is skipped with a warning: one bad
        segment never makes the stream unreadable, nor hangs its reader."""
        for key in self.segments():
            try:
                data = self.store.read(key)
            except RecordError as exc:
                logger.warning("event stream %s/%s: segment %s skipped: %s",
                               self.store.url, self.stream, key, exc.problem)  # fmt: skip
                continue
            if data:
                yield key, data

    def read(self, types: Sequence[type[Record]] | RecordCodec) -> Decoded:
        """Every decodable record of every segment (segment order, then line order)."""
        codec = types if isinstance(types, RecordCodec) else RecordCodec(types)
        out = Decoded()
        for _key, data in self.segment_data():
            out.extend(codec.decode_lines(data))
        return out

    def fold(
        self,
        types: Sequence[type[Record]] | RecordCodec,
        step: Callable[[T, Record], T],
        initial: T,
    ) -> tuple[T, int]:
        """Reduce the stream with `step`; returns the state and the skipped-line count."""
        decoded = self.read(types)
        state = initial
        for record in decoded.records:
            state = step(state, record)
        return state, decoded.skipped

    def delete(self) -> int:
        """Remove the whole stream (every writer's segment)."""
        self.close()
        return self.store.delete_tree(self.stream)
