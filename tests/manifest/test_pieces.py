"""Pieces under tensor parallelism: a piece whose graph differs per rank is one piece with
rank-specific variants, a complete deployment passes `manifest check`, a missing rank fails
it naming the piece; `show` groups variants, `diff` compares by piece."""

from __future__ import annotations

import json
import os

import msgspec
import pytest
from manifest_fixtures import neuron_like_compile

from vllm_neuron.backends import encode_line, open_store
from vllm_neuron.cli import main
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.manifest import (
    LedgerEntry,
    LedgerWriter,
    Manifest,
    ManifestConfig,
    Topology,
    decode_manifest,
    emit_manifest,
)
from vllm_neuron.manifest.inspect import diff_manifests
from vllm_neuron.manifest.schema import Piece

EMBED = Piece(model="backbone", start=1, end=2048, subgraph=0)
LAYER = Piece(model="backbone", start=1, end=2048, subgraph=2)
HEAD = Piece(model="backbone", start=1, end=2048, subgraph=4)
# vLLM's vocab-parallel embedding: the first piece is a different graph on each rank.
EMBED_RANK = {0: "a0" * 16, 1: "a1" * 16}
SHARED = {LAYER: "b0" * 16, HEAD: "c0" * 16}
TP2 = ManifestConfig(model="m", target="trn2",
                     topology=Topology(world_size=2, tensor_parallel_size=2))


@pytest.fixture
def tp_cache(tmp_path) -> str:
    """A compile cache holding every variant, as the two ranks left it."""
    root = os.path.join(str(tmp_path), "compile_cache")
    cache = TwoTierCache(root, toolchain="neuron", target="trn2")
    for key in [*EMBED_RANK.values(), *SHARED.values()]:
        cache.get_or_compile(key, neuron_like_compile(key))
    return root


def record_rank(store, rank: int, *, pieces=(EMBED, LAYER, HEAD), embed=None) -> None:
    """Rank `rank`'s ledger lines for `pieces` (`embed`: the embedding's graph per rank)."""
    writer = LedgerWriter(store)
    for piece in pieces:
        key = (embed or EMBED_RANK)[rank] if piece == EMBED else SHARED[piece]
        assert writer.record(key, rank=rank, global_rank=rank, input_shapes=["s72,"],
                             compiler_flags="--target trn2", piece=piece)


def emit_tp(tmp_path, cache_root: str, ranks=(0, 1), name="m", **kwargs) -> tuple[str, Manifest]:
    store = open_store(str(tmp_path / name))
    for rank in ranks:
        record_rank(store, rank, **kwargs)
    manifest = emit_manifest(store, TP2, cache_root=cache_root, prefix="nodev", environment={})
    return str(tmp_path / name / "nodev"), manifest


def test_a_ledger_line_names_its_piece_and_an_old_line_names_none():
    line = json.loads(encode_line(LedgerEntry(key=SHARED[LAYER], rank=1, input_shapes=[],
                                              compiler_flags="", piece=LAYER)))
    assert line["piece"] == {"model": "backbone", "start": 1, "end": 2048, "subgraph": 2}
    piece_less = json.loads(encode_line(LedgerEntry(key=SHARED[LAYER], rank=1,
                                                    input_shapes=[], compiler_flags="")))
    assert "piece" not in piece_less  # absent, not null: the line predating pieces
    assert Piece(start=1, end=8, subgraph=0).label() == "range 1-8 subgraph 0"
    assert EMBED.label() == "[backbone] range 1-2048 subgraph 0"


