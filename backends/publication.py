"""The publication protocol: a staged directory appears complete or not at all, once.

`StoreBase.stage`, `published`, `publication`, `unpublish` and `Staging.commit` are built
from the functions here, one of two ways per the store's `Capabilities`:

* **rename** (``atomic_rename``, POSIX): a directory is staged under ``.staging/<uuid>/``
  and renamed onto ``final`` (rename refuses a non-empty target: first writer wins). Its
  version is the directory's identity (device, inode, modification time): what a
  withdrawal compares after it has moved the directory aside.
* **commit record** (S3, memory): a version is uploaded under ``final/.v/<uuid>/``, then
  ``final/.commit`` (`CommitRecord`) naming it is created if absent. Its version is the
  uuid; a commit record that does not read has a version too, ``unreadable-<hash>`` of its
  bytes, so that it can be withdrawn exactly like a good one.

A commit record that does not read, or that names a version without files (other than
one staged empty), is **broken**: `publication` says so (`Publication.state`), while
`published` - the hot path - keeps reading it as unpublished (a record that does not
read) or as its content prefix (where the files are then missing: a defective entry).
Nothing treats a broken record as a silent miss: listings show it, a fetch reports it,
and the next commit of ``final`` replaces it (`commit_staged`), never a valid one.

**Withdrawal is conditional on a version.** `unpublish(final, version=v)` withdraws
``final`` only while it is still publication `v` (the one its caller judged), and two
withdrawals of one version never both succeed:

* commit record: the withdrawer first creates the version's tombstone
  ``final/.v/withdraw-<v>/owner`` (create-if-absent: exactly one withdrawer of `v` gets
  on), re-reads the commit record, deletes it only if it still names `v`, deletes the
  version's files and then the tombstone. Every deleter of a commit record holds the
  tombstone of the version it deletes, and a new record can only be created where none
  is, so the record cannot change between the re-read and the delete. (S3's own
  conditional delete, ``If-Match`` on DeleteObject, is not used: moto checks it apart
  from the delete, and S3-compatible servers that ignore the header would turn it into
  an unconditional delete without a word; the tombstone needs only ``If-None-Match``.)
  A withdrawer killed while holding a tombstone leaves it under ``.v/``, where
  `Store.survey` lists it (`cache gc` removes it after 6 hours); a commit that must
  replace that version's broken record removes it once it has seen it unchanged for
  `TOMBSTONE_PATIENCE` (a killed withdrawer's, or one planted by a writer of the store),
  and at the latest at the commit's one deadline (`REPAIR_ATTEMPTS` patiences after its
  first sighting of a tombstone, never reset: a writer rewriting the tombstone cannot
  hold a commit for ever); a commit still refused then is `PublicationStuck`.
* rename: the withdrawer renames ``final`` into ``.trash/<uuid>/`` (one rename wins), then
  compares the version of what it moved; if it is not `v` (another publication took the
  judged one's place), it renames it back, or, if yet another was published meanwhile,
  deletes it (a complete publication, superseded), and reports False.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from .errors import ListingTooLarge, PublicationStuck
from .keys import join, validate_key
from .layout import COMMIT_RECORD, STAGING_DIR, TRASH_DIR, VERSIONS_DIR
from .operations import where
from .protocol import ByteStore
from .records import COMMIT_RECORDS, RECORD_MAX_BYTES, CommitRecord, RecordError, encode

WITHDRAWAL = "withdraw-"
"""``final/.v/withdraw-<version>/``: the tombstone of a withdrawal in progress."""
UNREADABLE = "unreadable-"
"""The version of a commit record that does not read: ``unreadable-<hash of its bytes>``."""
REPAIR_ATTEMPTS = 8
"""How often a commit tries to replace a broken commit record before it gives up."""
TOMBSTONE_PATIENCE = 10.0
"""Seconds a commit waits on another withdrawal's tombstone of the broken record it must
replace, seen unchanged on this process's own monotonic clock, before it takes it for a dead
withdrawer's or a planted one and removes it. A live withdrawal holds its tombstone for two
requests (a read and a delete of the commit record); anyone who can write the store can
plant one, and it must not stop a good entry's publication for ever."""


@dataclass(frozen=True)
class Publication:
    """What ``final`` is on a store now (`StoreBase.publication`).

    ``state``: ``absent`` (nothing published), ``published``, or ``broken`` (a commit
    record that does not read, or that names a version without files; `problem` says
    which). ``prefix``: where the content is, when there is a version to read (also for
    a record naming a version without files). ``version``: what `unpublish(final,
    version=...)` is conditional on; None when absent.
    """

    state: Literal["absent", "published", "broken"]
    prefix: str | None = None
    version: str | None = None
    problem: str | None = None


