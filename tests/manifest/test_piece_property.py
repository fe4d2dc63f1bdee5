"""Property: for any assignment of pieces, variants and ranks, the manifest's completeness
verdict (ledger -> fold -> emit -> `completeness_gaps`) equals a naive oracle over the
ledger lines themselves."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from vllm_neuron.backends import open_store
from vllm_neuron.envs import run_id
from vllm_neuron.manifest import ManifestConfig, Topology, emit_manifest
from vllm_neuron.manifest.ledger import LedgerEntry, ledger_stream
from vllm_neuron.manifest.pieces import completeness_gaps
from vllm_neuron.manifest.schema import Piece

HASHES = [f"{i:032x}" for i in range(4)]
PIECES = [Piece(model="backbone", start=1, end=2048, subgraph=i) for i in (0, 2)] + [
    Piece(start=1, end=8, subgraph=0)
]

Line = tuple[int, int, int | None, int]  # (writer, rank, piece index or None, hash index)


@st.composite
def deployments(draw: st.DrawFn) -> tuple[int, list[Line]]:
    world = draw(st.integers(1, 4))
    writers = draw(st.integers(1, world + 1))
    # A rank may fall outside the world (the rule counts distinct ranks, see the oracle);
    # a writer usually writes one rank, but the verdict must not depend on it.
    line = st.tuples(st.integers(0, writers - 1), st.integers(0, world),
                     st.none() | st.integers(0, len(PIECES) - 1),
                     st.integers(0, len(HASHES) - 1))
    return world, draw(st.lists(line, max_size=30))


def oracle(world: int, lines: list[Line]) -> set[tuple[str, str, tuple[int, ...],
                                                       tuple[int, ...], int]]:
    """The rule, written plainly over the ledger lines. A piece is partial when fewer than
    `world` distinct ranks traced any of its variants; a graph is judged by itself only when
    no line names a piece for it, and is partial when fewer than `world` ranks traced it.
    Missing ranks are those of 0..world-1 not among the tracers."""
    gaps = set()
    for p, piece in enumerate(PIECES):
        tracers = set()
        variants = set()
        for _writer, rank, piece_index, hash_index in lines:
            if piece_index == p:
                tracers.add(rank)
                variants.add(hash_index)
        if variants and len(tracers) < world:
            missing = tuple(r for r in range(world) if r not in tracers)
            gaps.add(("piece", piece.label(), tuple(sorted(tracers)), missing, len(variants)))
    for h, key in enumerate(HASHES):
        named_lines = [line for line in lines if line[3] == h]
        if not named_lines or any(line[2] is not None for line in named_lines):
            continue
        tracers = {rank for _writer, rank, _piece, _hash in named_lines}
        if len(tracers) < world:
            missing = tuple(r for r in range(world) if r not in tracers)
            gaps.add(("graph", key, tuple(sorted(tracers)), missing, 1))
    return gaps


@settings(max_examples=examples(ci=300))
@given(deployments())
def test_completeness_per_piece_equals_the_naive_oracle(case: tuple[int, list[Line]]) -> None:
    world, lines = case
    store = open_store("memory://")
    stream = ledger_stream("nodev", run_id())
    logs = {}
    for writer, rank, piece_index, hash_index in lines:
        log = logs.get(writer)
        if log is None:
            log = logs[writer] = store.log(stream, writer=f"w{writer}", truncate_first=True)
        log.append(LedgerEntry(
            key=HASHES[hash_index], rank=rank, global_rank=rank, input_shapes=[],
            compiler_flags="", piece=None if piece_index is None else PIECES[piece_index]))
    manifest = emit_manifest(
        store, ManifestConfig(topology=Topology(world_size=world)), cache_root=None,
        prefix="nodev", environment={})
    got = {(g.kind, g.name, tuple(g.traced), tuple(g.missing), g.variants)
           for g in completeness_gaps(manifest)}
    assert got == oracle(world, lines)
    # The summary counts each piece's compiles: the distinct graphs traced as it.
    summary = {s.piece: s.compiles for s in manifest.pieces or []}
    assert summary == {
        piece: len({h for _w, _r, p, h in lines if p == i})
        for i, piece in enumerate(PIECES) if any(p == i for _w, _r, p, _h in lines)
    }
