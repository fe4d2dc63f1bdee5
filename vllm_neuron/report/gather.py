"""Collect what a report shows, through each feature's own readers.

Why readers and not files: every artifact already has a reader that knows its schema, its
versions and its defects (`manifest.inspect.load_manifest`, `snapshot.bundles.list_bundles`,
`profiling.run_record.read_manifest`, `profiling.validate.validate_run`, the compile
cache's event records), so the page shows what the commands show, and a format change
reaches the report with no edit here. One unreadable thing (a manifest, a run) becomes a
problem on the page, never a failed report: the page is most useful when something broke.

The cache statistics are not computed here: the caller passes the document `cache stats
--json` prints for a tier (`stats_of`), so the page's numbers are that command's numbers.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from vllm_neuron.backends import Record, RecordCodec, local_path_of, open_store
from vllm_neuron.compile.entry.events import CACHE_EVENTS, EVENTS_STREAM
from vllm_neuron.compile.entry.load_failure_notes import read_load_failures
from vllm_neuron.compile.trust.policy import trust_policy, trust_summary
from vllm_neuron.manifest.inspect import check_manifest, load_manifest
from vllm_neuron.manifest.schema import Manifest

from .roots import Sources
from .runs import ProfileRun, SnapshotView, gather_profiles, gather_snapshots
from .tiers import TierEntries, piece_index, read_entries

__all__ = ["CacheView", "EngineView", "ProcessRow", "Report", "gather"]

MANIFEST_FILE = "manifest.json"
_EVENTS = RecordCodec(CACHE_EVENTS)


@dataclass(frozen=True)
class ProcessRow:
    """One writer of a cache's event log (a process: ``<host>-<pid>``) and its events."""

    cache: str
    writer: str
    events: tuple[Record, ...]
    skipped: int = 0  # lines of its segment that did not decode (a torn tail)


@dataclass(frozen=True)
class CacheView:
    """A tier. A local one has the `cache stats --json` document and one row per process; a
    remote one (`remote`: no event log of its own, or given with ``--remote``) has neither."""

    location: str
    stats: Mapping[str, Any]
    rows: tuple[ProcessRow, ...] = ()
    # Entries per trust verdict under this process's trusted keys, or per signer without
    # them (`compile.trust.trust_summary`); None when the tier could not be listed.
    trust: Mapping[str, int] | None = None
    # Hosts that fetched an entry of this tier and could not load it (a remote's notes,
    # `compile.load_notes`): "<key>: did not load on <host>: <error>".
    load_failures: tuple[str, ...] = ()
    remote: bool = False
    entries: TierEntries | None = None  # its entries (`report.tiers`)


@dataclass(frozen=True)
class EngineView:
    """One engine's manifest, and what `manifest check` finds wrong with it."""

    location: str
    manifest: Manifest | None = None
    problems: tuple[str, ...] = ()  # check_manifest's findings (partial deployment, artifacts)
    error: str | None = None  # the manifest could not be read

    def problems_of(self, graph_hash: str) -> tuple[str, ...]:
        """The findings that name this graph."""
        return tuple(p for p in self.problems if graph_hash in p)


@dataclass(frozen=True)
class Report:
    sources: Sources
    generated: float
    caches: tuple[CacheView, ...] = ()
    engines: tuple[EngineView, ...] = ()
    snapshots: tuple[SnapshotView, ...] = ()
    profiles: tuple[ProfileRun, ...] = ()


def process_rows(cache: str) -> tuple[ProcessRow, ...]:
    """One row per segment of the tier's event log: each segment has exactly one writer."""
    log = open_store(cache, create=False).log(EVENTS_STREAM)
    rows = []
    for key, data in log.segment_data():
        decoded = _EVENTS.decode_lines(data)
        writer = posixpath.basename(key).removesuffix(".jsonl")
        rows.append(ProcessRow(cache, writer, tuple(decoded.records), decoded.skipped))
    return tuple(rows)


