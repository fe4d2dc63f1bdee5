"""Emit: fold an engine's ledger into its `manifest.json`.

Run once per engine after warm-up by ``local_rank == 0``: group the ledger lines of this
run by key (accumulating the global ranks that traced each graph), enrich each graph from
its compile-cache entry, join the config and the environment (both with every secret
redacted: `redacted_config`), write ``<prefix>/manifest.json`` atomically, then remove this
engine's ledger directory only.

A manifest lists what this run compiled. Segments under the prefix from other runs (a
server killed before its emit leaves its segments behind; so does a version of this
package without run ids) are left out of the fold, logged, and removed with the rest of
the engine's ledger: the manifest of their run was never written and never will be, and
a prefix names one engine at a time in a manifest directory (its ``manifest.json`` is per
prefix too), so another run's segments there are taken to be a dead run's.

Each graph also lists the snapshot bundles the run's processes have named so far, and with
input snapshots on the emit marks the manifest as this run's, so the bundles written later
update it (`snapshot_links`).
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
from msgspec import UnsetType

from vllm_neuron.backends import PRIVATE_FILE, Store, fault_point, is_url, join, open_store
from vllm_neuron.backends.records import Document, RecordCodec
from vllm_neuron.compile.entry.record import ENTRY_RECORD, ENTRY_SCHEMA_VERSION, ENTRY_TAG
from vllm_neuron.compile.tiers.location import get_neuron_compile_cache_dir
from vllm_neuron.compile.toolchains.neuron import parse_hlo_entry_result_shapes
from vllm_neuron.envs import (
    manifest_settings,
    redact_config,
    redact_text,
    run_id,
    snapshot_settings,
)
from vllm_neuron.identity import get_server_prefix

from .fold import FoldedGraph, fold_ledger
from .ledger import LEDGER_DIR
from .pieces import summarize_pieces
from .schema import (
    MANIFEST_FILE,
    GraphEntry,
    Locations,
    Manifest,
    ManifestConfig,
    encode_manifest,
)
from .snapshot_links import link_at_emit, mark_emitted

logger = logging.getLogger("vllm_neuron.manifest")


@functools.lru_cache(maxsize=1)
def environment_snapshot() -> dict[str, str]:
    """Installed package versions (a pip-freeze) plus the Python version."""
    versions: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            versions[str(name).lower()] = str(dist.version)
    return {"python": platform.python_version(), **dict(sorted(versions.items()))}


def redacted_config(config: ManifestConfig) -> ManifestConfig:
    """``config`` with every secret redacted (`vllm_neuron.envs.secrets`): vLLM's resolved
    config carries ``hf_token`` and whatever the user put in ``model_loader_extra_config``
    or a connector's extra config, and a manifest is copied around a fleet."""
    return msgspec.convert(redact_config(msgspec.to_builtins(config)), ManifestConfig)


def redacted_environment(environment: Mapping[str, str]) -> dict[str, str]:
    """The manifest's ``environment`` with secret values redacted. Its keys are
    distribution names, not variables, so they are not judged by name (``google-auth``
    keeps its version); every value is cleaned as free text (`redact_text`): the value of
    a secret variable of this process, a URL's credentials."""
    return {name: redact_text(value) for name, value in environment.items()}


def _iso(mtime: float) -> str:
    return datetime.fromtimestamp(mtime, tz=timezone.utc).isoformat()


class _ArtifactMeta(msgspec.Struct, gc=False):
    files: list[str] = []
    output_shapes: list[str] = []
    hlo_file: str | None = None


class _EntryView(Document, frozen=True, kw_only=True, gc=False):
    """What enrichment reads of a cache entry's record (the rest is skipped, not built):
    a view of the same document as `EntryRecord`, so it shares its tag and version."""

    record_tag = ENTRY_TAG
    version_field = "schema"
    missing_version = ENTRY_SCHEMA_VERSION

    schema: int = ENTRY_SCHEMA_VERSION
    meta: _ArtifactMeta = msgspec.field(default_factory=_ArtifactMeta)


_ENTRY_VIEW = RecordCodec(_EntryView)


