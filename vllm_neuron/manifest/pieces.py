"""Pieces of the model and their variants: the per-piece view, completeness, and diffs.

A piece is what vLLM compiles: one compile range's subgraph (`Piece`). Under tensor
parallelism a piece need not be one graph: vLLM's vocab-parallel embedding bakes each rank's
vocabulary range into the first piece, so that piece compiles to a different graph (hash)
on every rank. "Every rank traced every graph" then fails every complete TP deployment;
the question a deployment asks is whether every rank traced *some variant of every piece*.
Graphs that name no piece (manifests written before pieces were recorded, a plain
``torch.compile`` outside vLLM) keep the per-graph rule: every rank traced the graph.

Everything here is computed from the graph entries (``graphs[].pieces``), the manifest's
source of truth; the top-level ``pieces`` summary is what `summarize_pieces` wrote at emit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from .schema import GraphEntry, Manifest, Piece, PieceSummary, PieceVariant


def piece_variants(graphs: Iterable[GraphEntry]) -> dict[Piece, dict[str, list[int]]]:
    """Per piece, its variants: graph hash -> sorted global ranks that traced it as the
    piece (a hash listed twice is merged)."""
    merged: dict[Piece, dict[str, set[int]]] = {}
    for graph in graphs:
        for trace in graph.traces:
            merged.setdefault(trace.piece, {}).setdefault(graph.graph_hash, set()).update(
                trace.ranks
            )
    return {
        piece: {key: sorted(ranks) for key, ranks in sorted(variants.items())}
        for piece, variants in sorted(merged.items())
    }


def summarize_pieces(graphs: Sequence[GraphEntry]) -> list[PieceSummary]:
    """The manifest's per-piece summary: each piece's variants, which of them are
    rank-specific (traced by fewer ranks than the piece), and how many compiles it took."""
    out = []
    for piece, variants in piece_variants(graphs).items():
        union = sorted({rank for ranks in variants.values() for rank in ranks})
        out.append(PieceSummary(
            piece=piece,
            compiles=len(variants),
            ranks=union,
            variants=[PieceVariant(graph_hash=key, ranks=ranks, rank_specific=ranks != union)
                      for key, ranks in variants.items()],
        ))
    return out


def extra_compiles(summaries: Iterable[PieceSummary]) -> int:
    """What rank-specific graphs cost: compiles beyond one per piece."""
    return sum(summary.compiles - 1 for summary in summaries)


@dataclass(frozen=True)
class Gap:
    """A piece (or a graph naming no piece) that fewer ranks than the world traced."""

    kind: str  # "piece" or "graph"
    name: str  # the piece's label, or the graph's hash
    traced: list[int]
    missing: list[int]
    world: int
    variants: int = 1

    def message(self) -> str:
        count = f"{len(self.traced)} of {self.world} ranks"
        if self.kind == "piece":
            count += f" across its {self.variants} variant(s)"
        return (f"{self.kind} {self.name} was traced by {count} "
                f"(missing ranks {self.missing}): partial deployment")


def _gap(kind: str, name: str, ranks: set[int], world: int, variants: int = 1) -> Gap | None:
    """A gap when fewer than `world` distinct ranks traced it (the rule predating pieces:
    a count, so an engine whose global ranks do not start at 0 is not judged partial)."""
    if len(ranks) >= world:
        return None
    missing = sorted(set(range(world)) - ranks)
    return Gap(kind, name, sorted(ranks), missing, world, variants)


def completeness_gaps(manifest: Manifest) -> list[Gap]:
    """Every piece some rank did not trace in any variant, then every graph naming no piece
    that some rank did not trace; empty for a complete deployment."""
    world = manifest.config.topology.world_size
    gaps = []
    for piece, variants in piece_variants(manifest.graphs).items():
        union = {rank for ranks in variants.values() for rank in ranks}
        gap = _gap("piece", piece.label(), union, world, len(variants))
        if gap is not None:
            gaps.append(gap)
    for graph in manifest.graphs:
        if not graph.traces:
            gap = _gap("graph", graph.graph_hash, set(graph.ranks), world)
            if gap is not None:
                gaps.append(gap)
    return gaps


@dataclass(frozen=True)
class PieceChange:
    """How one piece differs between two manifests: variants (graph hashes) only in the
    second (``added``), only in the first (``removed``), and in both with fields that
    differ (``changed``: hash -> field names; ``ranks`` when the ranks that traced the
    variant as this piece differ)."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: dict[str, list[str]] = field(default_factory=dict)


def graph_fields_changed(a: GraphEntry, b: GraphEntry) -> list[str]:
    """Names of the fields of a graph entry that differ (its pieces are compared apart)."""
    da, db = msgspec.structs.asdict(a), msgspec.structs.asdict(b)
    return [name for name in da if name != "pieces" and da[name] != db[name]]


def diff_pieces(
    a: Sequence[GraphEntry], b: Sequence[GraphEntry]
) -> tuple[list[str], list[str], dict[str, PieceChange]]:
    """(pieces only in `b`, pieces only in `a`, pieces in both that differ), by label."""
    va, vb = piece_variants(a), piece_variants(b)
    ga = {g.graph_hash: g for g in a}
    gb = {g.graph_hash: g for g in b}
    changed = {}
    for piece in sorted(set(va) & set(vb)):
        old, new = va[piece], vb[piece]
        both: dict[str, list[str]] = {}
        for key in sorted(set(old) & set(new)):
            fields = graph_fields_changed(ga[key], gb[key])
            if old[key] != new[key] and "ranks" not in fields:
                fields.append("ranks")
            if fields:
                both[key] = fields
        change = PieceChange(added=sorted(set(new) - set(old)),
                             removed=sorted(set(old) - set(new)), changed=both)
        if change.added or change.removed or change.changed:
            changed[piece.label()] = change
    return ([p.label() for p in sorted(set(vb) - set(va))],
            [p.label() for p in sorted(set(va) - set(vb))], changed)
