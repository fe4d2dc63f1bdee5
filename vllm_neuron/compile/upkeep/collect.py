"""Garbage collection of a compile-cache tier: nothing lost, nothing left behind.

`plan_gc` looks (one walk of the tier through `Store.survey`, plus a read of each note)
and returns a `GcPlan`; `GcPlan.execute` removes what was planned, re-checking each item
first, so `vllm-neuron cache gc --dry-run` shows exactly what `cache gc` would remove.

What is collected (`GcItem.what`):

- what killed writers left, untouched for `older_than` (default `STAGING_MAX_AGE`, 6 h):
  staging areas, withdrawn directories never finished deleting, versions never committed,
  withdrawal tombstones, unfinished multipart uploads, writers' temp files
  (`backends/debris.py` has the details);
- leases whose latest generation was released, or expired, more than `lease_grace`
  (10 minutes) ago: never one that is held;
- per-key notes, every kind the registry declares (`entry/notes.py`, `NOTE_KINDS`), each by
  its own age rule (`Expiry`); this module walks the registry and names no kind (but pins,
  which spare entries from `keep`), so a kind added there is collected here:
  - failure notes (``.failures/<key>.json``) older than the compile retry cool-down
    (``VLLM_NEURON_COMPILE_RETRY_AFTER``, 300 s): past it no process raises them any more;
  - quarantine notes (``.quarantine/<key>.json``) and load-failure notes
    (``.load-failures/<key>/<host>.json``, a remote's) older than `older_than` and at least
    `OPERATOR_NOTE_MIN_AGE` (7 days): notes for the operators, who may still want to read
    why an entry was withdrawn or which hosts could not load it;
  - promotion notes (``.promote/<key>.json``, `owed.py`) of a key the tier has no entry
    for, untouched for `older_than` (a compile killed before it published): a note whose
    entry is there is kept (the next cache start promotes it);
  - unpacked copies of packages (``.unpacked/<key>-<tag>/``, `unpacked.py`) whose entry is
    not published, untouched for `older_than` (its entry's withdrawal drops a copy at
    once; this catches a process killed in between, and a load that raced a withdrawal);
  - pins (``.pins/<key>.json``): never;
- node files (``.node/<group>/``, toolchains/node_files.py: precompiled headers, kept
  runtime objects, Inductor's cache) of an interpreter or torch installation that no
  longer exists, or no process started using for `node_files.UNUSED_SECONDS` (14 days):
  never a group a live process uses (nor a header one builds);
- with `keep` (the graph hashes a live deployment's manifests name): every published
  entry no one of them names, published longer than `older_than` ago (which the caller
  must give: `--older-than` is required with `--keep-manifest`).

Never touched: a published entry (unless `keep` is given, and then only the unreferenced
and old ones, each withdrawn as the version planned, and on a tier with kernel locks only
while its key's lock is free); a note being rewritten (compared and removed, on a tier
with kernel locks, under its key's lock, for a kind whose writers hold it); a lease that is
held; a kernel lock file; anything younger than its bound; event segments (``.events/``:
`cache stats` reads them); pins and pinned entries (``cache pin``). An item that changed
since the plan (written to, committed, taken again) is left, and said so.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_neuron.backends import LockTimeout, Store, fault_point
from vllm_neuron.backends.debris import Debris, Seen, Survey
from vllm_neuron.backends.records import RECORD_MAX_BYTES, RecordError
from vllm_neuron.envs.compile_cache import DEFAULT_COMPILE_RETRY_AFTER

from ..entry.notes import (
    NOTE_KINDS,
    OPERATOR_NOTE_MIN_AGE,
    PINS,
    Expiry,
    Layout,
    NoteKind,
    kind_named,
    kind_of,
)
from ..entry.text import human_age
from ..tiers.unpacked import drop_unpacked
from ..toolchains.node_files import NODE_DIR, collectable, node_groups, remove_group

STAGING_MAX_AGE = 6 * 3600.0
"""The default age bound: what killed writers left, untouched this long, is collected (by
``cache gc``, ``cache prune`` and every cache that opens a tier). It must exceed the longest
time a live writer goes without writing a file: the longest compile."""
LEASE_GRACE = 600.0
"""Seconds past its release or expiry that a lease's records are kept."""
QUARANTINE_NOTE_MIN_AGE = OPERATOR_NOTE_MIN_AGE
"""Seconds a quarantine note (or a load-failure note) is kept at least, whatever the bound
(`entry/notes.py`)."""