def test_the_manifest_groups_a_pieces_rank_specific_variants(tmp_path, tp_cache):
    engine, manifest = emit_tp(tmp_path, tp_cache)
    written = json.loads((tmp_path / "m" / "nodev" / "manifest.json").read_bytes())
    assert list(written) == ["manifest_version", "config", "graphs", "environment", "pieces",
                            "locations"]
    by_hash = {g["graph_hash"]: g for g in written["graphs"]}
    assert by_hash[EMBED_RANK[1]]["pieces"] == [
        {"piece": {"model": "backbone", "start": 1, "end": 2048, "subgraph": 0}, "ranks": [1]}]
    assert by_hash[SHARED[HEAD]]["ranks"] == [0, 1]
    embed, layer, head = written["pieces"]
    assert embed["compiles"] == 2 and embed["ranks"] == [0, 1]
    assert embed["variants"] == [
        {"graph_hash": EMBED_RANK[0], "ranks": [0], "rank_specific": True},
        {"graph_hash": EMBED_RANK[1], "ranks": [1], "rank_specific": True},
    ]
    assert (layer["compiles"], head["compiles"]) == (1, 1)
    assert layer["variants"] == [{"graph_hash": SHARED[LAYER], "ranks": [0, 1],
                                  "rank_specific": False}]
    assert decode_manifest(json.dumps(written).encode()) == manifest


def test_check_passes_on_a_complete_tp_deployment_whose_first_piece_differs_per_rank(
        tmp_path, tp_cache, capsys):
    engine, _ = emit_tp(tmp_path, tp_cache)
    assert main(["manifest", "check", engine, "--cache-dir", tp_cache]) == 0
    out = capsys.readouterr().out
    assert "ok (4 graphs, world size 2), every rank traced all 3 pieces (1 with rank-specific" \
        in out


