"""Keeping a tier within a size bound: least recently used entries go first.

`VLLM_NEURON_CACHE_MAX_SIZE` bounds the local tier. After a publish (a compile or a
fetch) and when a process opens the cache, `Evictor.run` withdraws entries, least
recently used first, until the tier fits; `vllm-neuron cache prune --max-size` applies the
same order on demand (`eviction_order`, `withdraw_entries`, through
`prune.plan_prune`).

**Recency** is folded from what the cache already records: every hit (`hit`, any tier),
compile (`compile`) and fetch (`fetch`) event in the tier's ``.events`` stream names its
key and time, so a hit costs nothing more when a bound is set. An entry's last use is the
latest of those times and its record's ``created``; a tier without events (a remote) is
ordered by creation. `Recency` reads each event segment once and afterwards only what was
appended to it.

**Never evicted:**

- a **pinned** entry: one with a pin record ``.pins/<key>.json`` in the tier
  (`vllm-neuron cache pin KEY ... | --manifest M`, `unpin`); a pin outlives the entry, so
  an operator can pin a deployment's graphs before they are fetched;
- an entry **in use**: its key's lock is held by a live process (a compile, a fetch, a
  `cache verify` or `cache warm` of that key). The evictor takes the key's lock without
  waiting; held means in use, and while the evictor holds it nothing republishes the key;
- an entry **used in the last `RECENT_USE_SECONDS`** (automatic eviction only): a process
  that has just looked an entry up is about to load it from its directory;
- the keys the evicting process has **loaded** and the one it has just published
  (`protect`): the runtime loads an artifact from the entry's directory on every call,
  memory hits included.

**Node files** (toolchains/node_files.py: precompiled headers, kept runtime objects,
Inductor's cache, in ``.node/``) count toward the bound; a pass above it first removes the
groups no live process uses, least recently used first (a few seconds' rebuild each), then
entries. A group in use (its process alive) is never removed.

When only such entries are left the tier stays above its bound: one warning, and the next
publish tries again.

**Atomic:** each entry is withdrawn with ``Store.unpublish(key, version=...)``, the version
listed: a reader sees the whole entry or none of it, and an entry republished since it was
listed stays. Each withdrawal is an ``evict`` event (`cache stats`: evictions).

**Best-effort:** `Evictor.run` never raises (a failure is one warning per evictor), and
one pass runs at a time per tier: a process that finds the tier's ``evict`` lock held
leaves the pass to its holder.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from vllm_neuron.backends import (
    LockTimeout,
    Record,
    RecordCodec,
    Store,
    encode,
    fault_point,
)

from ..entry.check import KEY_RE
from ..entry.events import CACHE_EVENTS, EVENTS_STREAM, CacheHit, Compiled, Evicted, Fetched
from ..entry.notes import PIN_RECORDS, PINS, PINS_DIR, Pin
from ..tiers.inventory import EntryInfo, list_entries
from ..tiers.unpacked import drop_unpacked, unpacked_sizes
from ..toolchains.node_files import NODE_DIR, node_groups, remove_group

logger = logging.getLogger("vllm_neuron.compile")

EVICT_LOCK = "evict"
"""The tier-wide lock of an eviction pass (``.locks/evict.lock`` on local disk)."""
RECENT_USE_SECONDS = 60.0
"""Automatic eviction leaves alone an entry used this recently (about to be loaded)."""

IN_USE = "in use"
PINNED = "pinned"
CHANGED = "republished or withdrawn since it was listed"

_EVENTS = RecordCodec(CACHE_EVENTS)
_USES = (CacheHit, Compiled, Fetched)


# ------------------------------------------------------------------ pins
# A pin's directory and record (`Pin`) are declared with every per-key note's in
# `entry/notes.py` (`PINS`: never collected).
def _pin_key(key: str) -> str:
    if not KEY_RE.fullmatch(key):
        raise ValueError(f"{key!r} is not a cache key (32 lower-case hex characters)")
    return PINS.path(key)


def pin(store: Store, key: str, *, note: str = "") -> bool:
    """Pin `key` in `store`; True when it was not pinned before (a pin is kept as is)."""
    record = Pin(key=key, at=time.time(), by=f"{socket.gethostname()}:{os.getpid()}", note=note)
    return store.create(_pin_key(key), encode(record))


def unpin(store: Store, key: str) -> bool:
    """Remove `key`'s pin; True when there was one."""
    return store.delete(_pin_key(key))


def pinned_keys(store: Store) -> set[str]:
    """Every pinned key of `store` (a pin record that does not read still pins)."""
    return {
        name[: -len(".json")]
        for name in store.list_dir(PINS_DIR)
        if name.endswith(".json") and KEY_RE.fullmatch(name[: -len(".json")])
    }


def read_pins(store: Store) -> dict[str, Pin | None]:
    """Every pin of `store` with its record (None for one that does not read)."""
    out: dict[str, Pin | None] = {}
    for key in sorted(pinned_keys(store)):
        try:
            out[key] = PIN_RECORDS.read(store, _pin_key(key))
        except Exception:  # noqa: BLE001 - an unreadable pin still pins
            out[key] = None
    return out


