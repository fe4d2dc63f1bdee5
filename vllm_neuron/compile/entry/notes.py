"""Every kind of per-key note a tier holds beside its entries, declared once: `NOTE_KINDS`.

Why one registry: the cache leaves small files about a key in dot-directories of a tier
(a failed compile, a withdrawal, an owed promotion, a host that could not load an entry, a
pin, an unpacked copy of a package). Each is written and read by the module whose behaviour
it records (`failure_notes.py`, `load_failure_notes.py`, `tiers/quarantine.py`,
`upkeep/owed.py`, `upkeep/eviction.py`, `tiers/unpacked.py`), but what must know them all -
the garbage collector (`upkeep/collect.py`), and what tells a note from an entry (`cache
ls`, `cache verify`, the report) - walks this list instead of importing six modules, so a
kind added here cannot be forgotten there: a kind needs an age rule (`Expiry`) to exist,
and `cache gc` collects it by that rule. (It once missed ``.load-failures/`` on a remote.)

The registry sits in `entry/` (what is written and returned), below every wing that writes a
note; so the record types live here too, and the behaviour modules import their directory,
record and codec from here. On-disk formats are unchanged: record tags, field names and
directory names are those earlier versions wrote, and notes written before records had
tags read as version 1 (`Untagged`).

Every directory starts with a dot and is none of the storage layer's own names
(`backends/layout.py`): a tier's listing of entries (`published_children`, and the
inventory's key check) never takes a note for an entry.
"""

from __future__ import annotations

import enum
import logging
import operator
import re
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from vllm_neuron.backends import FileDigest, Record, RecordCodec, Store, join
from vllm_neuron.backends.records import RecordError, Untagged

from .check import KEY_RE
from .text import printable

__all__ = [
    "FAILURES",
    "FAILURE_NOTES",
    "FAILURES_DIR",
    "LOAD_FAILURES",
    "LOAD_NOTES",
    "LOAD_NOTES_DIR",
    "NOTE_KINDS",
    "OPERATOR_NOTE_MIN_AGE",
    "OWED",
    "OWED_DIR",
    "OWED_NOTES",
    "PINS",
    "PINS_DIR",
    "PIN_RECORDS",
    "QUARANTINE",
    "QUARANTINE_DIR",
    "QUARANTINE_NOTES",
    "STOPPED",
    "STOPPED_DIR",
    "STOPPED_NOTES",
    "TAG_DIGITS",
    "UNPACKED",
    "UNPACKED_DIR",
    "UNPACKED_RECORDS",
    "Expiry",
    "FailureNote",
    "Layout",
    "LoadFailureNote",
    "NoteKind",
    "OwedPromotion",
    "Pin",
    "QuarantineNote",
    "StoppedNote",
    "UnpackedRecord",
    "copy_key",
    "kind_named",
    "kind_of",
]

R = TypeVar("R", bound=Record)
logger = logging.getLogger("vllm_neuron.compile")

NOTES_READ_MAX = 10_000
"""The most notes of one kind `NoteKind.read_all` lists and reads (each at most
`RECORD_MAX_BYTES`): a notes folder of a shared tier may hold millions of planted names,
and reading them would grow a node (or a report) without bound."""



OPERATOR_NOTE_MIN_AGE = 7 * 86400.0
"""Seconds a note written for the fleet's operators (a quarantine, a host that could not
load an entry) is kept at least, whatever the collector's bound: someone may still want to
read why."""


# ------------------------------------------------------------------ records
class FailureNote(Record, frozen=True, tag="compile-failure"):
    """``.failures/<key>.json``: the last failed compile of a key.

    ``signer`` and ``signature``: a builder's key id and its Ed25519 signature (hex) over
    the note (`failure_notes.note_payload`), so that under ``require`` only a builder's
    word stops a compile; empty in a note written without a key, or before notes were
    signed (such a note reads as before: readers that predate the fields ignore them).
    """

    at: float
    error: str  # "<type>: <message>"
    pid: int
    host: str
    signer: str = ""
    signature: str = ""


class StoppedNote(Record, frozen=True, tag="compile-stopped"):
    """``.stopped/<key>.json`` in a node's own local tier: when (epoch seconds, this node's
    clock) failure notes first stopped this node's compile of `key`, kept across restarts so
    that a process that crashes and starts again while a note is rewritten is stopped one
    retry period in all, not one per process (`failure_notes.recent_failure`)."""

    at: float
    pid: int