def bare_entry(key: str, graph: FoldedGraph) -> GraphEntry:
    """A graph entry from the ledger alone (no cache to enrich it from)."""
    return GraphEntry(
        graph_hash=key,
        input_shapes=graph.input_shapes,
        compiler_flags=graph.compiler_flags,
        ranks=graph.ranks,
        pieces=graph.pieces or msgspec.UNSET,
    )


def enrich(key: str, graph: FoldedGraph, cache: Store | None) -> GraphEntry:
    """A graph entry, with paths, size, timestamp and output shapes from its cache entry.

    Read through the compile cache's store: one read of the record, one `info` of the
    artifact (its size and compile time), and the HLO when the toolchain kept one.
    """
    if cache is None:
        return bare_entry(key, graph)
    found = cache.read_published(key, ENTRY_RECORD)
    if found is None:
        raise FileNotFoundError(f"the compile cache {cache.url} has no entry {key}")
    prefix, record = found
    if record is None:
        raise FileNotFoundError(f"compile cache entry {cache.url}/{key} has no {ENTRY_RECORD}")
    meta = _ENTRY_VIEW.decode(record, source=f"{cache.url}/{key}/{ENTRY_RECORD}").meta
    if not meta.files:
        raise ValueError(f"compile cache entry {cache.url}/{key} names no artifact")
    artifact = meta.files[0]
    neff_path = f"{prefix}/{artifact}"  # a key: `info` refuses a bad one
    info = cache.info(neff_path)  # the one stat: size and compile time
    if info is None:
        raise FileNotFoundError(f"compile cache entry {cache.url}/{key} has no {artifact}")
    hlo_file = meta.hlo_file
    output_shapes = meta.output_shapes
    if hlo_file:
        hlo = cache.read(join(prefix, hlo_file))
        if hlo is None:
            raise FileNotFoundError(f"compile cache entry {cache.url}/{key} has no {hlo_file}")
        output_shapes = parse_hlo_entry_result_shapes(hlo.decode("utf-8", errors="replace"))
    return GraphEntry(
        graph_hash=key,
        hlo_path=join(prefix, hlo_file) if hlo_file else None,
        neff_path=neff_path,
        neff_size=info.size,
        created_timestamp=_iso(info.mtime),
        input_shapes=graph.input_shapes,
        output_shapes=output_shapes,
        compiler_flags=graph.compiler_flags,
        ranks=graph.ranks,
        pieces=graph.pieces or msgspec.UNSET,
    )


def _open_cache(cache_root: str | None) -> Store | None:
    """The compile cache to enrich from, opened to read only (None: enrich nothing)."""
    return None if cache_root is None else open_store(cache_root, create=False)