def is_pinned(store: Store, key: str) -> bool:
    return store.exists(_pin_key(key))


# --------------------------------------------------------------- recency
class Recency:
    """Last use of every key, folded from a tier's ``.events`` stream.

    Each segment is read once; later calls read only what was appended since (a torn last
    line is read again once it is complete), so folding before every eviction pass costs
    one `info` per segment when nothing happened.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._log = store.log(EVENTS_STREAM)
        # segment -> (bytes consumed, up to the last complete line; last use per key)
        self._folded: dict[str, tuple[int, dict[str, float]]] = {}

    def last_used(self) -> dict[str, float]:
        merged: dict[str, float] = {}
        for segment in self._log.segments():
            info = self._store.info(segment)
            if info is None:
                continue
            done, uses = self._folded.get(segment, (0, {}))
            if info.size < done:  # replaced: read it again
                done, uses = 0, {}
            if info.size > done:
                done, uses = self._fold_tail(segment, done, dict(uses))
                self._folded[segment] = (done, uses)
            for key, at in uses.items():
                if at > merged.get(key, 0.0):
                    merged[key] = at
        return merged

    def _fold_tail(self, segment: str, offset: int, uses: dict[str, float]
                   ) -> tuple[int, dict[str, float]]:
        try:
            with self._store.open_read(segment) as reader:
                if offset:
                    reader.seek(offset)
                tail = reader.read()
        except FileNotFoundError:
            return offset, uses
        end = tail.rfind(b"\n") + 1  # a torn last line waits until it is complete
        for event in _EVENTS.decode_lines(tail[:end]).records:
            if isinstance(event, _USES) and event.at > uses.get(event.key, 0.0):
                uses[event.key] = event.at
        return offset + end, uses


# ------------------------------------------------------------------ order
@dataclass(frozen=True)
class Candidate:
    """An entry that may be evicted, and the last use it is ordered by."""

    info: EntryInfo
    last_used: float


def sized_entries(store: Store) -> list[EntryInfo]:
    """`list_entries`, each entry's size counting its unpacked copies too (`unpacked.py`):
    they go with it, so the bound is on the bytes the tier holds. A copy whose entry is gone
    is not counted here (no entry to evict frees it): `cache gc` collects it."""
    copies = unpacked_sizes(store)
    return [replace(e, size=e.size + copies[e.key]) if e.key in copies else e
            for e in list_entries(store)]  # fmt: skip


def eviction_order(
    entries: Iterable[EntryInfo],
    last_used: Mapping[str, float],
    *,
    pinned: Collection[str] = (),
    protect: Collection[str] = (),
    recent_after: float | None = None,
) -> list[Candidate]:
    """Entries that may go, least recently used first (ties by key).

    Left out: entries with a problem (`cache verify` deals with those), `pinned` and
    `protect` keys, and entries used after `recent_after` (epoch seconds) when given.
    """
    out = []
    for info in entries:
        if info.problem is not None or info.key in pinned or info.key in protect:
            continue
        used = max(info.created, last_used.get(info.key, 0.0))
        if recent_after is not None and used > recent_after:
            continue
        out.append(Candidate(info, used))
    out.sort(key=lambda c: (c.last_used, c.info.key))
    return out


def plan_to_fit(order: Sequence[Candidate], total: int, max_size: int) -> list[Candidate]:
    """The shortest prefix of `order` whose removal brings `total` to `max_size` or below
    (all of `order` when even that is not enough)."""
    planned = []
    for candidate in order:
        if total <= max_size:
            break
        planned.append(candidate)
        total -= candidate.info.size
    return planned


# -------------------------------------------------------------- withdrawal
def withdraw(store: Store, info: EntryInfo) -> str | None:
    """Withdraw the listed version of `info`; None when done, else why it stays.

    The key's lock is taken without waiting (a kernel lock on local disk, a lease
    elsewhere): held means in use (`IN_USE`), and while it is held here nothing compiles,
    fetches or verifies the key. The pin is looked at again under it (`PINNED`): one added
    since the listing counts. A version republished or withdrawn since stays (`CHANGED`).
    """
    lock = store.lock(info.key)
    try:
        lock.acquire(timeout=0)
    except LockTimeout:
        return IN_USE
    try:
        if is_pinned(store, info.key):
            return PINNED
        if not store.unpublish(info.key, version=info.version):
            return CHANGED
        drop_unpacked(store, info.key)  # its package's unpacked copy goes with it
        return None
    finally:
        lock.release()


@dataclass
class Withdrawn:
    """What `withdraw_entries` did: the entries withdrawn, the ones that stayed and why,
    and the tier's total size after (as listed, less what was withdrawn)."""

    withdrawn: list[EntryInfo] = field(default_factory=list)
    stayed: dict[str, str] = field(default_factory=dict)
    total: int = 0

    @property
    def freed_bytes(self) -> int:
        return sum(e.size for e in self.withdrawn)


