"""Failure notes: what a failed compile leaves for the processes waiting on its key.

A rank that waited on a key's lock while its holder compiled must not compile the key
again when that compile failed (it would fail the same way, one rank after another, each
paying the compile). The holder writes ``.failures/<key>.json`` in the tier before it
releases the lock; a waiter that takes the lock afterwards reads the note and raises the
holder's error at once. A note older than the wait says nothing about this compile, and
a successful compile removes it. The note's directory, record and age rule are declared
with every other per-key note's in `notes.py` (`FAILURES`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

from vllm_neuron.backends import Store
from vllm_neuron.backends.records import RecordError, encode

from .notes import FAILURE_NOTES, FAILURES, FAILURES_DIR, FailureNote

__all__ = ["FAILURES_DIR", "FailureNote", "clear_failure_note", "describe", "recent_failure",
           "write_failure_note"]  # fmt: skip


def _note_key(key: str) -> str:
    return FAILURES.path(key)


def describe(exc: BaseException) -> str:
    """How a failure is named in notes and events: ``"<type>: <message>"``."""
    return f"{type(exc).__name__}: {exc}"


def write_failure_note(store: Store, key: str, error: str) -> Exception | None:
    """Leave `error` for the waiters on `key`; the store's exception if it refused the note.

    Best-effort: a store that cannot take the note costs the waiters a compile, never the
    failing process its real error, so the exception is returned, not raised.
    """
    note = FailureNote(at=time.time(), error=error, pid=os.getpid(), host=socket.gethostname())
    try:
        store.write(_note_key(key), encode(note))
    except Exception as exc:  # noqa: BLE001 - see above
        return exc
    return None


def recent_failure(store: Store, key: str, *, since: float) -> FailureNote | None:
    """The note of a compile of `key` that failed at or after `since`, if any."""
    try:
        note = FAILURE_NOTES.read(store, _note_key(key))
    except RecordError:
        return None  # a torn note says nothing about this compile
    return note if note is not None and note.at >= since else None


def clear_failure_note(store: Store, key: str) -> None:
    """Forget a key's failure (it compiled since). Best-effort, like the note itself."""
    with contextlib.suppress(Exception):
        store.delete(_note_key(key))