def emit_manifest(
    manifest_dir: str | Store,
    config: ManifestConfig,
    *,
    cache_root: str | None,
    prefix: str | None = None,
    tp_ranks: Sequence[int] | None = None,
    environment: Mapping[str, str] | None = None,
    cleanup: bool = True,
    run: str | None = None,
    link_snapshots: bool = False,
    snapshot_root: str | None = None,
) -> Manifest:
    """Build, write and return this engine's manifest (raises on failure).

    ``cache_root`` (the local compile cache) and ``snapshot_root`` (where bundles are
    written, when capture is on) are recorded as the manifest's ``locations``.

    ``run`` is the engine run whose ledger is folded (default: this process's run);
    ``cleanup`` removes the whole ledger of the prefix afterwards, other runs' included.
    Each graph lists the snapshot bundles the run's processes named so far
    (`snapshot_links`); ``link_snapshots`` (input snapshots are on) also lets the bundles
    written from now on update the manifest.
    """
    store = manifest_dir if isinstance(manifest_dir, Store) else open_store(manifest_dir)
    prefix = prefix or get_server_prefix()
    run = run_id() if run is None else run
    fold = fold_ledger(store, prefix, tp_ranks, run=run)
    if fold.stale:
        logger.warning(
            "manifest: left out %d ledger segment(s) of %s written by other runs that never "
            "emitted (an earlier server stopped before warm-up ended?)%s: %s",
            len(fold.stale),
            prefix,
            ", removed" if cleanup else "",
            ", ".join(fold.stale[:3]),
        )
    if fold.skipped:
        logger.warning(
            "manifest: skipped %d undecodable ledger line(s) for %s (%s)",
            fold.skipped,
            prefix,
            "; ".join(fold.errors[:3]),
        )
    graphs = fold.graphs()
    if undetailed := [key for key, graph in graphs.items() if not graph.has_details]:
        logger.warning(
            "manifest: %d graph(s) of %s have no ledger line with readable shapes "
            "and flags (listed without them): %s",
            len(undetailed),
            prefix,
            ", ".join(sorted(undetailed)[:3]),
        )
    enriched = []
    problems = []
    cache: Store | None = None
    cache_error: Exception | None = None
    try:
        cache = _open_cache(cache_root)
    except Exception as exc:  # noqa: BLE001 - a manifest without enrichment beats none
        cache_error = exc
    for key in sorted(graphs):
        graph = graphs[key]
        try:
            if cache_error is not None:
                raise OSError(f"cannot open the compile cache: {cache_error}")
            enriched.append(enrich(key, graph, cache))
        except Exception as exc:  # noqa: BLE001 - one bad entry must not lose the others
            problems.append(f"{key}: {exc}")
            enriched.append(bare_entry(key, graph))
    if problems:
        logger.warning(
            "manifest: could not enrich %d graph(s) from the compile cache %s: %s",
            len(problems),
            cache_root,
            "; ".join(problems[:3]),
        )
    manifest = Manifest(
        config=redacted_config(config),
        graphs=enriched,
        environment=redacted_environment(
            environment if environment is not None else environment_snapshot()
        ),
        pieces=summarize_pieces(enriched) or msgspec.UNSET,
        locations=_locations(cache_root, snapshot_root),
    )
    manifest, links = link_at_emit(store, prefix, run, manifest, cleanup=cleanup)
    fault_point("emit.before-write")
    # Its config and environment (redacted) are for this user only.
    store.write(join(prefix, MANIFEST_FILE), encode_manifest(manifest), mode=PRIVATE_FILE)
    fault_point("emit.after-write")
    if link_snapshots:
        manifest = mark_emitted(store, prefix, run, manifest, links)
    if cleanup:
        store.delete_tree(join(LEDGER_DIR, prefix))
    return manifest


def _locations(cache_root: str | None, snapshot_root: str | None) -> Locations | UnsetType:
    """The manifest's ``locations``: each local path made absolute (a manifest is read from
    elsewhere), a URL kept with any credentials redacted; UNSET when neither is known."""

    def where(path: str | None) -> str | None:
        if not path:
            return None
        return redact_text(path) if is_url(path) else os.path.abspath(path)

    found = Locations(snapshot_root=where(snapshot_root), compile_cache=where(cache_root))
    return found if found != Locations() else msgspec.UNSET


_emit_warned = False


def emit_manifest_best_effort(
    manifest_dir: str | Store, config: ManifestConfig, **kwargs: Any
) -> Manifest | None:
    """`emit_manifest`, logged once and swallowed on failure (it never breaks warm-up)."""
    global _emit_warned
    try:
        return emit_manifest(manifest_dir, config, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the manifest never breaks warm-up
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
    settings = manifest_settings()
    if settings.manifest_dir is None:
        return None
    return emit_manifest_best_effort(
        settings.manifest_dir,
        config,
        cache_root=get_neuron_compile_cache_dir(),
        tp_ranks=tp_ranks,
        link_snapshots=_capture_on(),
        snapshot_root=_snapshot_root(),
    )


def _capture_on() -> bool:
    """Whether input snapshots are on in this engine (its bundles then name themselves in
    the manifest: `snapshot_links`)."""
    try:
        return snapshot_settings().enabled
    except Exception:  # noqa: BLE001 - a malformed setting stopped start-up already
        return False


def _snapshot_root() -> str | None:
    """This engine's snapshot root when capture is on (the manifest's ``locations``)."""
    try:
        settings = snapshot_settings()
    except Exception:  # noqa: BLE001 - a malformed setting stopped start-up already
        return None
    return settings.root if settings.enabled else None
