"""Graphs know their snapshots: each graph of the manifest names the bundles captured for it.

Why a second ledger: the manifest is emitted once, after warm-up, by ``local_rank == 0``;
input snapshots are written later, at call time, by every rank. So the emit cannot see
them, and no single process can. Each process that writes a bundle appends one line
(`SnapshotLink`: the graph's key, the bundle's rank and call, where it is, whether it holds
outputs) to its own segment, and the manifest is filled from the run's lines:

    snapshot-links/<prefix>/<run>/<pid>.jsonl   one segment per process of the run
    snapshot-links/<prefix>/<run>/emitted       written by this run's emit, after manifest.json

- the emit fills each graph's ``input_snapshot_paths``/``output_snapshot_paths`` from the
  run's lines so far, writes ``manifest.json``, then the ``emitted`` marker (when capture is
  on), and removes the lines of every other run under the prefix;
- a process that appends a line once the marker is there rewrites ``manifest.json`` with
  every line of the run (`refresh_manifest`); before it, the emit will read the line.

Concurrent rewrites (two ranks capturing the same forward) are made safe by a re-read: after
its write a writer reads the run's lines again and writes again if a line appeared that its
manifest does not hold. Lines are only ever added, so the last writer's manifest holds every
line appended before its re-read, and a line appended after that is written by its own
appender, whose rewrite comes later. Filling is a union (a path already in the manifest is
never dropped), in (rank, call) order. The marker is what says ``manifest.json`` is this
run's: without it, an earlier run's manifest at the prefix is left alone.

A path is the bundle's call directory (``<hash>/rank<N>/call<K>``) relative to the snapshot
root, or its full URL when the root is a URL (``s3://bucket/snaps/<hash>/rank0/call3``).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable, Sequence

import msgspec

from vllm_neuron.backends import (
    PRIVATE_FILE,
    EventLog,
    Record,
    RecordCodec,
    Store,
    is_url,
    join,
    open_store,
)
from vllm_neuron.envs import run_id
from vllm_neuron.identity import get_server_prefix

from .schema import MANIFEST_FILE, GraphEntry, Manifest, decode_manifest, encode_manifest

__all__ = ["LINKS_DIR", "SnapshotLink", "SnapshotLinker", "bundle_path", "fill_snapshot_paths",
           "link_at_emit", "links_stream", "mark_emitted", "read_links", "refresh_manifest"]

logger = logging.getLogger("vllm_neuron.manifest")

LINKS_DIR = "snapshot-links"
EMITTED = "emitted"
SEGMENT_SUFFIX = ".jsonl"
_ROUNDS = 8  # rewrites one refresh may do while other ranks keep adding lines
_RANK_CALL = re.compile(r"rank(\d+)/call(\d+)/*$")


class SnapshotLink(Record, frozen=True, tag="snapshot-link", omit_defaults=True):
    """One bundle written for graph ``key``: its call directory (``path``, see the module
    docstring), global rank and call index, and whether it holds the call's outputs."""

    key: str
    path: str
    global_rank: int
    call_index: int
    outputs: bool = True


_LINKS = RecordCodec([SnapshotLink])


def links_stream(prefix: str, run: str) -> str:
    return join(LINKS_DIR, prefix, run)


def bundle_path(root: str, call_prefix: str) -> str:
    """How the manifest names a bundle: relative to a local root, a URL under a URL root."""
    return f"{root.rstrip('/')}/{call_prefix}" if is_url(root) else call_prefix


def path_order(path: str) -> tuple[int, int, str]:
    """(rank, call, path): how a graph's paths are sorted (rank 2 before rank 10)."""
    m = _RANK_CALL.search(path)
    return (int(m.group(1)), int(m.group(2)), path) if m else (-1, -1, path)


def read_links(store: Store, prefix: str, run: str) -> list[SnapshotLink]:
    """Every decodable line of run `run` of engine `prefix` (a torn last line is skipped)."""
    out: list[SnapshotLink] = []
    for key in store.list(links_stream(prefix, run)):
        if key.endswith(SEGMENT_SUFFIX):
            data = store.read(key)
            if data:
                out.extend(_LINKS.decode_lines(data).records)
    return out


def _merged(have: Sequence[str], new: Iterable[str]) -> list[str]:
    return sorted(set(have).union(new), key=path_order)


