"""Which stores a report reads: from the roots given, by the package's own layouts.

Why by layout: a deployment's artifacts sit where the settings put them, under two roots
(docs/report.md): ``VLLM_CACHE_ROOT`` holds the local compile cache and the snapshot bundles
(``neuron/compile_cache``, ``neuron/snapshots``: `compile/tiers/location.py`,
`envs/snapshot.py`), a project root holds the profile runs (``agent_artifacts/profiles``:
`profiling/layout.py`), and a manifest directory, which has no default, is looked for as
``manifests`` (the name the docs give ``VLLM_NEURON_MANIFEST_DIR``). A root that has none of
these is taken for what it holds itself (a cache tier, a manifest directory or engine, a
snapshot root, a profile run or a directory of runs), so ``report /data/manifests`` works
too; failing that, for a directory of nodes (children that follow the layouts or are tiers
themselves: the demo's output). An explicit ``--cache-dir`` (``--manifest-dir``, ...)
replaces what the roots would give for that kind. Everything is looked at through the
storage layer, so a root may be a URL.

A compile-cache tier is known by its event log (``.events/``: only a node's processes write
one, into their local tier) or by its entries (key directories holding an ``entry.json``
commit record, `compile/entry/record.py`). A tier with an event log is a local tier; one with
entries and no event log is a remote tier (a shared folder, a bucket), as is any tier given
with ``--remote``. A tier with neither (empty) is taken as local: there is nothing to tell by.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vllm_neuron.backends import (
    Store,
    StoreError,
    check_location,
    join,
    local_root_missing,
    normalize_location,
    open_store,
    probe_store,
)
from vllm_neuron.compile.entry.check import KEY_RE
from vllm_neuron.compile.entry.events import EVENTS_STREAM
from vllm_neuron.compile.entry.record import ENTRY_RECORD

__all__ = ["KINDS", "LAYOUT", "Sources", "open_root", "resolve_sources", "sniff", "tier_kind"]

# CACHE: a local compile-cache tier; REMOTE: a remote one (no event log of its own).
CACHE, REMOTE, MANIFESTS, SNAPSHOTS, PROFILES = (
    "cache", "remote", "manifests", "snapshots", "profiles")  # fmt: skip
KINDS = (CACHE, REMOTE, MANIFESTS, SNAPSHOTS, PROFILES)

# Where each kind sits under a root (first the VLLM_CACHE_ROOT layout, then the others).
LAYOUT: tuple[tuple[str, str], ...] = (
    (CACHE, "neuron/compile_cache"),
    (SNAPSHOTS, "neuron/snapshots"),
    (MANIFESTS, "manifests"),
    (PROFILES, "agent_artifacts/profiles"),
)

_HASH_DIR = re.compile(r"^[0-9a-f]{8,}$")
_RANK_DIR = re.compile(r"^rank\d+$")
_SNIFF_CHILDREN = 64  # a root's children looked at to tell what it is (a cache may be huge)
# Key directories looked at for a commit record: a tier is known by its first entries (a
# snapshot root's hash directories, which no record is under, cost this many looks).
_ENTRIES_LOOKED_AT = 16


@dataclass(frozen=True)
class Sources:
    """The locations a report reads, per kind, and where each came from (for the page)."""

    caches: tuple[str, ...] = ()  # local tiers
    remotes: tuple[str, ...] = ()  # remote tiers
    manifests: tuple[str, ...] = ()
    snapshots: tuple[str, ...] = ()
    profiles: tuple[str, ...] = ()
    origins: tuple[tuple[str, str, str], ...] = field(default=())  # (argument, kind, location)


def open_root(location: str, what: str) -> Store:
    """The store at `location`, checked and probed; a ValueError naming `what` (the argument
    or option) and the value when it is malformed, missing or unreachable (exit 2)."""
    try:
        checked = normalize_location(check_location(location))
        if local_root_missing(checked):
            raise ValueError("no such directory")
        store = open_store(checked, create=False)
        probe_store(store)
    except (ValueError, StoreError, OSError) as exc:
        raise ValueError(f"{what} {location!r}: {exc}") from None
    return store


def _present(store: Store, rel: str) -> bool:
    """Whether `rel` under the store is a directory with something in it (on S3: a prefix)."""
    return bool(store.list_dir(rel))


def _is_entry(store: Store, name: str) -> bool:
    """Whether `name` is a published compile-cache entry: a key holding a commit record."""
    if not KEY_RE.fullmatch(name):
        return False
    prefix = store.published(name)
    return prefix is not None and store.exists(join(prefix, ENTRY_RECORD))


def tier_kind(store: Store, names: list[str] | None = None) -> str | None:
    """CACHE for a tier with an event log (a local tier), REMOTE for one with entries and no
    event log, None when `store` holds neither (`names`: its top level, when listed)."""
    names = store.list_dir("") if names is None else names
    if EVENTS_STREAM in names:
        return CACHE
    keys = [n for n in names if KEY_RE.fullmatch(n)][:_ENTRIES_LOOKED_AT]
    return REMOTE if any(_is_entry(store, n) for n in keys) else None


def sniff(store: Store) -> str | None:
    """What a root that follows none of the layouts holds itself, or None."""
    names = store.list_dir("")
    tier = tier_kind(store, names)
    if tier is not None:
        return tier  # a tier: its processes' event logs, or its entries
    if "run_spec.json" in names:
        return PROFILES  # one profile run
    if "manifest.json" in names:
        return MANIFESTS  # one engine's manifest
    for name in [n for n in names if not n.startswith(".")][:_SNIFF_CHILDREN]:
        if store.exists(f"{name}/run_spec.json"):
            return PROFILES
        if store.exists(f"{name}/manifest.json"):
            return MANIFESTS
        if _HASH_DIR.match(name) and any(_RANK_DIR.match(c) for c in store.list_dir(name)):
            return SNAPSHOTS
    return None


def _by_layout(store: Store) -> list[tuple[str, str]]:
    """(kind, location) of the layouts under `store`; a tier's kind by what it holds."""
    found = []
    for kind, rel in LAYOUT:
        if _present(store, rel):
            sub = store.sub(rel)
            found.append(((tier_kind(sub) or CACHE) if kind == CACHE else kind, sub.url))
    return found