class LoadFailureNote(Record, frozen=True, tag="load-failure-note"):
    """Host ``host`` could not load entry ``key`` at ``at`` (epoch seconds): ``error``."""

    key: str
    at: float
    host: str
    error: str


class QuarantineNote(Record, frozen=True, tag="quarantine-note"):
    """Why `key` was withdrawn, and when (epoch seconds)."""

    key: str
    at: float
    reason: str


class OwedPromotion(Record, frozen=True, tag="promotion-owed"):
    """``.promote/<key>.json``: a compile for the fleet whose promotion is not done yet."""

    at: float
    remote: str  # the remote it was compiled for (for people; any writable remote settles it)
    pid: int
    host: str


class Pin(Record, frozen=True, tag="pin"):
    """Why an entry is kept whatever the bound: who pinned it, when, and a note."""

    key: str
    at: float
    by: str = ""  # host:pid
    note: str = ""


class UnpackedRecord(Record, frozen=True, kw_only=True, tag="unpacked-package"):
    """What a copy holds: the package of entry `key` it was unpacked from (`package`, and
    `source`, its digests as the entry records them), every member's digests, and when."""

    key: str
    package: str
    source: FileDigest
    files: dict[str, FileDigest]
    at: float


FAILURE_NOTES = RecordCodec(
    FailureNote,
    untagged=Untagged("compile-failure", 1, "a failure note from before records had tags"),
)
LOAD_NOTES = RecordCodec(LoadFailureNote)
QUARANTINE_NOTES = RecordCodec(
    QuarantineNote,
    untagged=Untagged("quarantine-note", 1, "a quarantine note from before records had tags"),
)
OWED_NOTES = RecordCodec(OwedPromotion)
PIN_RECORDS = RecordCodec(Pin)
UNPACKED_RECORDS = RecordCodec(UnpackedRecord)
STOPPED_NOTES = RecordCodec(StoppedNote)


# ------------------------------------------------------------------- layouts
class Layout(enum.Enum):
    """Where a kind's notes sit in its directory (the value shows it)."""

    PER_KEY = "<dir>/<key>.json"
    """One note per key."""
    PER_HOST = "<dir>/<key>/<host>.json"
    """One note per key and host (each host says its own word; none overwrites another's)."""
    COPY = "<dir>/<key>-<tag>/..."
    """A published directory per key and content (`tag`: the first `TAG_DIGITS` hex digits
    of the content's digest), its record inside: the collector removes it whole."""


TAG_DIGITS = 32
_COPY = re.compile(rf"([0-9a-f]{{32}})-[0-9a-f]{{{TAG_DIGITS}}}")
_PER_KEY = re.compile(r"([0-9a-f]{32})\.json")


def copy_key(name: str) -> str | None:
    """The entry key of the copy named `name` (a directory under `UNPACKED_DIR`), or None
    when it is no copy's name."""
    found = _COPY.fullmatch(name)
    return found.group(1) if found else None


class Expiry(enum.Enum):
    """When `cache gc` (and the background pass) collects a note: each kind says which,
    so a kind cannot be added without one. `NoteKind.max_age` turns it into seconds."""

    RETRY_COOL_DOWN = "older than the compile retry cool-down (VLLM_NEURON_COMPILE_RETRY_AFTER)"
    """Past the cool-down no process raises it any more."""
    TWO_COOL_DOWNS = "older than twice the compile retry cool-down"
    """Past one cool-down it has done its work (the node compiles whatever notes say); kept
    a second one so that collecting it never restarts the bound while notes still stop the
    key: a node is stopped at most one cool-down in every two."""
    FOR_OPERATORS = "older than the bound and at least OPERATOR_NOTE_MIN_AGE (7 days)"
    """A note for the fleet's operators: kept a week at least, for someone to read."""
    WITHOUT_ENTRY = "older than the bound, and only while its key has no published entry"
    """Of use only with its entry (a promotion owed, a copy to load); left by a process
    killed before the entry was published, or after it was withdrawn."""
    NEVER = "never"
    """An operator's decision (a pin): only the operator removes it."""