def withdraw_entries(
    store: Store,
    *,
    must: Sequence[EntryInfo] = (),
    lru: Sequence[Candidate] = (),
    total: int = 0,
    max_size: int | None = None,
    on_withdrawn: Callable[[EntryInfo, float], None] | None = None,
) -> Withdrawn:
    """The delete loop of every eviction and prune.

    Withdraws each of `must` (an age or compatibility policy), then walks `lru` while
    `total` is above `max_size`: an entry that stays (in use, pinned meanwhile, changed)
    is passed over and the next one taken. `on_withdrawn(info, last_used)` after each.
    """
    done = Withdrawn(total=total)
    steps = [(info, info.created, False) for info in must]
    steps += [(c.info, c.last_used, True) for c in lru]
    for info, last_used, for_size in steps:
        if for_size and (max_size is None or done.total <= max_size):
            break
        why = withdraw(store, info)
        if why is not None:
            done.stayed[info.key] = why
            continue
        done.withdrawn.append(info)
        done.total -= info.size
        if on_withdrawn is not None:
            on_withdrawn(info, last_used)
        # One entry withdrawn, the rest not yet: a crash here leaves whole entries only,
        # and the next pass (a publish, a start-up, a prune) goes on.
        fault_point("evict.mid-delete")
    return done


# -------------------------------------------------------------- automatic
class Evictor:
    """Keeps one tier within `max_size` bytes (the local tier, VLLM_NEURON_CACHE_MAX_SIZE).

    `run(protect=...)` after a publish and at start-up: best-effort, one pass at a time
    per tier, evictions recorded as ``evict`` events through `record`.
    """

    def __init__(
        self,
        store: Store,
        max_size: int,
        *,
        record: Callable[[Record], None] | None = None,
        recent_use_seconds: float | None = None,
    ) -> None:
        if max_size <= 0:
            raise ValueError(f"max_size must be above 0 bytes, got {max_size!r}")
        self.store = store
        self.max_size = max_size
        self.recent_use_seconds = (
            RECENT_USE_SECONDS if recent_use_seconds is None else recent_use_seconds
        )
        self._record = record
        self._recency = Recency(store)
        self._failed = False
        self._warned_over = False

    def run(self, protect: Collection[str] = ()) -> Withdrawn | None:
        """One pass; None when another process's pass was under way or it failed."""
        try:
            lock = self.store.lock(EVICT_LOCK)
            try:
                lock.acquire(timeout=0)
            except LockTimeout:
                return None  # another process is evicting: its pass counts for this one
            try:
                return self._pass(protect)
            finally:
                lock.release()
        except Exception as exc:  # noqa: BLE001 - eviction never fails a compile
            if not self._failed:
                self._failed = True
                logger.warning("compile cache: eviction in %s failed: %s", self.store.url, exc)
            return None

    def _pass(self, protect: Collection[str]) -> Withdrawn:
        entries = sized_entries(self.store)
        total = sum(e.size for e in entries) + self._node_files(entries)
        if total <= self.max_size:
            return Withdrawn(total=total)
        grace = self.recent_use_seconds
        order = eviction_order(
            entries, self._recency.last_used(), pinned=pinned_keys(self.store),
            protect=protect, recent_after=time.time() - grace if grace > 0 else None)  # fmt: skip

        def note(info: EntryInfo, last_used: float) -> None:
            if self._record is not None:
                self._record(Evicted(key=info.key, at=time.time(), size=info.size,
                                     last_used=last_used))  # fmt: skip

        done = withdraw_entries(self.store, lru=order, total=total, max_size=self.max_size,
                                on_withdrawn=note)  # fmt: skip
        if done.total > self.max_size and not self._warned_over:
            self._warned_over = True
            logger.warning(
                "compile cache: %s holds %d bytes, above VLLM_NEURON_CACHE_MAX_SIZE=%d, after "
                "evicting %d entries: the rest is pinned, in use or used in the last %.0f s",
                self.store.url, done.total, self.max_size, len(done.withdrawn),
                self.recent_use_seconds)  # fmt: skip
        return done

    def _node_files(self, entries: Sequence[EntryInfo]) -> int:
        """The bytes of the tier's idle node files (toolchains/node_files.py: groups no live
        process uses), which count toward the bound, after removing them, least recently
        used first, while the tier is above it: each is a few seconds' rebuild for an
        interpreter not running now, where an entry is a compile. A group in use is a live
        process's working set, as the entries it loaded are: not counted (it could not be
        removed, and counting it would only withdraw entries to pay for a running server's
        Inductor cache); it counts once its processes are gone."""
        base = self.store.local_path(NODE_DIR)
        if base is None:
            return 0
        groups = [g for g in node_groups(os.path.dirname(base)) if not g.in_use]
        kept = sum(g.size for g in groups)
        total = sum(e.size for e in entries) + kept
        for group in sorted(groups, key=lambda g: g.last_used):
            if total <= self.max_size:
                break
            if remove_group(os.path.dirname(base), group.name):
                logger.info("compile cache: removed the node files %s (%d bytes, not in use) "
                            "to keep %s within VLLM_NEURON_CACHE_MAX_SIZE=%d", group.name,
                            group.size, self.store.url, self.max_size)  # fmt: skip
                total -= group.size
                kept -= group.size
        return kept