def _nodes(store: Store) -> list[tuple[str, str]]:
    """A directory of nodes: its children that follow the layouts or are tiers themselves
    (the demo's output: ``node-a/``, ``node-c/`` and ``remote-cache/``)."""
    found = []
    for name in [n for n in store.list_dir("") if not n.startswith(".")][:_SNIFF_CHILDREN]:
        child = store.sub(name)
        under = _by_layout(child)
        tier = None if under else tier_kind(child)
        found += under if tier is None else [(tier, child.url)]
    return found


def _from_root(argument: str) -> list[tuple[str, str]]:
    """(kind, location) of everything `argument` holds; a ValueError when it holds nothing."""
    store = open_root(argument, "root")
    found = _by_layout(store)
    if not found:
        kind = sniff(store)
        if kind is not None:
            found = [(kind, store.url)]
    if not found:
        found = _nodes(store)
    if not found:
        looked = ", ".join(rel for _, rel in LAYOUT)
        raise ValueError(
            f"root {argument!r}: no compile cache, manifests, snapshot bundles or profile runs "
            f"(looked for {looked} under it and under each of its children, and at what it "
            "holds itself); name the directories with --cache-dir, --remote, --manifest-dir, "
            "--snapshot-dir or --profile-dir"
        )
    return found


def resolve_sources(roots: Sequence[str], explicit: Mapping[str, Sequence[str]]) -> Sources:
    """The stores to read: `explicit` locations per kind (from ``--cache-dir`` and the like,
    keyed by `KINDS`) replace, for their kind, what the `roots` hold. A ``--cache-dir`` tier
    is read as local or remote by what it holds (`tier_kind`); a ``--remote`` one as remote."""
    picked: dict[str, list[str]] = {kind: [] for kind in KINDS}
    origins: list[tuple[str, str, str]] = []

    def pick(kind: str, location: str, argument: str) -> None:
        tiers = picked[CACHE] + picked[REMOTE]  # a tier is read once, as it was first found
        if location not in (tiers if kind in (CACHE, REMOTE) else picked[kind]):
            picked[kind].append(location)
        origins.append((argument, kind, location))

    for kind in KINDS:
        for location in explicit.get(kind, ()):
            store = open_root(location, f"--{_OPTION[kind]}")
            read_as = (tier_kind(store) or CACHE) if kind == CACHE else kind
            pick(read_as, store.url, f"--{_OPTION[kind]}")
    for argument in roots:
        for kind, location in _from_root(argument):
            if not explicit.get(kind):
                pick(kind, location, argument)
    return Sources(
        caches=tuple(picked[CACHE]), remotes=tuple(picked[REMOTE]),
        manifests=tuple(picked[MANIFESTS]),
        snapshots=tuple(picked[SNAPSHOTS]), profiles=tuple(picked[PROFILES]),
        origins=tuple(origins),
    )  # fmt: skip


_OPTION = {CACHE: "cache-dir", REMOTE: "remote", MANIFESTS: "manifest-dir",
           SNAPSHOTS: "snapshot-dir", PROFILES: "profile-dir"}  # fmt: skip