ABSENT = Publication("absent")


def staging_prefix(store: ByteStore, final: str) -> str:
    """Where a new staging area of ``final`` is built."""
    if store.capabilities.atomic_rename:
        return join(STAGING_DIR, uuid.uuid4().hex)
    return join(final, VERSIONS_DIR, uuid.uuid4().hex)


# ------------------------------------------------------------- commit records
def read_commit(store: ByteStore, final: str) -> tuple[str, CommitRecord | None, str] | None:
    """``(version, record, problem)`` of ``final``'s commit record; None when it has none.

    The record is None when it does not read (the version is then ``unreadable-<hash>``
    and `problem` says why); otherwise `problem` is "".
    """
    key = join(final, COMMIT_RECORD)
    try:
        data = store.read(key, max_size=RECORD_MAX_BYTES)
    except RecordError as exc:  # too large, or not a regular file: unreadable, by its reason
        return (UNREADABLE + hashlib.sha256(exc.problem.encode()).hexdigest()[:32], None,
                f"{where(store, key)} does not read: {exc.problem}")
    if data is None:
        return None
    try:
        record = COMMIT_RECORDS.decode(data, source=where(store, key))
        validate_key(record.version)
    except RecordError as exc:
        return _unreadable(data), None, f"{exc.source} does not read: {exc.problem}"
    except ValueError as exc:  # a version that is no key
        return _unreadable(data), None, f"{where(store, key)} names no version: {exc}"
    return record.version, record, ""


def _unreadable(data: bytes) -> str:
    return UNREADABLE + hashlib.sha256(data).hexdigest()[:32]


def published(store: ByteStore, final: str) -> str | None:
    validate_key(final)
    if store.capabilities.atomic_rename:
        return final if store._is_dir(final) else None
    commit = read_commit(store, final)
    if commit is None or commit[1] is None:
        return None
    return join(final, VERSIONS_DIR, commit[1].version)


def publication(store: ByteStore, final: str) -> Publication:
    validate_key(final)
    if store.capabilities.atomic_rename:
        version = store._dir_version(final)
        return ABSENT if version is None else Publication("published", final, version)
    commit = read_commit(store, final)
    if commit is None:
        return ABSENT
    version, record, problem = commit
    if record is None:
        return Publication("broken", None, version, problem)
    prefix = join(final, VERSIONS_DIR, version)
    if not record.empty and _empty(store, prefix):
        record_at = where(store, join(final, COMMIT_RECORD))
        problem = f"{record_at} names version {version}, which has no files"
        return Publication("broken", prefix, version, problem)
    return Publication("published", prefix, version)


def _empty(store: ByteStore, prefix: str) -> bool:
    """Whether the version folder `prefix` holds nothing: one name is enough to tell, so
    no more is listed (a hostile writer may have put millions of names there)."""
    try:
        return not store.list_dir(prefix, max_names=1)
    except ListingTooLarge:
        return False


# ------------------------------------------------------------------ withdrawal
def unpublish(store: ByteStore, final: str, version: str | None) -> bool:
    validate_key(final)
    if version is not None:
        validate_key(version)
    if store.capabilities.atomic_rename:
        return _unpublish_renamed(store, final, version)
    if version is None:
        commit = read_commit(store, final)
        if commit is None:
            return False
        version = commit[0]
    return _withdraw_commit(store, final, version)


def _unpublish_renamed(store: ByteStore, final: str, version: str | None) -> bool:
    trash = join(TRASH_DIR, uuid.uuid4().hex)
    if not store._rename_dir(final, trash):
        return False
    if version is not None and store._dir_version(trash) != version:
        # Not the judged directory: another publication took its place. Put it back; when
        # yet another was published meanwhile (rename refuses a non-empty target), this
        # one is superseded: it goes.
        if not store._rename_dir(trash, final):
            store.delete_tree(trash)
        return False
    store.delete_tree(trash)
    return True


