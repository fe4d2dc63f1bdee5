"""Graphs know their snapshots (issue 27): each graph of the manifest lists the bundles the
run's processes captured for it, whether they were written before the emit or after it, by
one rank or several at once; a manifest from before reads with empty lists."""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from vllm_neuron.backends import open_store
from vllm_neuron.cli import main
from vllm_neuron.manifest import LedgerWriter, ManifestConfig, Topology, emit_manifest
from vllm_neuron.manifest.inspect import load_manifest, select_graphs, snapshot_paths
from vllm_neuron.manifest.schema import GraphEntry, Manifest, decode_manifest, encode_manifest
from vllm_neuron.manifest.snapshot_links import (
    LINKS_DIR,
    SnapshotLink,
    SnapshotLinker,
    bundle_path,
    fill_snapshot_paths,
    links_stream,
    refresh_manifest,
)

A, B, C = "a1" * 16, "b2" * 16, "c3" * 16
TP2 = ManifestConfig(model="m", topology=Topology(world_size=2, tensor_parallel_size=2))
DATA = Path(__file__).parent / "data" / "records"


def link(key: str, rank: int, call: int, outputs: bool = True, root: str = "") -> SnapshotLink:
    return SnapshotLink(key=key, path=bundle_path(root, f"{key}/rank{rank}/call{call}"),
                        global_rank=rank, call_index=call, outputs=outputs)


def trace(manifest_dir: str, keys: list[str], ranks: tuple[int, ...] = (0, 1)) -> None:
    for rank in ranks:
        writer = LedgerWriter(manifest_dir)
        for key in keys:
            assert writer.record(key, rank=rank, global_rank=rank, input_shapes=["4,"],
                                 compiler_flags="")


def read(manifest_dir: Path, prefix: str = "nodev") -> dict[str, GraphEntry]:
    manifest = decode_manifest((manifest_dir / prefix / "manifest.json").read_bytes())
    return {g.graph_hash: g for g in manifest.graphs}


# -- filling the lists ----------------------------------------------------------------------


def test_fill_orders_by_rank_and_call_and_never_drops_a_path() -> None:
    manifest = Manifest(graphs=[GraphEntry(graph_hash=A), GraphEntry(graph_hash=B),
                                GraphEntry(graph_hash=C, input_snapshot_paths=["kept/x"])])
    links = [link(A, 10, 0), link(A, 2, 1), link(A, 2, 0), link(B, 0, 3, outputs=False),
             link(C, 1, 0), link("d4" * 16, 0, 0)]  # the last: a graph the manifest lacks
    graphs = {g.graph_hash: g for g in fill_snapshot_paths(manifest, links).graphs}
    assert graphs[A].input_snapshot_paths == [f"{A}/rank2/call0", f"{A}/rank2/call1",
                                              f"{A}/rank10/call0"]
    assert graphs[A].output_snapshot_paths == graphs[A].input_snapshot_paths
    # A bundle without outputs is an input snapshot only.
    assert (graphs[B].input_snapshot_paths, graphs[B].output_snapshot_paths) == (
        [f"{B}/rank0/call3"], [])
    # A path already there stays (one not shaped rank<N>/call<K> sorts first).
    assert graphs[C].input_snapshot_paths == ["kept/x", f"{C}/rank1/call0"]
    assert set(graphs) == {A, B, C}
    # Filling again with the same lines changes nothing.
    again = fill_snapshot_paths(fill_snapshot_paths(manifest, links), links)
    assert again == fill_snapshot_paths(manifest, links)


def test_a_path_is_relative_to_a_local_root_and_a_url_under_a_url_root() -> None:
    assert bundle_path("/data/snaps", f"{A}/rank0/call1") == f"{A}/rank0/call1"
    assert bundle_path("s3://b/snaps/", f"{A}/rank0/call1") == f"s3://b/snaps/{A}/rank0/call1"


# -- the emit and the bundles written after it ----------------------------------------------


def test_bundles_before_and_after_the_emit_are_listed_per_rank(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              ) -> None:  # fmt: skip
    manifest_dir = tmp_path / "m"
    trace(str(manifest_dir), [A, B])
    linker = SnapshotLinker(str(manifest_dir), str(tmp_path / "snaps"))
    # Captured before the emit (outside vLLM): the emit reads it.
    assert linker.record(A, global_rank=0, call_index=0, call_prefix=f"{A}/rank0/call0",
                         outputs=True)
    written = emit_manifest(str(manifest_dir), TP2, cache_root=None, environment={},
                            link_snapshots=True)
    assert [g.input_snapshot_paths for g in written.graphs] == [[f"{A}/rank0/call0"], []]
    # After the emit, from either rank: manifest.json is rewritten at once.
    for rank, call in ((1, 0), (0, 1), (1, 1)):
        assert linker.record(A, global_rank=rank, call_index=call,
                             call_prefix=f"{A}/rank{rank}/call{call}", outputs=True)
    linker.record(B, global_rank=1, call_index=0, call_prefix=f"{B}/rank1/call0", outputs=False)
    graphs = read(manifest_dir)
    assert graphs[A].input_snapshot_paths == [f"{A}/rank0/call0", f"{A}/rank0/call1",
                                              f"{A}/rank1/call0", f"{A}/rank1/call1"]
    assert graphs[A].output_snapshot_paths == graphs[A].input_snapshot_paths
    assert (graphs[B].input_snapshot_paths, graphs[B].output_snapshot_paths) == (
        [f"{B}/rank1/call0"], [])
    # The lines stay for this run; the next run's emit removes them with this manifest.
    monkeypatch.setenv("VLLM_NEURON_RUN_ID", "next-run")
    trace(str(manifest_dir), [A])
    again = emit_manifest(str(manifest_dir), TP2, cache_root=None, environment={})
    assert again.graphs[0].input_snapshot_paths == []
    assert os.listdir(manifest_dir / LINKS_DIR / "nodev") == []