def fill_snapshot_paths(manifest: Manifest, links: Iterable[SnapshotLink]) -> Manifest:
    """`manifest` with each graph's snapshot paths joined by the paths `links` name for it
    (links of graphs it does not list are left out: compiled after the emit)."""
    inputs: dict[str, list[str]] = {}
    outputs: dict[str, list[str]] = {}
    for link in links:
        inputs.setdefault(link.key, []).append(link.path)
        if link.outputs:
            outputs.setdefault(link.key, []).append(link.path)
    graphs: list[GraphEntry] = []
    for g in manifest.graphs:
        new_in = _merged(g.input_snapshot_paths, inputs.get(g.graph_hash, ()))
        new_out = _merged(g.output_snapshot_paths, outputs.get(g.graph_hash, ()))
        if new_in == g.input_snapshot_paths and new_out == g.output_snapshot_paths:
            graphs.append(g)
        else:
            graphs.append(msgspec.structs.replace(g, input_snapshot_paths=new_in,
                                                  output_snapshot_paths=new_out))
    return msgspec.structs.replace(manifest, graphs=graphs)


def refresh_manifest(store: Store, prefix: str, run: str, *,
                     used: frozenset[SnapshotLink] | None = None) -> Manifest | None:
    """Rewrite ``<prefix>/manifest.json`` until it holds every line of the run (see the
    module docstring); `used` are the lines the caller's own write held. Returns the
    manifest as last read or written, None when it was already complete (or is missing)."""
    key = join(prefix, MANIFEST_FILE)
    manifest = None
    for _ in range(_ROUNDS):
        links = frozenset(read_links(store, prefix, run))
        if links == used:
            break
        data = store.read(key)  # read again each round: another rank may have written
        if data is None:
            return None
        manifest = decode_manifest(data, source=f"{store.url.rstrip('/')}/{key}")
        filled = fill_snapshot_paths(manifest, links)
        if filled != manifest:
            store.write(key, encode_manifest(filled), mode=PRIVATE_FILE)
        manifest, used = filled, links
    return manifest


def link_at_emit(store: Store, prefix: str, run: str, manifest: Manifest, *,
                 cleanup: bool = True) -> tuple[Manifest, frozenset[SnapshotLink]]:
    """The emit's part before it writes: `manifest` filled from this run's lines so far
    (and the lines used); with `cleanup`, every other run's lines under the prefix removed
    (the manifest they were for is being replaced)."""
    if cleanup:
        for name in store.list_dir(join(LINKS_DIR, prefix)):
            if name != run:
                store.delete_tree(join(LINKS_DIR, prefix, name))
    links = frozenset(read_links(store, prefix, run))
    return fill_snapshot_paths(manifest, links), links


def mark_emitted(store: Store, prefix: str, run: str, manifest: Manifest,
                 used: frozenset[SnapshotLink]) -> Manifest:
    """After the emit wrote `manifest` (filled with `used`): the marker, then a refresh for
    the lines appended meanwhile."""
    store.write(join(links_stream(prefix, run), EMITTED), b"")
    return refresh_manifest(store, prefix, run, used=used) or manifest


class SnapshotLinker:
    """What a capturing process calls for each bundle it wrote (best-effort: a failure is
    logged once and never reaches the forward)."""

    def __init__(self, manifest_dir: str | Store, snapshot_root: str) -> None:
        self._target = manifest_dir
        self._store = manifest_dir if isinstance(manifest_dir, Store) else None
        self.snapshot_root = snapshot_root
        self._lock = threading.Lock()
        self._logs: dict[tuple[str, str, int], EventLog] = {}
        self._failed = False

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(str(self._target))
        return self._store

    def record(self, key: str, *, global_rank: int, call_index: int, call_prefix: str,
               outputs: bool) -> bool:
        """Name the bundle at `call_prefix` (under the snapshot root) in this run's lines,
        and in ``manifest.json`` when the run's emit has written it; False if it failed."""
        link = SnapshotLink(key=key, path=bundle_path(self.snapshot_root, call_prefix),
                            global_rank=global_rank, call_index=call_index, outputs=outputs)
        try:
            prefix, run = get_server_prefix(), run_id()
            with self._lock:
                self._append(prefix, run, link)
                if self.store.exists(join(links_stream(prefix, run), EMITTED)):
                    refresh_manifest(self.store, prefix, run)
            return True
        except Exception as exc:  # noqa: BLE001 - a snapshot link never breaks a forward
            if not self._failed:
                self._failed = True
                logger.warning(
                    "manifest: cannot name the snapshot bundle %s in the manifest under %s "
                    "(VLLM_NEURON_MANIFEST_DIR): %s; its graph will not list it",
                    link.path, self._target, exc)
            return False

    def _append(self, prefix: str, run: str, link: SnapshotLink) -> None:
        pid = os.getpid()
        log = self._logs.get((prefix, run, pid))
        if log is None:
            # A leftover segment of the same run and pid (pid reuse) is truncated.
            log = self.store.log(links_stream(prefix, run), writer=str(pid), truncate_first=True)
            self._logs[(prefix, run, pid)] = log
        log.append(link)