def _withdraw_commit(store: ByteStore, final: str, version: str) -> bool:
    tombstone = join(final, VERSIONS_DIR, WITHDRAWAL + version)
    owner = f"{socket.gethostname()}:{os.getpid()} at {time.time():.3f}".encode()
    if not store.create(join(tombstone, "owner"), owner):
        return False  # another withdrawal of this version is under way
    try:
        commit = read_commit(store, final)
        if commit is None or commit[0] != version:
            return False  # withdrawn already, or replaced by another publication
        if not store.delete(join(final, COMMIT_RECORD)):
            return False
        if commit[1] is not None:
            store.delete_tree(join(final, VERSIONS_DIR, version))
        return True
    finally:
        _drop_tombstone(store, tombstone)


TOMBSTONE_MAX_NAMES = 16
"""Names a tombstone folder is cleared of at most: a withdrawer writes one (``owner``);
anything else there was planted, and is left to `cache gc` rather than listed whole."""


def _drop_tombstone(store: ByteStore, tombstone: str) -> None:
    """Remove `tombstone`'s ``owner`` (what holds the withdrawal) and at most
    `TOMBSTONE_MAX_NAMES` other files planted beside it, never listing it whole."""
    store.delete(join(tombstone, "owner"))
    try:
        names = store.list_dir(tombstone, max_names=TOMBSTONE_MAX_NAMES)
    except ListingTooLarge:
        return  # planted by the million: debris for `cache gc`
    for name in names:
        store.delete(join(tombstone, name))


def _outwait_tombstone(store: ByteStore, tombstone: str, deadline: float) -> None:
    """Wait until the withdrawal holding `tombstone` is done: its owner file gone, or the
    same bytes seen for `TOMBSTONE_PATIENCE` seconds on this process's monotonic clock, or
    the commit's `deadline` (monotonic) passed, however often the bytes changed (a writer
    of the store can rewrite them for ever) - then the tombstone is a dead or planted one,
    and is removed (a live withdrawer that slow would at worst withdraw the version that
    replaces it: a compile, never a wrong entry)."""
    owner, delay = join(tombstone, "owner"), 0.02
    seen: tuple[bytes, float] | None = None
    while True:
        try:
            data = store.read(owner, max_size=RECORD_MAX_BYTES)
        except RecordError as exc:  # not a regular file, or too large: planted
            data = exc.problem.encode()
        if data is None:
            return
        now = time.monotonic()
        if seen is None or seen[0] != data:
            seen = (data, now)
        if now - seen[1] >= TOMBSTONE_PATIENCE or now >= deadline:
            _drop_tombstone(store, tombstone)
            return
        time.sleep(min(delay, max(deadline - now, 0.0)))
        delay = min(delay * 2, 0.5)


# ------------------------------------------------------------------ commit
def commit_staged(store: ByteStore, final: str, prefix: str) -> bool:
    """Publish the staging area `prefix` as ``final``; False when another writer had.

    On a commit-record store a broken commit record of ``final`` is replaced: withdrawn
    (conditionally on its version, so one repairer withdraws it and a valid record that
    took its place is never touched), then this commit is created again. `PublicationStuck`
    when it stays broken (a withdrawal killed while holding the record's tombstone).
    """
    if store.capabilities.atomic_rename:
        won = store._rename_dir(prefix, final, publish=True)
        if not won:
            store.delete_tree(prefix)
        return won
    empty = not store.list_dir(prefix)
    version = prefix.rsplit("/", 1)[-1]
    record = encode(CommitRecord(version=version, committed_at=time.time(), empty=empty))
    key = join(final, COMMIT_RECORD)
    current = ABSENT
    deadline: float | None = None  # one per commit, set at the first tombstone, never reset
    for _ in range(REPAIR_ATTEMPTS):
        if store.create(key, record):
            return True
        current = publication(store, final)
        if current.state == "published":
            store.delete_tree(prefix)
            return False
        broken = current.version if current.state == "broken" else None
        if broken is not None and not _withdraw_commit(store, final, broken):
            # Another repairer (or a withdrawer) holds it: let it finish, within bounds.
            if deadline is None:
                deadline = time.monotonic() + REPAIR_ATTEMPTS * TOMBSTONE_PATIENCE
            _outwait_tombstone(store, join(final, VERSIONS_DIR, WITHDRAWAL + broken),
                               deadline)  # fmt: skip
    store.delete_tree(prefix)
    raise PublicationStuck(
        f"{where(store, final)} has a broken commit record that cannot be replaced "
        f"({current.problem}); its withdrawal is held by "
        f"{where(store, join(final, VERSIONS_DIR, WITHDRAWAL + str(current.version)))}, "
        "left by a killed process or rewritten by a writer of the store (`vllm-neuron "
        "cache prune` removes it after 6 hours)"
    )
