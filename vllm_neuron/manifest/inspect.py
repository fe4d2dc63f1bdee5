"""Reading, comparing and checking manifests (the library behind `vllm-neuron manifest`)."""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_neuron.backends import Store, is_url, local_root_missing, normalize_location, open_store

from .pieces import PieceChange, completeness_gaps, diff_pieces, graph_fields_changed
from .schema import MANIFEST_FILE, GraphEntry, Manifest, decode_manifest


def _split(location: str) -> tuple[str, str]:
    """(parent, last component) of a normalized location (a URL stays a URL)."""
    if is_url(location):
        scheme, rest = location.split("://", 1)
        parent, name = posixpath.split(rest.rstrip("/"))
        return f"{scheme}://{parent}", name
    return os.path.dirname(location), os.path.basename(location)


def load_manifest(location: str) -> tuple[str, Manifest]:
    """A manifest from a file, an engine directory, or a manifest root with one engine.

    Returns (where it was read from, the manifest).
    """
    root = normalize_location(location)
    parent, name = _split(root)
    if name.endswith(".json"):
        store, key = open_store(parent, create=False), name
    else:
        if local_root_missing(root):
            raise FileNotFoundError(f"no manifest at {location}")
        store = open_store(root, create=False)
        if store.exists(MANIFEST_FILE):
            key = MANIFEST_FILE
        else:
            engines = [n for n in store.list_dir("") if store.exists(f"{n}/{MANIFEST_FILE}")]
            if len(engines) != 1:
                found = ", ".join(engines) or "none"
                raise FileNotFoundError(
                    f"{location}: expected one engine's {MANIFEST_FILE}, found {found}; "
                    "name the engine directory"
                )
            key = f"{engines[0]}/{MANIFEST_FILE}"
    data = store.read(key)
    if data is None:
        raise FileNotFoundError(f"no manifest at {location}")
    where = f"{store.url.rstrip('/')}/{key}"
    return where, decode_manifest(data, source=where)


def select_graphs(manifest: Manifest, where: str, graph: str | None = None) -> list[GraphEntry]:
    """Every graph, or the one `graph` names: its full hash, or a prefix of one hash (as
    `manifest show` prints them). A value naming none, or several, is a ValueError naming it."""
    if graph is None:
        return list(manifest.graphs)
    wanted = graph.strip().lower()
    exact = [g for g in manifest.graphs if g.graph_hash == wanted]
    found = exact or ([g for g in manifest.graphs if g.graph_hash.startswith(wanted)]
                      if wanted else [])
    hashes = sorted({g.graph_hash for g in found})
    if not hashes:
        known = ", ".join(g.graph_hash[:12] for g in manifest.graphs[:8]) or "none"
        more = ", ..." if len(manifest.graphs) > 8 else ""
        raise ValueError(f"--graph {graph!r}: {where} has no graph with that hash "
                         f"(its graphs: {known}{more})")
    if len(hashes) > 1:
        raise ValueError(f"--graph {graph!r} names {len(hashes)} graphs of {where} "
                         f"({', '.join(hashes)}): give more of the hash")
    return [g for g in found if g.graph_hash == hashes[0]][:1]


def snapshot_paths(graphs: list[GraphEntry]) -> list[str]:
    """The snapshot bundles `graphs` name (input and output paths, once each, in order)."""
    return list(dict.fromkeys(p for g in graphs
                              for p in (*g.input_snapshot_paths, *g.output_snapshot_paths)))