def test_without_the_marker_an_earlier_runs_manifest_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine_run: str
) -> None:
    manifest_dir = tmp_path / "m"
    monkeypatch.setenv("VLLM_NEURON_RUN_ID", "an-earlier-run")
    trace(str(manifest_dir), [A])
    emit_manifest(str(manifest_dir), TP2, cache_root=None, environment={}, link_snapshots=True)
    before = (manifest_dir / "nodev" / "manifest.json").read_bytes()
    # This run has not emitted yet: its bundle waits in its lines.
    monkeypatch.setenv("VLLM_NEURON_RUN_ID", engine_run)
    linker = SnapshotLinker(str(manifest_dir), "/snaps")
    assert linker.record(A, global_rank=0, call_index=0, call_prefix=f"{A}/rank0/call0",
                         outputs=True)
    assert (manifest_dir / "nodev" / "manifest.json").read_bytes() == before
    # This run's emit (capture off in its emitting process): fills what was named, writes no
    # marker, and removes the earlier run's lines.
    trace(str(manifest_dir), [A])
    emit_manifest(str(manifest_dir), TP2, cache_root=None, environment={})
    assert read(manifest_dir)[A].input_snapshot_paths == [f"{A}/rank0/call0"]
    assert os.listdir(manifest_dir / LINKS_DIR / "nodev") == [engine_run]
    assert os.listdir(manifest_dir / LINKS_DIR / "nodev" / engine_run) == [f"{os.getpid()}.jsonl"]


def _link_many(manifest_dir: str, rank: int, count: int, barrier: str) -> None:
    """One rank's process: wait for the other, then name `count` bundles as fast as it can."""
    import time

    open(os.path.join(barrier, f"ready{rank}"), "w").close()
    while len(os.listdir(barrier)) < 2:
        time.sleep(0.001)
    linker = SnapshotLinker(manifest_dir, "s3://bucket/snaps")
    for call in range(count):
        assert linker.record(A, global_rank=rank, call_index=call,
                             call_prefix=f"{A}/rank{rank}/call{call}", outputs=True)


def test_two_ranks_naming_bundles_at_once_lose_none(tmp_path: Path) -> None:
    manifest_dir = tmp_path / "m"
    trace(str(manifest_dir), [A])
    emit_manifest(str(manifest_dir), TP2, cache_root=None, environment={}, link_snapshots=True)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_link_many, args=(str(manifest_dir), r, 40, str(barrier)))
             for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    paths = read(manifest_dir)[A].input_snapshot_paths
    assert paths == [f"s3://bucket/snaps/{A}/rank{r}/call{c}" for r in (0, 1) for c in range(40)]


class WriteHook:
    """A store whose first write of a manifest.json runs `hook` just before it happens."""

    def __init__(self, store: Any, hook: Callable[[], None]) -> None:
        self.store, self.hook = store, hook

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def write(self, key: str, data: bytes, **options: Any) -> None:
        hook, self.hook = self.hook, lambda: None
        if key.endswith("manifest.json"):
            hook()
        self.store.write(key, data, **options)


def test_a_rewrite_that_overwrote_another_ranks_is_done_again(tmp_path: Path,
                                                             engine_run: str) -> None:
    """Rank A reads the lines, rank B appends its own and rewrites the manifest, then A
    writes what it read: B's bundle is gone from the file until A, reading the lines again
    after its write, writes once more."""
    store = open_store(str(tmp_path / "m"))
    trace(store.url, [A])
    emit_manifest(store, TP2, cache_root=None, environment={}, link_snapshots=True)
    stream = links_stream("nodev", engine_run)
    store.log(stream, writer="a").append(link(A, 0, 0))

    def rank_b_meanwhile() -> None:
        store.log(stream, writer="b").append(link(A, 1, 0))
        refresh_manifest(store, "nodev", engine_run)
        assert len(read(tmp_path / "m")[A].input_snapshot_paths) == 2

    refresh_manifest(WriteHook(store, rank_b_meanwhile), "nodev", engine_run)  # type: ignore[arg-type]
    assert read(tmp_path / "m")[A].input_snapshot_paths == [f"{A}/rank0/call0",
                                                            f"{A}/rank1/call0"]


