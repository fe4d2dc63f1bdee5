"""What a store holds, from one walk: what is published, and what nobody will use again.

`Store.survey` and `Store.remove_debris` are built from the functions here; a tier's
garbage collector (`vllm_neuron/compile/upkeep/collect.py`) plans with the first and
removes with the second, and never names one of the layer's own names (`layout.py`).

**One walk.** Everything is classified from one recursive listing of the store with sizes
and modification times (`Store._walk`: one paginated LIST on S3, a `scandir` walk on local
disk), plus, on S3, one listing of the unfinished multipart uploads under the prefix
(`Store._unfinished_uploads`). Reads are added only where a listing cannot tell:

- a name's commit record is read only when it holds more than one version, a withdrawal
  tombstone, no version, or a version written after the record; a name with one version
  older than its commit record is taken to publish that version (the writer uploads it
  first, then creates the record). A commit record naming a version whose files are gone
  while another version sits beside it is a broken publication (`Store.publication`);
  `cache verify` reports it and the next commit replaces it.
- each lease's latest generation record is read (whether it was released, and its
  holder's period and expiry);
- each old-looking multipart upload's parts are listed (a part uploaded recently keeps
  it alive, whatever its initiation time says).

**Debris** (`Debris.kind`), each untouched for longer than the caller's bound (its age is
counted from its newest file, or directory on local disk):

- ``staging``: ``.staging/<uuid>/`` (rename stores), a build or fetch never published;
- ``trash``: ``.trash/<uuid>/`` (rename stores), a withdrawal never finished;
- ``orphan-version``: ``<final>/.v/<uuid>/`` that no commit record names (commit-record
  stores); kept while a young multipart upload writes into it;
- ``tombstone``: ``<final>/.v/withdraw-<version>/``, a withdrawal killed while it held the
  version;
- ``upload``: an S3 multipart upload never completed nor aborted (age: since its
  initiation or, when later, its newest part);
- ``partial``: ``<key>.<token>.partial``, a killed writer's temp file (local disk);
- ``lease``: ``.locks/<name>/`` whose latest generation was released, or expired, more
  than ``lease_grace`` ago (not the bound: a lease has its own clock; see `_leases`).

**Never debris:** a lease that is held (its latest record unexpired), kernel lock files
(``.locks/<name>.lock``: deleting one while another process opens it would let two
processes hold the lock at once), anything younger than the bound, a published version.

**Removal** (`debris_removal.py`) re-checks what the survey saw and leaves what changed.
"""

from __future__ import annotations

import builtins
import hashlib
import time
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

from .keys import join
from .layout import COMMIT_RECORD, LOCKS_DIR, STAGING_DIR, TRASH_DIR, VERSIONS_DIR
from .locks import generation_of
from .protocol import ByteStore
from .publication import WITHDRAWAL, read_commit
from .records import LEASE_RECORDS, RECORD_MAX_BYTES, RecordError

DebrisKind = Literal[
    "staging", "trash", "orphan-version", "tombstone", "upload", "partial", "lease"
]
Removal = Literal["removed", "gone", "changed"]
"""What `remove_debris` did: removed it; found it gone already; left it, because it
changed since the survey (in use again)."""

TIME_SLACK = 2.0
"""Seconds of clock resolution allowed when comparing a listing's times: S3 keeps
whole seconds."""


class Seen(NamedTuple):
    """One file (or, on local disk, directory) of a walk."""

    key: str
    size: int
    mtime: float
    directory: bool = False
    temp: bool = False  # a writer's temp file (`_atomic.is_temp`): never a key
    version: str = ""  # a directory directly under the root: `_dir_version`, when known


class Upload(NamedTuple):
    """An unfinished S3 multipart upload: its key (relative to the store), id, and the
    time it was initiated or last received a part."""

    key: str
    upload_id: str
    active: float


@dataclass(frozen=True)
class Debris:
    """Something no process will use again (see the module's table), and how to remove it.

    `prefix`: the key or prefix it occupies. `newest`: the time its age is counted from.
    `detail`: for people (a lease's owner, an upload's id). `handle`: what removal needs
    and re-checks (a lease's generation keys, then a digest of its latest record; an
    upload's id).
    """

    kind: DebrisKind
    prefix: str
    size: int
    age_seconds: float
    newest: float
    detail: str = ""
    handle: tuple[str, ...] = ()


@dataclass(frozen=True)
class Published:
    """A publication directly under the root, as the walk saw it.

    `version`: what `unpublish(name, version=...)` is conditional on (the directory's
    identity on rename stores, the version named by the commit record elsewhere);
    `committed`: when it was published (the commit record's time, or the newest file of a
    published directory); `size` and `files` of its content.
    """

    name: str
    version: str | None
    committed: float
    size: int
    files: int


