"""The manifest schema, version "1" (docs/manifest.md).

Field names, order and nesting are the documented format, so `Manifest` is a `Document` of
the record layer: nothing is added on disk, and its version stays in ``manifest_version``.
A reader decodes with `decode_manifest`, which refuses any other ``manifest_version`` (or
one that is missing) with an error naming the file, rather than misreading it; a later
version is read by registering an upcaster for ``MANIFEST_TAG``.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from vllm_neuron.backends.records import Document, RecordCodec, RecordError, encode_document

MANIFEST_VERSION = "1"
MANIFEST_FILE = "manifest.json"
MANIFEST_TAG = "manifest"  # the upcaster registry's name for this document


class Topology(msgspec.Struct, frozen=True, kw_only=True):
    world_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    attention_dp_size: int = 1
    ep_degree: int = 1
    decode_context_parallel_size: int = 1
    has_collectives: bool = False


class ManifestConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str = ""
    target: str = ""
    dtype: str = ""
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    topology: Topology = msgspec.field(default_factory=Topology)
    neuron_config: dict[str, Any] = msgspec.field(default_factory=dict)
    vllm_config: dict[str, Any] = msgspec.field(default_factory=dict)


class Piece(msgspec.Struct, frozen=True, kw_only=True, order=True, omit_defaults=True, gc=False):
    """Which piece of the model a graph is, as vLLM names it: the compile range and the
    subgraph index (plus vLLM's model tag, so a drafter's subgraph 0 is not the backbone's).

    The identity is the same on every rank, while the graph (its hash) need not be: vLLM's
    vocab-parallel embedding bakes each rank's vocabulary range into the first piece. So
    completeness is judged per piece (docs/manifest.md), and a graph hash alone cannot say
    that two ranks traced the same part of the model. Hashable and ordered: it groups and
    sorts pieces.
    """

    model: str = ""
    start: int
    end: int
    subgraph: int

    def label(self) -> str:
        """How the command line names the piece: ``[backbone] range 1-2048 subgraph 0``."""
        tag = f"[{self.model}] " if self.model else ""
        return f"{tag}range {self.start}-{self.end} subgraph {self.subgraph}"


class PieceTrace(msgspec.Struct, frozen=True, kw_only=True):
    """One piece a graph is, and the global ranks that traced the graph as that piece.

    Per piece, not per graph, because one graph can be several pieces (identical decoder
    layers hash alike) and a rank may trace it as one of them only.
    """

    piece: Piece
    ranks: list[int] = msgspec.field(default_factory=list)


class PieceVariant(msgspec.Struct, frozen=True, kw_only=True):
    """One graph of a piece; ``rank_specific`` when fewer ranks traced it than the piece."""

    graph_hash: str
    ranks: list[int] = msgspec.field(default_factory=list)
    rank_specific: bool = False


class PieceSummary(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of the model and its variants: ``compiles`` is how many graphs it took (1
    unless the graph differs by rank; tensor parallelism's extra cost is ``compiles - 1``)."""

    piece: Piece
    compiles: int
    ranks: list[int] = msgspec.field(default_factory=list)
    variants: list[PieceVariant] = msgspec.field(default_factory=list)


class GraphEntry(msgspec.Struct, frozen=True, kw_only=True):
    graph_hash: str
    hlo_path: str | None = None
    neff_path: str | None = None
    neff_size: int | None = None
    created_timestamp: str | None = None
    input_shapes: list[str] = msgspec.field(default_factory=list)
    output_shapes: list[str] = msgspec.field(default_factory=list)
    compiler_flags: str = ""
    ranks: list[int] = msgspec.field(default_factory=list)
    input_snapshot_paths: list[str] = msgspec.field(default_factory=list)
    output_snapshot_paths: list[str] = msgspec.field(default_factory=list)
    # Absent (not written) for a graph no ledger line named a piece of; see `traces`.
    pieces: list[PieceTrace] | UnsetType = UNSET

    @property
    def traces(self) -> list[PieceTrace]:
        """The pieces this graph is, with their ranks (empty when none was recorded)."""
        return [] if self.pieces is UNSET else self.pieces


class Locations(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Where the run's artifacts were, as the engine saw them: its snapshot root (a path or
    URL; absent when capture was off) and its local compile cache (a path). Why: a replay or
    a check given only the manifest finds the bundles and the entries without being told
    again (each still overridden by ``--root`` / ``--cache-dir``)."""

    snapshot_root: str | None = None
    compile_cache: str | None = None


class Manifest(Document, frozen=True, kw_only=True):
    record_tag = MANIFEST_TAG
    version_field = "manifest_version"

    manifest_version: str = MANIFEST_VERSION
    config: ManifestConfig = msgspec.field(default_factory=ManifestConfig)
    graphs: list[GraphEntry] = msgspec.field(default_factory=list)
    environment: dict[str, str] = msgspec.field(default_factory=dict)
    # Per piece, its variants and compiles; absent when no graph names a piece.
    pieces: list[PieceSummary] | UnsetType = UNSET
    # Where the snapshots and the compile cache were; absent in manifests written before.
    locations: Locations | UnsetType = UNSET


ManifestError = RecordError
"""A manifest file that cannot be read as this schema: the record layer's one error."""

_MANIFESTS = RecordCodec(Manifest)


def encode_manifest(manifest: Manifest, *, indent: int = 2) -> bytes:
    return encode_document(manifest, indent=indent)


def decode_manifest(data: bytes, *, source: str = "manifest") -> Manifest:
    """`data` as this schema, or `ManifestError` naming `source` (the file) and why."""
    return _MANIFESTS.decode(data, source=source)
