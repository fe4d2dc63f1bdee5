"""The compile-artifact manifest: a per-process ledger at compile time, one manifest per
engine after warm-up (docs/manifest.md)."""

from .emit import emit_for_this_engine, emit_manifest, emit_manifest_best_effort
from .ledger import LedgerEntry, LedgerWriter
from .schema import GraphEntry, Manifest, ManifestConfig, Piece, Topology, decode_manifest

__all__ = [
    "GraphEntry",
    "LedgerEntry",
    "LedgerWriter",
    "Manifest",
    "ManifestConfig",
    "Piece",
    "Topology",
    "decode_manifest",
    "emit_for_this_engine",
    "emit_manifest",
    "emit_manifest_best_effort",
]