_KEY = re.compile(r"[0-9a-f]{32}")
NODE_FILES = "node-files"

WHAT = {
    "staging": "abandoned staging",
    "trash": "unfinished withdrawal",
    "orphan-version": "uncommitted version",
    "tombstone": "withdrawal tombstone",
    "upload": "unfinished upload",
    "partial": "partial write",
    "lease": "expired lease",
    **{kind.name: kind.what for kind in NOTE_KINDS},
    "entry": "unreferenced entry",
    NODE_FILES: "node files of an interpreter or torch not in use",
}
"""How each kind is named in the plan (`GcItem.what`); a note's as the registry says."""


@dataclass(frozen=True)
class GcItem:
    """One thing the plan removes (or, in `GcPlan.kept`, looked at and left).

    `kind`: a key of `WHAT`; `where`: its key or prefix in the tier; `reason`: why it goes
    (or stays). `version` is what a removal re-checks: an entry's publication, a note's
    time.
    """

    kind: str
    where: str
    age_seconds: float
    size: int
    reason: str
    version: str | None = None
    debris: Debris | None = field(default=None, repr=False, compare=False)

    @property
    def what(self) -> str:
        return WHAT.get(self.kind, self.kind)

    def as_dict(self) -> dict[str, object]:
        """For `--json`: kind, where, age, size and reason (and `what`, for a planned one)."""
        return {"kind": self.kind, "what": self.what, "where": self.where,
                "age_seconds": round(self.age_seconds, 3), "size": self.size,
                "reason": self.reason}  # fmt: skip


@dataclass
class GcOutcome:
    """What `GcPlan.execute` did: removed, left because it changed since the plan (with
    why), and could not remove (with the error)."""

    removed: list[GcItem] = field(default_factory=list)
    stayed: list[tuple[GcItem, str]] = field(default_factory=list)
    failed: list[tuple[GcItem, str]] = field(default_factory=list)

    @property
    def freed_bytes(self) -> int:
        return sum(item.size for item in self.removed)


@dataclass(frozen=True)
class GcPlan:
    """What a collection would remove from `store`; nothing happens until `execute()`.

    `kept`: what was looked at and left, with why (held, younger than its bound,
    referenced). `missing`: the keys `keep` names that the tier has no entry for.
    `bounds`: the bounds used, in seconds, by name.
    """

    store: Store
    items: tuple[GcItem, ...]
    kept: tuple[GcItem, ...] = ()
    missing: tuple[str, ...] = ()
    bounds: dict[str, float] = field(default_factory=dict)

    @property
    def planned_bytes(self) -> int:
        return sum(item.size for item in self.items)

    def execute(self, stop: Callable[[], bool] | None = None) -> GcOutcome:
        """Remove every planned item that has not changed since the plan (until `stop`
        says so: a background pass stops at the interpreter's exit)."""
        outcome = GcOutcome()
        for item in self.items:
            if stop is not None and stop():
                break
            try:
                why = _remove(self.store, item)
            except Exception as exc:  # noqa: BLE001 - reported, and the exit status says so
                outcome.failed.append((item, f"{type(exc).__name__}: {exc}"))
                continue
            if why is None:
                outcome.removed.append(item)
                fault_point("gc.mid-delete")  # crash tests: killed with the rest to do
            else:
                outcome.stayed.append((item, why))
        return outcome


