"""Removing what `debris.survey` found: `Store.remove_debris`.

**Removal re-checks** what the survey saw and leaves what changed since: a staging area,
version or tombstone written to since (its newest time moved), a version a commit record
names now, a lease taken again or renewed (its latest generation or record differs), a
temp file touched since. A lease is removed generation by generation, oldest first, only
the records the survey saw: a taker that wins the lease meanwhile creates a newer one,
which stays. Deleting a lease's records restarts its generations at 1; a holder frozen for
longer than its lease plus the grace that wakes into a restarted sequence at its own
generation could renew over the new holder, whose `check()` then fails: at most one
holder passes `check()` at a time, and publication is first-writer-wins anyway.
"""

from __future__ import annotations

import contextlib
import os

from .debris import TIME_SLACK, Debris, Removal, SurveyedStore, digest_of
from .errors import ListingTooLarge
from .layout import VERSIONS_DIR
from .locks import LEASE_MAX_NAMES, generation_of
from .publication import read_commit
from .records import RECORD_MAX_BYTES, RecordError


def remove(store: SurveyedStore, debris: Debris) -> Removal:
    """Remove `debris` unless it changed since the survey (see the module's notes)."""
    if debris.kind == "upload":
        return "removed" if store._abort_upload(debris.prefix, debris.handle[0]) else "gone"
    if debris.kind == "lease":
        return _remove_lease(store, debris)
    if debris.kind == "partial":
        info = store.info(debris.prefix)
        if info is None:
            return "gone"
        if info.mtime > debris.newest + TIME_SLACK:
            return "changed"
        store.delete(debris.prefix)
        if store.info(debris.prefix) is not None:
            raise OSError(f"{store.url}: {debris.prefix} is still there after its removal")
        return "removed"
    if debris.kind == "orphan-version":
        name, _, version = debris.prefix.rpartition(f"/{VERSIONS_DIR}/")
        record = read_commit(store, name)
        if record is not None and record[0] == version:
            return "changed"  # committed since the survey
    seen = store._walk(debris.prefix)
    if not seen:
        return "gone"
    if max(s.mtime for s in seen) > debris.newest + TIME_SLACK:
        return "changed"  # written to since the survey: in use
    if _directory_time(store, debris.prefix) > debris.newest + TIME_SLACK:
        return "changed"  # refreshed since the survey (a compile's keep-alive): in use
    store.delete_tree(debris.prefix)
    if any(not s.directory for s in store._walk(debris.prefix)):
        raise OSError(f"{store.url}: {debris.prefix} is still there after its removal")
    return "removed"


def _directory_time(store: SurveyedStore, prefix: str) -> float:
    """The time of the directory at `prefix` itself on local disk (which a staging area's
    writer refreshes, `Staging.keep_alive`), else 0."""
    path = store.local_path(prefix)
    if path is None:
        return 0.0
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _remove_lease(store: SurveyedStore, debris: Debris) -> Removal:
    *keys, digest = debris.handle
    try:  # a lease folder of a shared store, bounded as its leases list it (locks.py)
        names = store.list_dir(debris.prefix, max_names=LEASE_MAX_NAMES)
    except ListingTooLarge:
        return "changed"  # over-full (planted names): left as it is, reported as kept
    now_there = [g for g in map(generation_of, names) if g is not None]
    if not now_there:
        return "gone"
    if max(now_there) != max(generation_of(k.rsplit("/", 1)[-1]) or 0 for k in keys):
        return "changed"  # taken again since the survey
    try:
        data = store.read(keys[-1], max_size=RECORD_MAX_BYTES)
    except RecordError:  # too large or not a regular file: as the survey saw it (debris.py)
        data = b""
    if data is None or digest_of(data) != digest:
        return "changed" if data is not None else "gone"
    for key in keys:  # oldest first: a taker meanwhile sees a free latest, never a gap
        store.delete(key)
    with contextlib.suppress(OSError):
        store._remove_empty_dir(debris.prefix)
    return "removed"


def remove_empty_dir(path: str | None) -> None:
    """`rmdir` of a local directory that may be empty (a lease's, once its records went);
    one that is not (a new generation was created meanwhile) stays."""
    if path is not None:
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(path)
