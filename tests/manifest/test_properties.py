"""Property: any interleaving of ledger lines from N writers over K keys folds to one graph
per key with exactly the union of the mapped global ranks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_neuron.backends import open_store
from vllm_neuron.manifest import LedgerWriter, ManifestConfig, emit_manifest

KEYS = [f"{i:032x}" for i in range(6)]


@st.composite
def ledgers(draw: st.DrawFn) -> tuple[int, list[int], list[tuple[int, int, int, int | None, int]]]:
    writers = draw(st.integers(1, 5))
    # TP-local rank r maps to global rank tp_ranks[r]
    tp_ranks = draw(st.permutations(list(range(10, 10 + writers))))
    # (writer, key, TP-local rank, global rank recorded by the writer or None, shapes):
    # a writer usually keeps one rank, but the fold must not depend on it.
    line = st.tuples(st.integers(0, writers - 1), st.integers(0, len(KEYS) - 1),
                     st.integers(0, writers - 1), st.none() | st.integers(0, 30),
                     st.integers(0, 2))
    uniform = draw(st.booleans())
    lines = draw(st.lists(line, max_size=40))
    if uniform:  # every writer w writes as TP rank w (the common deployment)
        lines = [(w, k, w, None, s) for w, k, _, _, s in lines]
    return writers, list(tp_ranks), lines


@settings(max_examples=120, deadline=None)
@given(ledgers())
def test_emit_groups_by_key_with_the_union_of_mapped_ranks(case):
    writers, tp_ranks, lines = case
    from vllm_neuron.envs import run_id
    from vllm_neuron.manifest.ledger import LedgerEntry, ledger_stream

    store = open_store("memory://")
    stream = ledger_stream("nodev", run_id())
    logs = [store.log(stream, writer=f"w{w}", truncate_first=True) for w in range(writers)]

    expected: dict[str, set[int]] = {}
    for writer, key_index, rank, global_rank, shapes in lines:
        key = KEYS[key_index]
        logs[writer].append(LedgerEntry(key=key, rank=rank, global_rank=global_rank,
                                        input_shapes=[f"{shapes},"], compiler_flags=f"-O{shapes}"))
        expected.setdefault(key, set()).add(tp_ranks[rank] if global_rank is None else global_rank)
    # A key's details come from its first line: segment (writer) order, then line order.
    first: dict[str, int] = {}
    for _writer, key_index, _, _, shapes in sorted(lines, key=lambda line: line[0]):
        first.setdefault(KEYS[key_index], shapes)
    manifest = emit_manifest(store, ManifestConfig(), cache_root=None, prefix="nodev",
                             tp_ranks=tp_ranks, environment={})
    assert {g.graph_hash: set(g.ranks) for g in manifest.graphs} == expected
    assert len(manifest.graphs) == len(expected)
    assert all(g.ranks == sorted(g.ranks) for g in manifest.graphs)
    assert {g.graph_hash: (g.input_shapes, g.compiler_flags) for g in manifest.graphs} == {
        key: ([f"{shapes},"], f"-O{shapes}") for key, shapes in first.items()}
    assert store.list("ledger/nodev") == []


def test_global_rank_recorded_by_the_writer_wins_over_the_tp_mapping():
    store = open_store("memory://")
    LedgerWriter(store).record(KEYS[0], rank=0, global_rank=5, input_shapes=[], compiler_flags="")
    manifest = emit_manifest(store, ManifestConfig(), cache_root=None, prefix="nodev",
                             tp_ranks=[9], environment={})
    assert manifest.graphs[0].ranks == [5]