@dataclass(frozen=True)
class NoteKind(Generic[R]):
    """One kind of per-key note: where it lives, what it holds, and when it goes.

    `name`: what the collector calls it (`GcItem.kind`; kept as earlier versions named it,
    since ``cache gc --json`` shows it). `what`: how the collector names one it plans to
    remove; `plural`: how its summary names those it kept. `key_lock`: whoever rewrites a
    note of this kind holds the key's lock (on a tier with kernel locks), so the collector
    removes one only under that lock; a kind written without it is compared and removed.
    `while_published`: for `Expiry.WITHOUT_ENTRY`, why a note whose entry is published is
    kept (listed in the plan's `kept`); empty: such a note is not listed at all.
    """

    name: str
    directory: str
    layout: Layout
    record: type[R]
    codec: RecordCodec[R]
    expiry: Expiry
    what: str
    plural: str
    key_lock: bool
    while_published: str = ""

    def path(self, key: str, host: str = "") -> str:
        """Where the note on `key` (by `host`, for `Layout.PER_HOST`) lives in a tier."""
        if self.layout is Layout.PER_KEY:
            return join(self.directory, f"{key}.json")
        if self.layout is Layout.PER_HOST:
            return join(self.directory, key, f"{host}.json")
        raise ValueError(f"a {self.name} is named by its content (Layout.COPY)")

    def parse(self, path: str) -> tuple[str, str] | None:
        """``(where, key)`` of the note that the file at `path` (a tier's key) belongs to,
        None when it is none of this kind's: `where` is the note's file, or for a copy its
        directory."""
        directory, _, rest = path.partition("/")
        if directory != self.directory:
            return None
        if self.layout is Layout.PER_KEY:
            found = _PER_KEY.fullmatch(rest)
            return (path, found.group(1)) if found else None
        if self.layout is Layout.PER_HOST:
            key, _, name = rest.partition("/")
            ok = KEY_RE.fullmatch(key) and name.endswith(".json") and "/" not in name
            return (path, key) if ok else None
        name, slash, _ = rest.partition("/")
        copied = copy_key(name) if slash else None  # a file inside a copy's directory
        return (join(self.directory, name), copied) if copied else None

    def max_age(self, *, bound: float, retry_after: float) -> float | None:
        """Seconds past which a note of this kind is collected (`Expiry`): `bound` is the
        collector's (``--older-than``), `retry_after` the compile retry cool-down; None:
        never collected."""
        if self.expiry is Expiry.RETRY_COOL_DOWN:
            return retry_after
        if self.expiry is Expiry.TWO_COOL_DOWNS:
            return 2 * retry_after
        if self.expiry is Expiry.FOR_OPERATORS:
            return max(bound, OPERATOR_NOTE_MIN_AGE)
        if self.expiry is Expiry.WITHOUT_ENTRY:
            return bound
        return None

    def read_all(self, store: Store) -> dict[str, list[R]]:
        """Every note of this kind in `store`, by key, oldest first (one listing per key
        for `Layout.PER_HOST`). A note that vanishes or does not read is skipped: one bad
        note never hides the others."""
        if self.layout is Layout.COPY:
            raise ValueError(f"a {self.name} is a directory, read by its own module")
        out: dict[str, list[R]] = {}
        unread: list[str] = []  # folders too full to list, notes that do not read
        paths: list[str] = []
        try:  # bounded: a shared tier's folder may hold millions of planted names
            names = store.list_dir(self.directory, max_names=NOTES_READ_MAX)
        except RecordError as exc:
            names, unread = [], [exc.problem]
        for name in names:
            if self.layout is Layout.PER_KEY:
                paths.append(join(self.directory, name))
                continue
            try:
                paths += [join(self.directory, name, n) for n in store.list_dir(
                    join(self.directory, name), max_names=NOTES_READ_MAX)]  # fmt: skip
            except RecordError as exc:
                unread.append(f"{name}/ {exc.problem}")
            if len(paths) > NOTES_READ_MAX:
                unread.append(f"more than {NOTES_READ_MAX} notes; the rest not read")
                break
        for path in paths[:NOTES_READ_MAX]:
            found = self.parse(path)
            if found is None:
                continue
            try:  # bounded (`RecordCodec.read`: RECORD_MAX_BYTES, regular files only)
                note = self.codec.read(store, path)
            except Exception as exc:  # noqa: BLE001 - one bad note never hides the others
                unread.append(f"{path}: {exc}")
                continue
            if note is not None:
                out.setdefault(found[1], []).append(note)
        if unread:
            logger.warning("compile cache: %d of the %s in %s did not read (%s)", len(unread),
                           self.plural, store.url, printable("; ".join(unread[:3]), 400))
        at = operator.attrgetter("at")  # every kind's record says when it was written
        return {key: sorted(notes, key=at) for key, notes in out.items()}