@dataclass(frozen=True)
class ManifestDiff:
    """Graphs by hash (``added``/``removed``/``changed``: only graphs naming no piece when
    both manifests name pieces, every graph otherwise), pieces by label, config by path."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: dict[str, list[str]] = field(default_factory=dict)
    config_changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    pieces_added: list[str] = field(default_factory=list)
    pieces_removed: list[str] = field(default_factory=list)
    pieces_changed: dict[str, PieceChange] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed or self.config_changed
                    or self.pieces_added or self.pieces_removed or self.pieces_changed)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out or {prefix: {}}
    return {prefix: value}


def diff_manifests(a: Manifest, b: Manifest) -> ManifestDiff:
    """What changed from `a` to `b`: pieces (their variants), graphs, config fields.

    When both manifests name pieces, graphs are compared by piece: a piece whose graph
    differs per rank is one piece with several variants, not several unrelated graphs, and a
    piece recompiled to a new hash is a changed piece. Graphs naming no piece, and every
    graph when either manifest names none (written before pieces), are compared by hash.
    """
    by_piece = any(g.traces for g in a.graphs) and any(g.traces for g in b.graphs)
    pieces_added: list[str] = []
    pieces_removed: list[str] = []
    pieces_changed: dict[str, PieceChange] = {}
    graphs_a, graphs_b = list(a.graphs), list(b.graphs)
    if by_piece:
        pieces_added, pieces_removed, pieces_changed = diff_pieces(graphs_a, graphs_b)
        graphs_a = [g for g in graphs_a if not g.traces]
        graphs_b = [g for g in graphs_b if not g.traces]
    ga = {g.graph_hash: g for g in graphs_a}
    gb = {g.graph_hash: g for g in graphs_b}
    changed = {}
    for key in sorted(set(ga) & set(gb)):
        fields = graph_fields_changed(ga[key], gb[key])
        if fields:
            changed[key] = fields
    ca = _flatten(msgspec.to_builtins(a.config))
    cb = _flatten(msgspec.to_builtins(b.config))
    config_changed = {
        k: (ca.get(k), cb.get(k)) for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k)
    }
    return ManifestDiff(
        added=sorted(set(gb) - set(ga)),
        removed=sorted(set(ga) - set(gb)),
        changed=changed,
        config_changed=config_changed,
        pieces_added=pieces_added,
        pieces_removed=pieces_removed,
        pieces_changed=pieces_changed,
    )


def check_manifest(manifest: Manifest, cache_root: str | None) -> list[str]:
    """Problems that make a deployment incomplete; empty when it is complete.

    A piece no variant of which some rank traced, or a graph naming no piece that some rank
    did not trace, is a partial deployment (`completeness_gaps`); an artifact the manifest
    names that is missing from the cache cannot be served.
    """
    problems = [gap.message() for gap in completeness_gaps(manifest)]
    cache = None if cache_root is None else open_store(cache_root, create=False)
    for graph in manifest.graphs:
        problems.extend(_missing_artifacts(graph, cache, cache_root))
    return problems


def _missing_artifacts(graph: GraphEntry, cache: Store | None, cache_root: str | None) -> list[str]:
    if cache is None:
        return []
    out = []
    for label, rel in (("neff_path", graph.neff_path), ("hlo_path", graph.hlo_path)):
        if rel and not cache.exists(rel):
            out.append(f"graph {graph.graph_hash}: {label} {rel} is missing from {cache_root}")
    if graph.neff_path is None:
        out.append(f"graph {graph.graph_hash}: no artifact recorded (enrichment failed)")
    return out


@dataclass(frozen=True)
class StartupCheck:
    """Would a deployment start without compiling: where each graph would come from
    (``local`` or ``remote``) and what no tier holds (graph -> why)."""

    sources: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.missing


def check_startup(manifest: Manifest, local: Store | None, remote: Store | None) -> StartupCheck:
    """Where each graph of `manifest` would be served from when the engine starts.

    A graph is ``local`` when the local tier holds its entry whole (every file at its
    recorded size, as a cache hit checks it), ``remote`` when the remote has it published
    (a fetch then verifies every checksum), and missing otherwise: that engine would
    compile it (or, in pre-compiled-only mode, fail). Under the process's trust policy
    ``require`` (docs/trust.md), an entry not signed by a trusted key counts as missing,
    with the reason: the engine would refuse it.
    """
    from vllm_neuron.compile.entry.check import KEY_RE, check_entry
    from vllm_neuron.compile.trust.policy import refusal, trust_policy

    policy = trust_policy()
    out = StartupCheck()
    for key in dict.fromkeys(g.graph_hash for g in manifest.graphs):
        untrusted = None
        if not KEY_RE.fullmatch(key):
            out.missing[key] = "not a compile-cache key"
            continue
        if local is not None and check_entry(local, key, full=False).ok:
            untrusted = refusal(policy, local, key, own_tier=True)
            if untrusted is None:
                out.sources[key] = "local"
                continue
        if remote is not None and remote.publication(key).state == "published":
            untrusted = refusal(policy, remote, key, own_tier=False)
            if untrusted is None:
                out.sources[key] = "remote"
                continue
        if untrusted is not None:
            out.missing[key] = f"untrusted: {untrusted}"
        else:
            where = " or the remote" if remote is not None else ""
            out.missing[key] = f"in neither the local tier{where}"
    return out