def plan_gc(
    store: Store,
    *,
    older_than: float | None = None,
    lease_grace: float = LEASE_GRACE,
    failure_max_age: float = DEFAULT_COMPILE_RETRY_AFTER,
    keep: Collection[str] | None = None,
    now: float | None = None,
) -> GcPlan:
    """Plan a collection of `store` (see the module's notes); `now` for tests."""
    if keep is not None and older_than is None:
        raise ValueError("removing unreferenced entries needs an age bound (--older-than)")
    bound = STAGING_MAX_AGE if older_than is None else float(older_than)
    now = time.time() if now is None else now
    found: Survey = store.survey(older_than=bound, lease_grace=lease_grace, now=now)
    items = [
        GcItem(d.kind, d.prefix, d.age_seconds, d.size, _debris_reason(d, bound, lease_grace),
               debris=d)  # fmt: skip
        for d in found.debris
    ]
    kept = [GcItem(k.kind, k.prefix, k.age_seconds, 0, k.reason) for k in found.kept]
    note_bound = max(bound, OPERATOR_NOTE_MIN_AGE)
    _plan_notes(store, found, now, bound, failure_max_age, items, kept)
    _plan_node_files(store, now, items, kept)
    missing: tuple[str, ...] = ()
    if keep is not None:
        wanted = set(keep)
        pinned = {p[1] for p in map(PINS.parse, (s.key for s in found.files)) if p}
        entries = {n: p for n, p in found.published.items() if _KEY.fullmatch(n)}
        missing = tuple(sorted(k for k in wanted if k not in entries))
        for name, pub in sorted(entries.items()):
            age = now - pub.committed
            if name in wanted:
                kept.append(GcItem("entry", name, age, pub.size, "referenced by a manifest"))
            elif name in pinned:
                kept.append(GcItem("entry", name, age, pub.size, "pinned"))
            elif age <= bound:
                kept.append(GcItem("entry", name, age, pub.size,
                                   f"younger than {human_age(bound)}"))
            else:
                items.append(GcItem("entry", name, age, pub.size,
                                    f"no manifest names it; published {human_age(age)} ago",
                                    version=pub.version))  # fmt: skip
    bounds = {"older_than": bound, "lease_grace": lease_grace,
              "failure_notes": failure_max_age, "quarantine_notes": note_bound}  # fmt: skip
    return GcPlan(store, tuple(items), tuple(kept), missing, bounds)


def _plan_node_files(store: Store, now: float, items: list[GcItem],
                     kept: list[GcItem]) -> None:  # fmt: skip
    """The tier's node-file groups (toolchains/node_files.py): one whose interpreter or
    torch is gone, or unused for `UNUSED_SECONDS`, goes unless a live process uses it."""
    base = store.local_path(NODE_DIR)
    if base is None:
        return
    for group in node_groups(os.path.dirname(base)):
        where, age = f"{NODE_DIR}/{group.name}", max(0.0, now - group.last_used)
        why = collectable(group, now=now)
        if why is None or group.in_use:
            kept.append(GcItem(NODE_FILES, where, age, group.size,
                               "in use by a live process" if group.in_use
                               else "its interpreter and torch are here, used lately"))
        else:
            items.append(GcItem(NODE_FILES, where, age, group.size, why))


def _plan_notes(store: Store, found: Survey, now: float, bound: float, retry_after: float,
                items: list[GcItem], kept: list[GcItem]) -> None:  # fmt: skip
    """Every registered kind of note (`NOTE_KINDS`) by its age rule: copies first (their
    age is their newest file's), then the notes (their age is the time they record)."""
    # where -> (kind, key, limit, bytes, newest file time)
    copies: dict[str, tuple[NoteKind[Any], str, float, int, float]] = {}
    notes: list[tuple[NoteKind[Any], Seen, str, float]] = []
    for seen in found.files:
        kind = kind_of(seen.key)
        parsed = None if kind is None else kind.parse(seen.key)
        if kind is None or parsed is None:
            continue
        limit = kind.max_age(bound=bound, retry_after=retry_after)
        if limit is None:
            continue  # never collected (a pin)
        where, key = parsed
        if kind.layout is Layout.COPY:
            size, newest = copies.get(where, (kind, key, limit, 0, 0.0))[3:]
            copies[where] = (kind, key, limit, size + seen.size, max(newest, seen.mtime))
        else:
            notes.append((kind, seen, key, limit))
    for where, (kind, key, limit, size, newest) in sorted(copies.items()):
        age = now - newest
        if _kept_with_entry(kind, key, found, GcItem(kind.name, where, age, size, ""), kept):
            continue  # its entry's: loads verify it, a withdrawal drops it
        if age <= limit:
            kept.append(GcItem(kind.name, where, age, size, f"younger than {human_age(limit)}"))
            continue
        items.append(GcItem(kind.name, where, age, size, f"entry {key} is not published",
                            version=store.publication(where).version))  # fmt: skip
    for kind, seen, key, limit in notes:
        at, version = _note_time(store, seen, kind)
        if at is None:
            continue  # gone since the walk
        age = now - at
        if _kept_with_entry(kind, key, found, GcItem(kind.name, seen.key, age, seen.size, ""),
                            kept):  # fmt: skip
            continue
        (items if age > limit else kept).append(GcItem(
            kind.name, seen.key, age, seen.size,
            f"older than {human_age(limit)}" if age > limit else f"younger than {human_age(limit)}",
            version=version,
        ))  # fmt: skip


