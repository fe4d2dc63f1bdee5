"""Emit: fold an engine's ledger into its `manifest.json`.

Run once per engine after warm-up by ``local_rank == 0``: group the ledger lines by key
(accumulating the global ranks that traced each graph), enrich each graph from its
compile-cache entry, join the config and the environment, write
``<prefix>/manifest.json`` atomically, then remove this engine's ledger directory only.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import platform
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import msgspec

from vllm_neuron.backends import RecordCodec, Store, join, open_store
from vllm_neuron.identity import get_server_prefix

from .ledger import LEDGER_DIR, LedgerEntry
from .schema import MANIFEST_FILE, GraphEntry, Manifest, ManifestConfig, encode_manifest

logger = logging.getLogger("vllm_neuron.manifest")

ENTRY_RECORD = "entry.json"


@functools.lru_cache(maxsize=1)
def environment_snapshot() -> dict[str, str]:
    """Installed package versions (a pip-freeze) plus the Python version."""
    versions: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            versions[str(name).lower()] = str(dist.version)
    return {"python": platform.python_version(), **dict(sorted(versions.items()))}


class LedgerLine(msgspec.Struct, frozen=True, gc=False):
    """The fold's view of a ledger line: what grouping needs, decoded lazily.

    ``input_shapes`` and ``compiler_flags`` stay raw JSON until a key's first line is kept,
    so a fold over 100,000 lines builds 100,000 small objects, not 100,000 lists.
    """

    key: str
    rank: int
    global_rank: int | None = None
    input_shapes: msgspec.Raw = msgspec.Raw(b"[]")
    compiler_flags: msgspec.Raw = msgspec.Raw(b'""')
    type: str = "ledger"


_LEDGER_CODEC = RecordCodec([LedgerLine])  # type: ignore[list-item]
_SHAPES = msgspec.json.Decoder(list[str])
_FLAGS = msgspec.json.Decoder(str)


class _Graph:
    __slots__ = ("input_shapes", "compiler_flags", "ranks")

    def __init__(self, entry: LedgerEntry | LedgerLine) -> None:
        if isinstance(entry, LedgerLine):
            self.input_shapes = _SHAPES.decode(entry.input_shapes)
            self.compiler_flags = _FLAGS.decode(entry.compiler_flags)
        else:
            self.input_shapes = entry.input_shapes
            self.compiler_flags = entry.compiler_flags
        self.ranks: set[int] = set()


def group_ledger(
    entries: Sequence[LedgerEntry | LedgerLine], tp_ranks: Sequence[int] | None = None
) -> dict[str, _Graph]:
    """Lines grouped by key, each with the union of the global ranks that traced it.

    A line's rank is the writer's TP-local rank; it maps to a global rank through
    ``tp_ranks`` (the TP group's global ranks, by local index) unless the writer recorded
    its global rank itself.
    """
    graphs: dict[str, _Graph] = {}
    lookup = graphs.get
    mapping = list(tp_ranks) if tp_ranks is not None else None
    for entry in entries:
        graph = lookup(entry.key)
        if graph is None:
            graph = graphs[entry.key] = _Graph(entry)
        rank = entry.global_rank
        if rank is None:
            rank = entry.rank
            if mapping is not None and 0 <= rank < len(mapping):
                rank = int(mapping[rank])
        graph.ranks.add(rank)
    return graphs


def _iso(mtime: float) -> str:
    return datetime.fromtimestamp(mtime, tz=timezone.utc).isoformat()


class _ArtifactMeta(msgspec.Struct, gc=False):
    files: list[str] = []
    output_shapes: list[str] = []
    hlo_file: str | None = None


class _EntryView(msgspec.Struct, gc=False):
    """What enrichment reads of a cache entry's record (the rest is skipped, not built)."""

    meta: _ArtifactMeta = msgspec.field(default_factory=_ArtifactMeta)


_ENTRY_VIEW = msgspec.json.Decoder(_EntryView)


def enrich(key: str, graph: _Graph, cache_root: str | None) -> GraphEntry:
    """A graph entry, with paths, size, timestamp and output shapes from its cache entry."""
    if cache_root is None:
        return GraphEntry(graph_hash=key, input_shapes=list(graph.input_shapes),
                          compiler_flags=graph.compiler_flags, ranks=sorted(graph.ranks))
    entry_dir = f"{cache_root}/{key}"
    with open(f"{entry_dir}/{ENTRY_RECORD}", "rb") as f:
        meta = _ENTRY_VIEW.decode(f.read()).meta
    if not meta.files:
        raise ValueError(f"compile cache entry {entry_dir} names no artifact")
    artifact = meta.files[0]
    st = os.stat(f"{entry_dir}/{artifact}")  # the one stat: size and compile time
    hlo_file = meta.hlo_file
    output_shapes = meta.output_shapes
    if hlo_file:
        from vllm_neuron.compile.toolchains.neuron import parse_hlo_entry_result_shapes

        with open(f"{entry_dir}/{hlo_file}", encoding="utf-8", errors="replace") as f:
            output_shapes = parse_hlo_entry_result_shapes(f.read())
    return GraphEntry(
        graph_hash=key,
        hlo_path=f"{key}/{hlo_file}" if hlo_file else None,
        neff_path=f"{key}/{artifact}",
        neff_size=st.st_size,
        created_timestamp=_iso(st.st_mtime),
        input_shapes=list(graph.input_shapes),
        output_shapes=list(output_shapes),
        compiler_flags=graph.compiler_flags,
        ranks=sorted(graph.ranks),
    )


def read_ledger(store: Store, prefix: str) -> tuple[list[LedgerLine], int]:
    """Every decodable ledger line of the engine `prefix`, and how many were skipped."""
    decoded = store.log(join(LEDGER_DIR, prefix)).read(_LEDGER_CODEC)
    lines = [line for line in decoded.records if line.type == "ledger"]
    skipped = decoded.skipped + len(decoded.records) - len(lines)
    if skipped:
        logger.warning(
            "manifest: skipped %d undecodable ledger line(s) for %s (%s)",
            skipped,
            prefix,
            "; ".join(decoded.errors[:3]) or "not ledger records",
        )
    return lines, skipped


def emit_manifest(
    manifest_dir: str | Store,
    config: ManifestConfig,
    *,
    cache_root: str | None,
    prefix: str | None = None,
    tp_ranks: Sequence[int] | None = None,
    environment: Mapping[str, str] | None = None,
    cleanup: bool = True,
) -> Manifest:
    """Build, write and return this engine's manifest (raises on failure)."""
    store = manifest_dir if isinstance(manifest_dir, Store) else open_store(manifest_dir)
    prefix = prefix or get_server_prefix()
    entries, _skipped = read_ledger(store, prefix)
    graphs = group_ledger(entries, tp_ranks)
    enriched = []
    problems = []
    for key in sorted(graphs):
        try:
            enriched.append(enrich(key, graphs[key], cache_root))
        except Exception as exc:  # noqa: BLE001 - one bad entry must not lose the others
            problems.append(f"{key}: {exc}")
            graph = graphs[key]
            enriched.append(
                GraphEntry(graph_hash=key, input_shapes=list(graph.input_shapes),
                           compiler_flags=graph.compiler_flags, ranks=sorted(graph.ranks))
            )
    if problems:
        logger.warning(
            "manifest: could not enrich %d graph(s) from the compile cache %s: %s",
            len(problems), cache_root, "; ".join(problems[:3]),
        )
    manifest = Manifest(
        config=config,
        graphs=enriched,
        environment=dict(environment if environment is not None else environment_snapshot()),
    )
    store.write(join(prefix, MANIFEST_FILE), encode_manifest(manifest))
    if cleanup:
        store.delete_tree(join(LEDGER_DIR, prefix))
    return manifest


_emit_warned = False


def emit_manifest_best_effort(
    manifest_dir: str | Store, config: ManifestConfig, **kwargs: Any
) -> Manifest | None:
    """`emit_manifest`, logged once and swallowed on failure (it never breaks warm-up)."""
    global _emit_warned
    try:
        return emit_manifest(manifest_dir, config, **kwargs)
    except Exception as exc:  # noqa: BLE001 - best-effort by specification
        if not _emit_warned:
            _emit_warned = True
            logger.warning("manifest: emit to %s failed: %s", manifest_dir, exc)
        return None


def emit_for_this_engine(
    config: ManifestConfig, *, tp_ranks: Sequence[int] | None = None
) -> Manifest | None:
    """Emit this engine's manifest if VLLM_NEURON_MANIFEST_DIR is set (best-effort).

    What the model runner calls after warm-up on ``local_rank == 0``; returns None when the
    feature is off or the emit failed (logged).
    """
    from vllm_neuron.envs import get_neuron_compile_cache_dir, manifest_settings

    settings = manifest_settings()
    if settings.manifest_dir is None:
        return None
    return emit_manifest_best_effort(
        settings.manifest_dir,
        config,
        cache_root=get_neuron_compile_cache_dir(),
        tp_ranks=tp_ranks,
    )