def test_check_fails_naming_the_piece_and_the_missing_rank(tmp_path, tp_cache, capsys):
    engine, _ = emit_tp(tmp_path, tp_cache, ranks=(0,), name="one-rank")
    assert main(["manifest", "check", engine, "--cache-dir", tp_cache]) == 1
    out = capsys.readouterr().out
    for piece in (EMBED, LAYER, HEAD):
        assert (f"FAIL piece {piece.label()} was traced by 1 of 2 ranks across its 1 "
                "variant(s) (missing ranks [1]): partial deployment") in out
    # Rank 1 traced every piece but the last: only that piece is partial.
    store = open_store(str(tmp_path / "gap"))
    record_rank(store, 0)
    record_rank(store, 1, pieces=(EMBED, LAYER))
    emit_manifest(store, TP2, cache_root=tp_cache, prefix="nodev", environment={})
    assert main(["manifest", "check", str(tmp_path / "gap"), "--cache-dir", tp_cache]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL") == 1 and f"FAIL piece {HEAD.label()} was traced by 1 of 2" in out


def test_graphs_without_pieces_keep_the_per_graph_rule(tmp_path, tp_cache, capsys):
    store = open_store(str(tmp_path / "old"))
    LedgerWriter(store).record(SHARED[LAYER], rank=0, global_rank=0, input_shapes=[],
                               compiler_flags="")
    emit_manifest(store, TP2, cache_root=tp_cache, prefix="nodev", environment={})
    written = json.loads((tmp_path / "old" / "nodev" / "manifest.json").read_bytes())
    assert "pieces" not in written and "pieces" not in written["graphs"][0]
    assert main(["manifest", "check", str(tmp_path / "old"), "--cache-dir", tp_cache]) == 1
    assert f"FAIL graph {SHARED[LAYER]} was traced by 1 of 2 ranks" in capsys.readouterr().out


def test_show_groups_variants_and_marks_the_rank_specific_ones(tmp_path, tp_cache, capsys):
    engine, manifest = emit_tp(tmp_path, tp_cache)
    assert main(["manifest", "show", engine]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    # ... RANKS CREATED BUNDLES: no snapshot was captured, so every graph names 0 bundles.
    embed_rows = [r for r in rows if r and r[-3] in ("0", "1") and "rank-specific" in r]
    assert all(r[-1] == "0" for r in embed_rows)
    assert len(embed_rows) == 2 and out.count(EMBED.label()) == 1
    assert sum("shared" in r for r in rows) == 2
    assert "4 graphs for 3 pieces; 1 pieces rank-specific, costing 1 compiles" in out
    assert main(["manifest", "show", engine, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["pieces"] == msgspec.to_builtins(manifest.pieces)
    # A manifest whose summary was not written (built by hand) shows the same grouping.
    bare = msgspec.structs.replace(manifest, pieces=msgspec.UNSET)
    path = tmp_path / "bare" / "manifest.json"
    path.parent.mkdir()
    path.write_bytes(msgspec.json.encode(bare))
    assert main(["manifest", "show", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pieces"] == shown["pieces"]


def test_diff_compares_by_piece(tmp_path, tp_cache, capsys):
    a_dir, a = emit_tp(tmp_path, tp_cache, name="a")
    # Rank 1's embedding recompiled to a new graph; the rest unchanged.
    old = EMBED_RANK[1]
    b_dir, b = emit_tp(tmp_path, tp_cache, name="b", embed={0: EMBED_RANK[0], 1: "a2" * 16})
    diff = diff_manifests(a, b)
    assert (diff.added, diff.removed, diff.changed) == ([], [], {})
    assert (diff.pieces_added, diff.pieces_removed) == ([], [])
    assert list(diff.pieces_changed) == [EMBED.label()]
    change = diff.pieces_changed[EMBED.label()]
    assert (change.added, change.removed) == (["a2" * 16], [old])
    assert main(["manifest", "diff", a_dir, b_dir]) == 0
    out = capsys.readouterr().out
    assert f"~ piece {EMBED.label()}: + variant {'a2' * 16}" in out
    assert f"~ piece {EMBED.label()}: - variant {old}" in out
    assert len(out.splitlines()) == 2  # no graph-by-hash lines: the pieces say it all
    assert main(["manifest", "diff", a_dir, b_dir, "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert as_json["pieces_changed"][EMBED.label()]["added"] == ["a2" * 16]
    # A rank that traced a shared variant no longer: that variant's ranks changed.
    _, c = emit_tp(tmp_path, tp_cache, name="c", ranks=(0,))
    one = diff_manifests(a, c)
    assert one.pieces_changed[LAYER.label()].changed == {SHARED[LAYER]: ["ranks"]}
    assert one.pieces_changed[EMBED.label()].removed == [old]


def test_diff_falls_back_to_hashes_when_a_manifest_names_no_pieces(tmp_path, tp_cache):
    _, new = emit_tp(tmp_path, tp_cache)
    old = msgspec.structs.replace(
        new, pieces=msgspec.UNSET,
        graphs=[msgspec.structs.replace(g, pieces=msgspec.UNSET) for g in new.graphs])
    diff = diff_manifests(old, new)
    assert diff.pieces_changed == {} and diff.pieces_added == []
    assert diff.added == diff.removed == [] and diff.changed == {}


def _rank_process(manifest_dir: str, rank: int) -> None:
    record_rank(open_store(manifest_dir), rank)


def test_removing_one_ranks_ledger_segment_fails_check_naming_that_rank(tmp_path, tp_cache,
                                                                        capsys):
    """Each rank a real process writing its own ledger segment, as vLLM's workers do; an
    operator (or a lost volume) removes rank 1's segment before the engine folds it."""
    import multiprocessing

    manifest_dir = str(tmp_path / "removed")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_process, args=(manifest_dir, r)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    segments = sorted((tmp_path / "removed" / "ledger").glob("nodev/*/*.jsonl"))
    assert len(segments) == 2  # one per writer process
    by_rank = {json.loads(s.read_text().splitlines()[0])["rank"]: s for s in segments}
    assert sorted(by_rank) == [0, 1]
    by_rank[1].unlink()
    manifest = emit_manifest(open_store(manifest_dir), TP2, cache_root=tp_cache,
                             prefix="nodev", environment={})
    assert manifest is not None
    assert {r for g in manifest.graphs for r in g.ranks} == {0}
    assert main(["manifest", "check", manifest_dir, "--cache-dir", tp_cache]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL") == 3 and out.count("(missing ranks [1]): partial deployment") == 3
