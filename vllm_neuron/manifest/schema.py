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


class Manifest(Document, frozen=True, kw_only=True):
    record_tag = MANIFEST_TAG
    version_field = "manifest_version"

    manifest_version: str = MANIFEST_VERSION
    config: ManifestConfig = msgspec.field(default_factory=ManifestConfig)
    graphs: list[GraphEntry] = msgspec.field(default_factory=list)
    environment: dict[str, str] = msgspec.field(default_factory=dict)


ManifestError = RecordError
"""A manifest file that cannot be read as this schema: the record layer's one error."""

_MANIFESTS = RecordCodec(Manifest)


def encode_manifest(manifest: Manifest, *, indent: int = 2) -> bytes:
    return encode_document(manifest, indent=indent)


def decode_manifest(data: bytes, *, source: str = "manifest") -> Manifest:
    """`data` as this schema, or `ManifestError` naming `source` (the file) and why."""
    return _MANIFESTS.decode(data, source=source)