# ------------------------------------------------------------------ registry
FAILURES_DIR = ".failures"
LOAD_NOTES_DIR = ".load-failures"
QUARANTINE_DIR = ".quarantine"
OWED_DIR = ".promote"
PINS_DIR = ".pins"
STOPPED_DIR = ".stopped"
"""``<tier>/.stopped/<key>.json``: when failure notes first stopped this node's compile."""
"""``<tier>/.pins/<key>.json``: an entry that no size bound or prune removes."""
UNPACKED_DIR = ".unpacked"
"""``<tier>/.unpacked/<key>-<tag>/``: the unpacked copies of entries' packages."""

FAILURES: NoteKind[FailureNote] = NoteKind(
    "failure-note", FAILURES_DIR, Layout.PER_KEY, FailureNote, FAILURE_NOTES,
    Expiry.RETRY_COOL_DOWN, "expired failure note", "failure notes", key_lock=True)
"""A failed compile, for the ranks waiting on its key (`failure_notes.py`)."""
QUARANTINE: NoteKind[QuarantineNote] = NoteKind(
    "quarantine-note", QUARANTINE_DIR, Layout.PER_KEY, QuarantineNote, QUARANTINE_NOTES,
    Expiry.FOR_OPERATORS, "old quarantine note", "quarantine notes", key_lock=True)
"""Why an entry was withdrawn (`tiers/quarantine.py`)."""
OWED: NoteKind[OwedPromotion] = NoteKind(
    "owed-note", OWED_DIR, Layout.PER_KEY, OwedPromotion, OWED_NOTES, Expiry.WITHOUT_ENTRY,
    "promotion note without an entry", "promotion notes", key_lock=True,
    while_published="its entry is still to be promoted (the next start does it)")
"""A compile for the fleet whose promotion is owed (`upkeep/owed.py`)."""
LOAD_FAILURES: NoteKind[LoadFailureNote] = NoteKind(
    "load-failure-note", LOAD_NOTES_DIR, Layout.PER_HOST, LoadFailureNote, LOAD_NOTES,
    Expiry.FOR_OPERATORS, "old load-failure note", "load-failure notes", key_lock=False)
"""A host that fetched an entry from the remote and could not load it
(`load_failure_notes.py`); for the operators, like a quarantine note. Written without the
key's lock (a node says its word whatever the key's state), so compared and removed."""
PINS: NoteKind[Pin] = NoteKind(
    "pin", PINS_DIR, Layout.PER_KEY, Pin, PIN_RECORDS, Expiry.NEVER, "pin", "pins",
    key_lock=False)
"""An entry no size bound, prune or gc removes (`upkeep/eviction.py`)."""
UNPACKED: NoteKind[UnpackedRecord] = NoteKind(
    "unpacked", UNPACKED_DIR, Layout.COPY, UnpackedRecord, UNPACKED_RECORDS,
    Expiry.WITHOUT_ENTRY, "unpacked package without its entry", "unpacked copies",
    key_lock=False)
"""A host entry's package unpacked for loading (`tiers/unpacked.py`); its record is
``unpacked.json`` inside. Published and withdrawn as a whole, never rewritten."""

STOPPED: NoteKind[StoppedNote] = NoteKind(
    "stopped-note", STOPPED_DIR, Layout.PER_KEY, StoppedNote, STOPPED_NOTES,
    Expiry.TWO_COOL_DOWNS, "old note of a stopped compile", "stopped-compile notes",
    key_lock=False)
"""When failure notes first stopped this node's compile of a key (`failure_notes.py`); in
the node's own local tier only. Created once (never rewritten while it holds), without the
key's lock on the remote's path, so compared and removed."""

NOTE_KINDS: tuple[NoteKind[Any], ...] = (FAILURES, QUARANTINE, OWED, LOAD_FAILURES, PINS,
                                         UNPACKED, STOPPED)  # fmt: skip
"""Every kind of per-key note; what must know them all walks this."""

_BY_DIRECTORY = {kind.directory: kind for kind in NOTE_KINDS}
_BY_NAME = {kind.name: kind for kind in NOTE_KINDS}
if len(_BY_DIRECTORY) != len(NOTE_KINDS) or len(_BY_NAME) != len(NOTE_KINDS):
    raise AssertionError("two kinds of note share a directory or a name")


def kind_of(path: str) -> NoteKind[Any] | None:
    """The kind of note whose directory holds `path` (a tier's key, or the directory
    itself); None for anything else."""
    return _BY_DIRECTORY.get(path.split("/", 1)[0])


def kind_named(name: str) -> NoteKind[Any] | None:
    """The kind whose `NoteKind.name` is `name` (a `GcItem.kind`); None for another."""
    return _BY_NAME.get(name)
