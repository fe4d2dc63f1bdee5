"""Failure notes: what a failed compile leaves for the processes waiting on its key.

A rank that waited on a key's lock while its holder compiled must not compile the key
again when that compile failed (it would fail the same way, one rank after another, each
paying the compile). The holder writes ``.failures/<key>.json`` in the tier before it
releases the lock; a waiter that takes the lock afterwards reads the note and raises the
holder's error at once. A note older than the wait says nothing about this compile, and
a successful compile removes it. The note's directory, record and age rule are declared
with every other per-key note's in `notes.py` (`FAILURES`).

A note is advice, and bounded, because anyone who can write the tier can write one (docs/
trust.md): it can make a node compile, never stop it for good.

- A note dated more than `CLOCK_SKEW` ahead of this process's clock is ignored (one warning
  per key): no honest node's clock is that far off, and a note "from the year 2100" would
  otherwise stop the graph for ever.
- A note stops this node's compile of a key for at most one retry period
  (VLLM_NEURON_COMPILE_RETRY_AFTER), counted from the first time a note stopped it for that
  key (not per note, so a note rewritten at every look counts from the first). After that
  this process compiles the key itself, whatever notes say (one warning). The first time is
  kept twice: in this process (`_FIRST_STOPPED`, monotonic, per tier and key), and - the
  caller's ``stopped_in``, this node's own local tier - in ``.stopped/<key>.json``
  (`notes.STOPPED`, this node's clock), so that a server that crashes and starts again is
  not stopped anew by each process; whichever has run longer decides. `cache gc` collects
  that note after two retry periods (`notes.Expiry.TWO_COOL_DOWNS`); one older than that,
  or dated past `CLOCK_SKEW` ahead, is read as absent (written anew), so a stale or planted
  one neither stops a key nor disables the bound; the key's compile or fetch removes it
  (`forget_stopped`).
- The caller may ask for a signature (`recent_failure`'s ``verify``: under ``require``, a
  builder's note on the remote): a note without one that verifies is ignored (one warning).
- What a note says reaches a message only through `printable`: capped at
  `NOTE_TEXT_LIMIT` characters, control characters and line breaks escaped, so a note
  cannot forge log lines or flood a log. What a note is written with passes the secret
  redactor first (`vllm_neuron.envs.redact_text`): the note lands on a shared tier.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from typing import NamedTuple

import msgspec

from vllm_neuron.backends import Store
from vllm_neuron.backends.records import RecordError, encode
from vllm_neuron.envs import redact_text

from .notes import (
    FAILURE_NOTES,
    FAILURES,
    FAILURES_DIR,
    STOPPED,
    STOPPED_NOTES,
    FailureNote,
    StoppedNote,
)
from .text import NOTE_TEXT_LIMIT, printable  # one printable for every quoted text

__all__ = ["CLOCK_SKEW", "FAILURES_DIR", "NOTE_TEXT_LIMIT", "FailureNote", "NoteSigner",
           "NoteVerifier", "clear_failure_note", "describe", "note_message", "note_payload",
           "printable", "recent_failure", "write_failure_note"]  # fmt: skip

logger = logging.getLogger("vllm_neuron.compile")

CLOCK_SKEW = 300.0
"""Seconds a note may be dated ahead of this process's clock and still count: five minutes,
well past what NTP-synchronised nodes drift, and what S3 itself tolerates (a request signed
15 minutes off is refused). A note dated further ahead is ignored."""

NOTE_DOMAIN = "vllm-neuron compile failure note v1"
"""What a failure note's signature covers first: no entry signature (another domain) passes
for a note's, nor the reverse."""

class NoteSigner(NamedTuple):
    """A builder's key, as a note is signed with it: its id, and its signature (hex) over a
    note's payload (`trust/signing.sign_note`)."""

    key_id: str
    sign: Callable[[bytes], str]


NoteVerifier = Callable[[FailureNote, bytes], str | None]
"""Why a note (and its payload) is not to be believed, or None when it is."""

_FIRST_STOPPED: dict[tuple[str, str], float] = {}
"""(tier URL, key) -> time.monotonic() when a note first stopped this process's compile of
the key. Plain dict operations (atomic under the GIL); one entry per key ever stopped."""
_WARNED: set[tuple[str, str, str]] = set()
"""(tier URL, key, why) of every note already warned about: one warning per key and why."""


def _note_key(key: str) -> str:
    return FAILURES.path(key)


def describe(exc: BaseException) -> str:
    """How a failure is named in notes and events: ``"<type>: <message>"``."""
    return f"{type(exc).__name__}: {exc}"


def note_payload(key: str, note: FailureNote) -> bytes:
    """The canonical bytes a failure note's signature covers: its domain, signer, key (the
    note's file names it: a note cannot be moved to another key), date, error, host and
    pid."""
    identity = {"domain": NOTE_DOMAIN, "signer": note.signer, "key": key, "at": note.at,
                "error": note.error, "host": note.host, "pid": note.pid}  # fmt: skip
    return msgspec.json.encode(identity, order="sorted")


def note_message(key: str, note: FailureNote, where: str | None = None) -> str:
    """The error a note stops a compile with, its text made `printable`."""
    recorded = "" if where is None else f" (recorded in {printable(where, 200)})"
    return (f"compile of {key} failed in process {note.pid} on {printable(note.host, 200)}"
            f"{recorded}: {printable(note.error)}")  # fmt: skip