@dataclass(frozen=True)
class Kept:
    """Something the survey looked at and left, and why (held, younger than the bound)."""

    kind: DebrisKind
    prefix: str
    age_seconds: float
    reason: str


@dataclass(frozen=True)
class Survey:
    """`Store.survey`: what is published, what is debris, what was kept, and every other
    file (the features' own: notes, event segments), with size and time."""

    published: dict[str, Published] = field(default_factory=dict)
    debris: list[Debris] = field(default_factory=list)
    kept: list[Kept] = field(default_factory=list)
    files: list[Seen] = field(default_factory=list)


class SurveyedStore(ByteStore, Protocol):
    """What the survey needs of a store beyond `ByteStore` (`StoreBase` has it all)."""

    def _walk(self, prefix: str = "") -> builtins.list[Seen]: ...
    def _unfinished_uploads(self) -> builtins.list[Upload]: ...
    def _abort_upload(self, key: str, upload_id: str) -> bool: ...
    def _remove_empty_dir(self, prefix: str) -> None: ...


class _Group:
    """Size, newest time and file count of the files (and directories) under a prefix."""

    __slots__ = ("files", "newest", "size")

    def __init__(self) -> None:
        self.size, self.newest, self.files = 0, 0.0, 0

    def add(self, seen: Seen) -> None:
        self.newest = max(self.newest, seen.mtime)
        if not seen.directory:
            self.size += seen.size
            self.files += 1


def generic_walk(store: ByteStore, prefix: str) -> list[Seen]:
    """Every file under `prefix`: a listing, then `info` of each (backends do better)."""
    out = []
    for key in store.list(prefix):
        info = store.info(key)
        if info is not None:
            out.append(Seen(key, info.size, info.mtime))
    return out


def survey(
    store: SurveyedStore, *, older_than: float, lease_grace: float, now: float | None = None
) -> Survey:
    now = time.time() if now is None else now
    rename = store.capabilities.atomic_rename
    groups: dict[str, _Group] = {}  # .staging/<uuid>, .trash/<uuid>
    versions: dict[str, dict[str, _Group]] = {}  # name -> version id -> group
    commits: dict[str, Seen] = {}
    tops: dict[str, _Group] = {}  # rename stores: the published directories' content
    leases: dict[str, list[tuple[int, Seen]]] = {}
    idents: dict[str, str] = {}  # rename stores: a published directory's version, if walked
    out = Survey()

    for seen in store._walk(""):
        parts = seen.key.split("/")
        head = parts[0]
        if rename and head in (STAGING_DIR, TRASH_DIR):
            if len(parts) >= 2:  # a temp file inside counts: its writer is the area's
                _group(groups, f"{head}/{parts[1]}").add(seen)
            continue
        if seen.temp:
            if not seen.directory:
                _judge(out, "partial", seen.key, _one(seen), now, older_than, "temp file")
            continue
        if head == LOCKS_DIR:
            generation = None if seen.directory or len(parts) < 3 else generation_of(parts[-1])
            if generation is not None:  # a record name as a lease writes it (junk is left)
                leases.setdefault("/".join(parts[:-1]), []).append((generation, seen))
            continue  # kernel lock files, empty lease directories: never debris
        if seen.directory:
            if rename and len(parts) == 1 and not head.startswith("."):
                _group(tops, head).add(seen)
                if seen.version:
                    idents[head] = seen.version
            continue
        if not rename and VERSIONS_DIR in parts[1:-1]:
            i = parts.index(VERSIONS_DIR, 1)
            name = "/".join(parts[:i])
            _group(versions.setdefault(name, {}), parts[i + 1]).add(seen)
            continue
        if not rename and len(parts) >= 2 and parts[-1] == COMMIT_RECORD:
            commits["/".join(parts[:-1])] = seen
            continue
        if rename and len(parts) >= 2 and not head.startswith("."):
            _group(tops, head).add(seen)
            continue
        out.files.append(seen)

    for prefix, group in sorted(groups.items()):
        kind: DebrisKind = "staging" if prefix.startswith(STAGING_DIR) else "trash"
        _judge(out, kind, prefix, group, now, older_than, "")
    if rename:
        for name, group in sorted(tops.items()):
            version = idents.get(name) or store._dir_version(name)
            if version is not None:
                out.published[name] = Published(name, version, group.newest, group.size,
                                                group.files)  # fmt: skip
    else:
        live = _uploading(store, now, older_than, out)
        _commit_record_names(store, commits, versions, live, now, older_than, out)
    _leases(store, leases, now, lease_grace, out)
    return out


def _group(groups: dict[str, _Group], prefix: str) -> _Group:
    group = groups.get(prefix)
    if group is None:
        group = groups[prefix] = _Group()
    return group


def _one(seen: Seen) -> _Group:
    group = _Group()
    group.add(seen)
    return group


