"""Manifest files written before the record layer was unified still read.

The files under ``data/records/`` were written by the code of commit 6d14dc9 (a
``manifest.json`` and a ledger segment) and are never regenerated.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from vllm_neuron.backends import RecordCodec
from vllm_neuron.manifest.inspect import load_manifest
from vllm_neuron.manifest.ledger import LedgerEntry
from vllm_neuron.manifest.pieces import completeness_gaps
from vllm_neuron.manifest.schema import decode_manifest

DATA = Path(__file__).parent / "data" / "records"
KEY = "0123456789abcdef0123456789abcdef"


def test_an_old_manifest_reads() -> None:
    manifest = decode_manifest((DATA / "manifest.json").read_bytes())
    assert manifest.manifest_version == "1"
    assert manifest.config.topology.tensor_parallel_size == 2
    first, second = manifest.graphs
    assert (first.graph_hash, first.neff_size, first.ranks) == (KEY, 240, [0, 1])
    assert (second.hlo_path, second.ranks) == (None, [0])
    where, loaded = load_manifest(str(DATA / "manifest.json"))
    assert loaded == manifest and where.endswith("manifest.json")
    # Written before pieces: no graph names one, so each is judged by itself.
    assert manifest.pieces is msgspec.UNSET and all(not g.traces for g in manifest.graphs)
    assert [gap.message() for gap in completeness_gaps(manifest)] == [
        f"graph {second.graph_hash} was traced by 1 of 2 ranks (missing ranks [1]): "
        "partial deployment"]


def test_an_old_ledger_segment_decodes() -> None:
    decoded = RecordCodec([LedgerEntry]).decode_lines((DATA / "ledger-segment.jsonl").read_bytes())
    assert decoded.skipped == 0
    first, second = decoded.records
    assert (first.key, first.rank, first.global_rank) == (KEY, 0, None)
    assert (second.rank, second.global_rank, second.input_shapes) == (1, 3, ["1,"])
    assert first.piece is None and second.piece is None  # written before pieces