def gather_caches(
    sources: Sources, stats_of: Callable[[str], Mapping[str, Any]]
) -> tuple[CacheView, ...]:
    """The local tiers, then the remote ones (no statistics: nothing of theirs is logged)."""
    local = [CacheView(c, stats_of(c), process_rows(c), _trust(c), _load_failures(c))
             for c in sources.caches]  # fmt: skip
    remote = [CacheView(r, {}, (), _trust(r), _load_failures(r), remote=True)
              for r in sources.remotes]  # fmt: skip
    return tuple(local + remote)


def with_entries(caches: tuple[CacheView, ...], engines: tuple[EngineView, ...]
                 ) -> tuple[CacheView, ...]:  # fmt: skip
    """Each tier with its entries, their pieces from every tier's events and every engine's
    manifest read."""
    pieces = piece_index((e for c in caches for row in c.rows for e in row.events),
                         (e.manifest for e in engines if e.manifest is not None))  # fmt: skip
    out = []
    for cache in caches:
        entries = read_entries(cache.location, pieces)
        # A note on an entry listed is in that entry's problems: the tier's own list keeps
        # only the notes of keys without one (withdrawn since, never published here).
        listed = {row.key for row in entries.live}
        orphans = tuple(n for n in cache.load_failures if n.split(":", 1)[0] not in listed)
        out.append(replace(cache, entries=entries, load_failures=orphans))
    return tuple(out)


def _load_failures(cache: str) -> tuple[str, ...]:
    """The tier's notes of hosts that could not load one of its entries (best-effort)."""
    try:
        notes = read_load_failures(open_store(cache, create=False))
    except Exception:  # noqa: BLE001 - a report shows what it can read
        return ()
    return tuple(f"{key}: did not load on {n.host}: {n.error}"
                 for key, found in sorted(notes.items()) for n in found)  # fmt: skip


def _trust(cache: str) -> Mapping[str, int] | None:
    """How the tier's entries are signed (docs/trust.md); best-effort, like the rest."""
    try:
        policy = trust_policy()
        return trust_summary(open_store(cache, create=False),
                             policy.keys if policy.checking else None)  # fmt: skip
    except Exception:  # noqa: BLE001 - a report shows what it can read
        return None


def _engine_locations(location: str) -> list[str]:
    """A manifest directory's engines (``<prefix>/manifest.json``), or the engine itself."""
    store = open_store(location, create=False)
    if store.exists(MANIFEST_FILE):
        return [store.url]
    return [store.sub(name).url for name in store.list_dir("")
            if not name.startswith(".") and store.exists(f"{name}/{MANIFEST_FILE}")]  # fmt: skip


def gather_engines(sources: Sources) -> tuple[EngineView, ...]:
    """Every engine's manifest, checked as `manifest check` checks it: against the first
    local tier the report reads (where its artifacts are looked up), or for partial
    deployments only when the report reads no cache."""
    cache_root = next((c for c in sources.caches if local_path_of(c)), None)
    engines = []
    for location in sources.manifests:
        for engine in _engine_locations(location):
            try:
                where, manifest = load_manifest(engine)
                problems = check_manifest(manifest, cache_root)
            except Exception as exc:  # noqa: BLE001 - one bad manifest must not hide the others
                engines.append(EngineView(engine, error=f"{type(exc).__name__}: {exc}"))
                continue
            engines.append(EngineView(where, manifest, tuple(problems)))
    return tuple(engines)


def gather(
    sources: Sources,
    *,
    stats_of: Callable[[str], Mapping[str, Any]],
    generated: float,
    replay: bool = False,
) -> Report:
    """Everything the page shows. `replay` runs each snapshot bundle's replay (needs torch;
    the first local tier is the cache replay loads entries from)."""
    replay_cache = next((c for c in sources.caches if local_path_of(c)), None)
    engines = gather_engines(sources)
    return Report(
        sources=sources,
        generated=generated,
        caches=with_entries(gather_caches(sources, stats_of), engines),
        engines=engines,
        snapshots=gather_snapshots(sources.snapshots, replay=replay, cache_dir=replay_cache),
        profiles=gather_profiles(sources.profiles),
    )