def _judge(out: Survey, kind: DebrisKind, prefix: str, group: _Group, now: float,
           older_than: float, detail: str, *, live: bool = False) -> None:
    age = now - group.newest
    if live:
        out.kept.append(Kept(kind, prefix, age, "a multipart upload is writing into it"))
    elif age > older_than:
        out.debris.append(Debris(kind, prefix, group.size, age, group.newest, detail))
    else:
        out.kept.append(Kept(kind, prefix, age, "younger than the bound"))


def _uploading(store: SurveyedStore, now: float, older_than: float, out: Survey) -> set[str]:
    """Judge the unfinished multipart uploads; the prefixes young ones are writing into."""
    live: set[str] = set()
    for upload in store._unfinished_uploads():
        age = now - upload.active
        parts = upload.key.split("/")
        if age > older_than:
            out.debris.append(Debris("upload", upload.key, 0, age, upload.active,
                                     f"upload {upload.upload_id}", (upload.upload_id,)))
            continue
        out.kept.append(Kept("upload", upload.key, age, "younger than the bound"))
        if VERSIONS_DIR in parts[1:-1]:
            i = parts.index(VERSIONS_DIR, 1)
            live.add("/".join(parts[: i + 2]))
    return live


def _commit_record_names(
    store: SurveyedStore, commits: dict[str, Seen], versions: dict[str, dict[str, _Group]],
    live: set[str], now: float, older_than: float, out: Survey,
) -> None:
    for name in sorted(set(commits) | set(versions)):
        found = versions.get(name, {})
        real = {v: g for v, g in found.items() if not v.startswith(WITHDRAWAL)}
        commit = commits.get(name)
        named: str | None = None
        if commit is not None:
            only = next(iter(real.values())) if len(real) == 1 else None
            if only is not None and len(found) == 1 and only.newest <= commit.mtime + TIME_SLACK:
                named = next(iter(real))  # uploaded, then committed: see the module's notes
            else:
                record = read_commit(store, name)
                named = None if record is None else record[0]
            if "/" not in name and named is not None:
                content = real.get(named, _Group())
                out.published[name] = Published(name, named, commit.mtime, content.size,
                                                content.files)  # fmt: skip
        for version, group in sorted(found.items()):
            if version == named:
                continue
            prefix = join(name, VERSIONS_DIR, version)
            kind: DebrisKind = "tombstone" if version.startswith(WITHDRAWAL) else "orphan-version"
            detail = f"of {name}" + ("" if kind == "tombstone" else ", never committed")
            _judge(out, kind, prefix, group, now, older_than, detail, live=prefix in live)


def _leases(store: SurveyedStore, leases: dict[str, list[tuple[int, Seen]]], now: float,
            grace: float, out: Survey) -> None:
    """Judge each lease from one look, on wall clocks with a margin.

    A waiter (``locks.py``) trusts no wall clock: it watches a record for one period on its
    own monotonic clock. A survey runs once and cannot watch, so it takes the later of two
    clocks' word for when an unreleased lease ran out: the holder's ``expires`` (its own
    clock) and the record's last write as the store dated it (its time in the listing: S3's
    clock, the file server's) plus the holder's period. A holder whose clock is wrong in
    either direction then cannot make its live lease look dead (the store dated its last
    renewal); one whose clock runs ahead only keeps its dead lease longer. What is left is
    this process's own clock against the store's: off by less than the grace (10 minutes by
    default) it never removes a live lease. And removal re-checks the record's bytes, which
    every renewal changes.
    """
    for directory, generations in sorted(leases.items()):
        generations.sort()
        latest, seen = generations[-1]
        data: bytes | None = b""  # what removal compares when the record does not read
        try:
            data = store.read(seen.key, max_size=RECORD_MAX_BYTES)
            if data is None:
                continue  # taken and tidied meanwhile: someone is using it
            record = LEASE_RECORDS.decode(data, source=seen.key)
        except RecordError:  # torn, too large, not a regular file
            state, free_since, owner = "unreadable", seen.mtime, "?"
        else:
            owner = record.owner
            state = "released" if record.released else "expired"
            free_since = (seen.mtime if record.released
                          else max(record.expires, seen.mtime + max(record.duration, 0.0)))
        age = now - free_since
        if state == "expired" and free_since >= now:
            out.kept.append(Kept("lease", directory, age, f"held by {owner}"))
            continue
        if age <= grace:
            out.kept.append(Kept("lease", directory, age, f"{state} within the grace"))
            continue
        handle = (*(s.key for _, s in generations), digest_of(data or b""))
        out.debris.append(Debris(
            "lease", directory, sum(s.size for _, s in generations), age, free_since,
            f"{state}, generation {latest}, last held by {owner}", handle,
        ))  # fmt: skip


def digest_of(data: bytes) -> str:
    """The fingerprint removal re-checks a lease's latest record against."""
    return hashlib.sha256(data).hexdigest()
