"""Property: any interleaving of ledger lines from N writers over K keys folds to one graph
per key with exactly the union of the mapped global ranks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_neuron.backends import open_store
from vllm_neuron.manifest import LedgerWriter, ManifestConfig, emit_manifest

KEYS = [f"{i:032x}" for i in range(6)]


@st.composite
def ledgers(draw: st.DrawFn) -> tuple[int, list[int], list[tuple[int, int]]]:
    writers = draw(st.integers(1, 5))
    # writer w is TP-local rank w of a TP group whose global ranks are tp_ranks[w]
    tp_ranks = draw(st.permutations(list(range(10, 10 + writers))))
    lines = draw(st.lists(st.tuples(st.integers(0, writers - 1), st.integers(0, len(KEYS) - 1)),
                          max_size=40))
    return writers, list(tp_ranks), lines


@settings(max_examples=60, deadline=None)
@given(ledgers())
def test_emit_groups_by_key_with_the_union_of_mapped_ranks(case):
    writers, tp_ranks, lines = case
    store = open_store("memory://")
    logs = [store.log("ledger/nodev", writer=f"w{w}", truncate_first=True) for w in range(writers)]
    from vllm_neuron.manifest.ledger import LedgerEntry

    expected: dict[str, set[int]] = {}
    for writer, key_index in lines:
        key = KEYS[key_index]
        logs[writer].append(LedgerEntry(key=key, rank=writer, input_shapes=[], compiler_flags=""))
        expected.setdefault(key, set()).add(tp_ranks[writer])
    manifest = emit_manifest(store, ManifestConfig(), cache_root=None, prefix="nodev",
                             tp_ranks=tp_ranks, environment={})
    assert {g.graph_hash: set(g.ranks) for g in manifest.graphs} == expected
    assert len(manifest.graphs) == len(expected)
    assert all(g.ranks == sorted(g.ranks) for g in manifest.graphs)
    assert store.list("ledger/nodev") == []


def test_global_rank_recorded_by_the_writer_wins_over_the_tp_mapping():
    store = open_store("memory://")
    LedgerWriter(store).record(KEYS[0], rank=0, global_rank=5, input_shapes=[], compiler_flags="")
    manifest = emit_manifest(store, ManifestConfig(), cache_root=None, prefix="nodev",
                             tp_ranks=[9], environment={})
    assert manifest.graphs[0].ranks == [5]