def test_a_link_that_cannot_be_written_is_logged_once_and_swallowed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("in the way")
    linker = SnapshotLinker(str(blocked / "m"), "/snaps")
    for call in range(3):
        assert not linker.record(A, global_rank=0, call_index=call,
                                 call_prefix=f"{A}/rank0/call{call}", outputs=True)
    said = [r.getMessage() for r in caplog.records if "snapshot bundle" in r.getMessage()]
    assert len(said) == 1 and f"{A}/rank0/call0" in said[0], said


# -- the seed's format, old manifests and the command line ---------------------------------


def test_a_manifest_written_now_keeps_the_seeds_shape(tmp_path: Path) -> None:
    manifest_dir = tmp_path / "m"
    trace(str(manifest_dir), [A])
    emit_manifest(str(manifest_dir), TP2, cache_root=None, environment={}, link_snapshots=True)
    SnapshotLinker(str(manifest_dir), "/snaps").record(
        A, global_rank=0, call_index=0, call_prefix=f"{A}/rank0/call0", outputs=True)
    written = json.loads((manifest_dir / "nodev" / "manifest.json").read_bytes())
    assert list(written) == ["manifest_version", "config", "graphs", "environment"]
    (graph,) = written["graphs"]
    for name in ("input_snapshot_paths", "output_snapshot_paths"):
        assert graph[name] == [f"{A}/rank0/call0"]
        assert all(isinstance(p, str) for p in graph[name])


def test_an_old_manifest_reads_with_empty_lists(capsys: pytest.CaptureFixture[str]) -> None:
    _, old = load_manifest(str(DATA / "manifest.json"))
    assert all(g.input_snapshot_paths == g.output_snapshot_paths == [] for g in old.graphs)
    assert snapshot_paths(list(old.graphs)) == []
    assert main(["manifest", "show", str(DATA / "manifest.json")]) == 0
    out = capsys.readouterr().out
    assert "BUNDLES" in out and "snapshot bundles" not in out
    # Its graphs are listed without the fields too: the reader's defaults fill them in.
    raw = json.loads((DATA / "manifest.json").read_bytes())
    for graph in raw["graphs"]:
        graph.pop("input_snapshot_paths", None)
        graph.pop("output_snapshot_paths", None)
    bare = decode_manifest(json.dumps(raw).encode())
    assert all(g.input_snapshot_paths == [] for g in bare.graphs)


def test_show_counts_bundles_per_graph(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = Manifest(config=TP2, graphs=[
        GraphEntry(graph_hash=A, ranks=[0, 1],
                   input_snapshot_paths=[f"{A}/rank0/call0", f"{A}/rank1/call0"],
                   output_snapshot_paths=[f"{A}/rank0/call0", f"{A}/rank1/call0"]),
        GraphEntry(graph_hash=B, ranks=[0, 1], input_snapshot_paths=[f"{B}/rank1/call0"]),
        GraphEntry(graph_hash=C, ranks=[0, 1])])
    open_store(str(tmp_path / "e")).write("manifest.json", encode_manifest(manifest))
    assert main(["manifest", "show", str(tmp_path / "e")]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0] in (A[:12], B[:12], C[:12])}
    assert rows[A[:12]][-1] == "2" and rows[C[:12]][-1] == "0"
    assert rows[B[:12]][-4:] == ["1", "(0", "with", "outputs)"]
    assert main(["manifest", "show", str(tmp_path / "e")]) == 0
    assert ("3 graphs; 3 snapshot bundles for 2 of them, captured by ranks 0,1"
            in capsys.readouterr().out)
    assert main(["manifest", "show", str(tmp_path / "e"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["graphs"][0]["input_snapshot_paths"] == [f"{A}/rank0/call0", f"{A}/rank1/call0"]


def test_select_graphs_by_hash_or_prefix_and_errors_naming_the_value() -> None:
    manifest = Manifest(graphs=[GraphEntry(graph_hash=A), GraphEntry(graph_hash="a1ff" + A[4:])])
    assert select_graphs(manifest, "m") == list(manifest.graphs)
    assert [g.graph_hash for g in select_graphs(manifest, "m", A)] == [A]
    assert [g.graph_hash for g in select_graphs(manifest, "m", "A1FF")] == ["a1ff" + A[4:]]
    with pytest.raises(ValueError, match=r"--graph 'a1' names 2 graphs of m"):
        select_graphs(manifest, "m", "a1")
    with pytest.raises(ValueError, match=r"--graph 'ffff': m has no graph with that hash "
                                         r"\(its graphs: a1a1"):
        select_graphs(manifest, "m", "ffff")
    with pytest.raises(ValueError, match="--graph ''"):
        select_graphs(manifest, "m", "")
    assert msgspec.json.decode(encode_manifest(manifest))["graphs"][0]["graph_hash"] == A
