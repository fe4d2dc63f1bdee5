"""Which stores a report reads: from the roots given, by the package's own layouts.

Why by layout: a deployment's artifacts sit where the settings put them, under two roots
(docs/report.md): ``VLLM_CACHE_ROOT`` holds the local compile cache and the snapshot bundles
(``neuron/compile_cache``, ``neuron/snapshots``: `compile/local_tier.py`,
`envs/snapshot.py`), a project root holds the profile runs (``agent_artifacts/profiles``:
`profiling/layout.py`), and a manifest directory, which has no default, is looked for as
``manifests`` (the name the docs give ``VLLM_NEURON_MANIFEST_DIR``). A root that has none of
these is taken for what it holds itself (a cache tier, a manifest directory or engine, a
snapshot root, a profile run or a directory of runs), so ``report /data/manifests`` works
too. An explicit ``--cache-dir`` (``--manifest-dir``, ...) replaces what the roots would give
for that kind. Everything is looked at through the storage layer, so a root may be a URL.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vllm_neuron.backends import (
    Store,
    StoreError,
    check_location,
    local_root_missing,
    normalize_location,
    open_store,
    probe_store,
)

__all__ = ["KINDS", "LAYOUT", "Sources", "open_root", "resolve_sources"]

CACHE, MANIFESTS, SNAPSHOTS, PROFILES = "cache", "manifests", "snapshots", "profiles"
KINDS = (CACHE, MANIFESTS, SNAPSHOTS, PROFILES)

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


@dataclass(frozen=True)
class Sources:
    """The locations a report reads, per kind, and where each came from (for the page)."""

    caches: tuple[str, ...] = ()
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


def sniff(store: Store) -> str | None:
    """What a root that follows none of the layouts holds itself, or None."""
    names = store.list_dir("")
    if ".events" in names:
        return CACHE  # a local tier: its processes' event logs
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


def _from_root(argument: str) -> list[tuple[str, str]]:
    """(kind, location) of everything `argument` holds; a ValueError when it holds nothing."""
    store = open_root(argument, "root")
    found = [(kind, store.sub(rel).url) for kind, rel in LAYOUT if _present(store, rel)]
    if not found:
        kind = sniff(store)
        if kind is not None:
            found = [(kind, store.url)]
    if not found:
        looked = ", ".join(rel for _, rel in LAYOUT)
        raise ValueError(
            f"root {argument!r}: no compile cache, manifests, snapshot bundles or profile runs "
            f"(looked for {looked} under it, and at what it holds itself); name the "
            "directories with --cache-dir, --manifest-dir, --snapshot-dir or --profile-dir"
        )
    return found


def resolve_sources(roots: Sequence[str], explicit: Mapping[str, Sequence[str]]) -> Sources:
    """The stores to read: `explicit` locations per kind (from ``--cache-dir`` and the like,
    keyed by `KINDS`) replace, for their kind, what the `roots` hold."""
    picked: dict[str, list[str]] = {kind: [] for kind in KINDS}
    origins: list[tuple[str, str, str]] = []
    for kind in KINDS:
        for location in explicit.get(kind, ()):
            store = open_root(location, f"--{_OPTION[kind]}")
            picked[kind].append(store.url)
            origins.append((f"--{_OPTION[kind]}", kind, store.url))
    for argument in roots:
        for kind, location in _from_root(argument):
            if explicit.get(kind):
                continue
            if location not in picked[kind]:
                picked[kind].append(location)
            origins.append((argument, kind, location))
    return Sources(
        caches=tuple(picked[CACHE]), manifests=tuple(picked[MANIFESTS]),
        snapshots=tuple(picked[SNAPSHOTS]), profiles=tuple(picked[PROFILES]),
        origins=tuple(origins),
    )  # fmt: skip


_OPTION = {CACHE: "cache-dir", MANIFESTS: "manifest-dir", SNAPSHOTS: "snapshot-dir",
           PROFILES: "profile-dir"}  # fmt: skip