def write_failure_note(store: Store, key: str, error: str, *,
                       sign: NoteSigner | None = None) -> Exception | None:  # fmt: skip
    """Leave `error` for the waiters on `key`; the store's exception if it refused the note.

    The error is redacted (a compile's message may hold a token from the environment) and
    capped before it is written; `sign` (a builder's key) signs the note.
    Best-effort: a store that cannot take the note costs the waiters a compile, never the
    failing process its real error, so the exception is returned, not raised.
    """
    note = FailureNote(at=time.time(), error=redact_text(error)[:NOTE_TEXT_LIMIT],
                       pid=os.getpid(), host=socket.gethostname())  # fmt: skip
    try:
        if sign is not None:
            note = msgspec.structs.replace(note, signer=sign.key_id)  # signed with the rest
            note = msgspec.structs.replace(note, signature=sign.sign(note_payload(key, note)))
        store.write(_note_key(key), encode(note))
    except Exception as exc:  # noqa: BLE001 - see above
        return exc
    return None


def _warn_once(store: Store, key: str, why: str, message: str, *args: object) -> None:
    mark = (store.url, key, why)
    if mark not in _WARNED:
        _WARNED.add(mark)
        logger.warning(message, *args)


def recent_failure(
    store: Store,
    key: str,
    *,
    since: float,
    retry_after: float | None = None,
    verify: NoteVerifier | None = None,
    stopped_in: Store | None = None,
) -> FailureNote | None:
    """The note of a compile of `key` that failed at or after `since`, if any, and if it may
    stop this process (see the module doc): not dated past `CLOCK_SKEW` ahead, accepted by
    `verify` (when given), and - with `retry_after` - not stopping this node's compile of
    `key` for longer than `retry_after` seconds already (in this process, and as
    `stopped_in`, this node's own local tier, remembers across processes)."""
    try:
        note = FAILURE_NOTES.read(store, _note_key(key))
    except (RecordError, ValueError, RecursionError):
        return None  # a torn note says nothing about this compile
    if note is None or not math.isfinite(note.at) or note.at < since:
        return None
    if note.at > time.time() + CLOCK_SKEW:
        _warn_once(store, key, "future", "compile cache: ignoring the failure note of %s in %s: "
                   "it is dated %.0f s ahead of this node's clock (more than the %.0f s a "
                   "clock may be off)", key, store.url, note.at - time.time(), CLOCK_SKEW)
        return None
    if verify is not None:
        why = verify(note, note_payload(key, note))
        if why is not None:
            _warn_once(store, key, "untrusted", "compile cache: ignoring the failure note of "
                       "%s in %s: %s", key, store.url, printable(why, 200))  # fmt: skip
            return None
    if retry_after is not None:
        now = time.monotonic()
        first = _FIRST_STOPPED.setdefault((store.url, key), now)
        stopped = now - first
        if stopped_in is not None:
            stopped = max(stopped, time.time() - _first_stopped_on_node(stopped_in, key,
                                                                          retry_after))
        if stopped >= retry_after:
            _warn_once(store, key, "retried", "compile cache: failure notes in %s have "
                       "stopped the compile of %s for %.0f s (VLLM_NEURON_COMPILE_RETRY_AFTER); "
                       "compiling it here", store.url, key, stopped)  # fmt: skip
            return None
    return note


def _first_stopped_on_node(local: Store, key: str, retry_after: float) -> float:
    """When (epoch seconds) notes first stopped this node's compile of `key`, as `local`'s
    ``.stopped/<key>.json`` says; now, when it says nothing usable (absent, unreadable,
    dated more than `CLOCK_SKEW` ahead of this clock - a clock set back, or a note planted
    to stop the key - or older than two retry periods: a stale one, of a stop long over,
    or planted to disable the bound), the note then written (created if absent, so that of
    two processes the first one's time holds). A tier that refuses it costs the bound
    across restarts, never the look: this process's own count still holds (one
    warning)."""
    path = STOPPED.path(key)
    now = time.time()
    try:
        try:
            held = STOPPED_NOTES.read(local, path)
        except (RecordError, ValueError, RecursionError):
            held = None
            local.delete(path)  # torn or not ours: written anew below
        if held is not None and math.isfinite(held.at) \
                and now - 2 * retry_after <= held.at <= now + CLOCK_SKEW:  # fmt: skip
            return min(held.at, now)
        fresh = encode(StoppedNote(at=now, pid=os.getpid()))
        if held is not None:
            local.write(path, fresh)
        elif not local.create(path, fresh):  # another process of this node was first
            again = STOPPED_NOTES.read(local, path)
            if again is not None and math.isfinite(again.at):
                return min(again.at, now)
    except Exception as exc:  # noqa: BLE001 - see above
        _warn_once(local, key, "stopped-note", "compile cache: cannot keep when failure "
                   "notes first stopped the compile of %s in %s (%s); counted in this process "
                   "only", key, local.url, printable(str(exc), 200))  # fmt: skip
    return now


def forget_stopped(local: Store, key: str) -> None:
    """`key` compiled or was fetched on this node: no failure note stops it any more, so
    when notes first stopped it is forgotten (this process's count, and `local`'s
    ``.stopped/<key>.json``); a later note counts its retry period anew. Best-effort."""
    for stopped in [k for k in _FIRST_STOPPED if k[1] == key]:
        _FIRST_STOPPED.pop(stopped, None)
    with contextlib.suppress(Exception):
        local.delete(STOPPED.path(key))


def clear_failure_note(store: Store, key: str) -> None:
    """Forget a key's failure (it compiled since). Best-effort, like the note itself."""
    with contextlib.suppress(Exception):
        store.delete(_note_key(key))