def _kept_with_entry(kind: NoteKind[Any], key: str, found: Survey, item: GcItem,
                     kept: list[GcItem]) -> bool:  # fmt: skip
    """Whether a note of `kind` stays because its key's entry is published
    (`Expiry.WITHOUT_ENTRY`); listed in `kept` with the kind's reason when it has one."""
    if kind.expiry is not Expiry.WITHOUT_ENTRY or key not in found.published:
        return False
    if kind.while_published:
        kept.append(replace(item, reason=kind.while_published))
    return True


def _debris_reason(d: Debris, bound: float, grace: float) -> str:
    if d.kind == "lease":
        return f"{d.detail}; free for {human_age(d.age_seconds)} (grace {human_age(grace)})"
    text = f"untouched for {human_age(d.age_seconds)} (bound {human_age(bound)})"
    return f"{d.detail}; {text}" if d.detail else text


def _note_time(store: Store, seen: Seen, kind: NoteKind[Any]) -> tuple[float | None, str | None]:
    """When the note says it was written (its file's time if it does not read), and the
    version a removal re-checks (a digest of its bytes)."""
    try:  # bounded, regular files only: a hostile note is judged by its file's time
        data = store.read(seen.key, max_size=RECORD_MAX_BYTES)
    except RecordError:
        return seen.mtime, _UNREADABLE
    if data is None:
        return None, None
    try:
        at = float(kind.codec.decode(data, source=seen.key).at)
    except RecordError:
        at = seen.mtime
    return at, _fingerprint(data)


_UNREADABLE = "unreadable"
"""The version of a note that does not read (too large, not a regular file): removed as
planned while it still does not read."""


def _fingerprint(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _remove(store: Store, item: GcItem) -> str | None:
    """Remove one planned item; None when removed (or gone already), else why it stayed."""
    if item.debris is not None:
        done = store.remove_debris(item.debris)
        return "changed since the plan (in use)" if done == "changed" else None
    kind = kind_named(item.kind)
    if kind is not None and kind.layout is Layout.COPY:
        if store.unpublish(item.where, version=item.version) or not store.published(item.where):
            return None
        return "republished since the plan"
    if kind is not None:
        return _remove_note(store, item, kind)
    if item.kind == "entry":
        return _withdraw(store, item)
    if item.kind == NODE_FILES:
        base = store.local_path(NODE_DIR)
        if base is None or remove_group(os.path.dirname(base), item.where.split("/")[-1]):
            return None
        return "in use since the plan"
    raise ValueError(f"cannot remove a {item.kind!r}")


def _remove_note(store: Store, item: GcItem, kind: NoteKind[Any]) -> str | None:
    """Remove a note still as planned. On a tier whose processes share a kernel, and for a
    kind whose writers hold its key's lock (`NoteKind.key_lock`: a compile writing its
    failure note, a process owing a promotion), under that lock, so the note cannot be
    rewritten between the comparison and the removal; a key whose lock is held keeps its
    note for the next pass. A kind written without the lock (a host's load-failure note)
    is compared and removed: a lock its writers never take would not keep them out."""
    parsed = kind.parse(item.where)
    if parsed is None or not kind.key_lock or not store.capabilities.kernel_locks:
        return _remove_note_as_planned(store, item)
    lock = store.lock(parsed[1])
    try:
        lock.acquire(0)
    except LockTimeout:
        return "in use (its key's lock is held)"
    try:
        return _remove_note_as_planned(store, item)
    finally:
        lock.release()


def _remove_note_as_planned(store: Store, item: GcItem) -> str | None:
    try:
        data = store.read(item.where, max_size=RECORD_MAX_BYTES)
        seen = None if data is None else _fingerprint(data)
    except RecordError:
        data, seen = b"", _UNREADABLE  # still the same unreadable file: it goes as planned
    if data is None:
        return None
    if seen != item.version:
        return "rewritten since the plan"
    store.delete(item.where)
    return None


def _withdraw(store: Store, item: GcItem) -> str | None:
    if not store.capabilities.kernel_locks:
        if store.unpublish(item.where, version=item.version):
            drop_unpacked(store, item.where)
            return None
        return "withdrawn or republished since the plan"
    # A tier whose processes share a kernel: a key whose lock is held is in use (being
    # compiled, fetched or verified); while this holds it, nothing republishes the key.
    lock = store.lock(item.where)
    try:
        lock.acquire(0)
    except LockTimeout:
        return "in use (its lock is held)"
    try:
        if store.unpublish(item.where, version=item.version):
            drop_unpacked(store, item.where)  # its package's unpacked copy goes with it
            return None
        return "withdrawn or republished since the plan"
    finally:
        lock.release()
