"""A deployment to report on, built with the real writers of each artifact.

- the compile cache: real processes (``tests/compile/helpers/cache_workers.py``, the workers of the
  multi-process cache tests) on two "nodes" sharing a remote tier: node A compiles two
  graphs (two ranks racing for one of them, lined up at a file barrier) and hits one, node
  B fetches both from the remote;
- manifests: two engines written with the manifest schema's encoder, one complete and one
  partial (a graph traced by one rank of two), naming the cache's entries;
- snapshot bundles: two ranks of a tensor-parallel layer captured by the real capturer
  (one rank's input then perturbed, so its replay fails);
- profile runs: a valid prefill run (a torch trace whose steps are prefill only) and a
  failed one, written with the profiling run-record writers.

Every wait is a handshake (the workers' barrier), never a pause.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
for extra in (TESTS / "compile" / "helpers", TESTS / "snapshot"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from cache_workers import (  # noqa: E402
    HELD,
    RESUME,
    WAITING,
    finish_workers,
    release_barrier,
    wait_for,
    worker_command,
    worker_env,
)

KEYS = ("a1" * 16, "b2" * 16, "c3" * 16)
# A model name that would be markup if the page did not escape what it reads.
HOSTILE_MODEL = '<script>console.error("injected")</script><img src="http://x.invalid/a">'
SNAP_HASH = "0123456789abcdef0123456789abcdef"


@dataclass(frozen=True)
class Deployment:
    root: Path  # VLLM_CACHE_ROOT and project root of node A (everything but node B)
    node_b: Path  # node B's VLLM_CACHE_ROOT
    cache_a: Path
    cache_b: Path
    remote: Path


def run_report(*argv: str) -> subprocess.CompletedProcess[str]:
    """`vllm-neuron report ...` as a user runs it: its own process."""
    return subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "report", *argv],
                          capture_output=True, text=True, timeout=600)


def _workers(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    procs = [subprocess.Popen(worker_command("get", spec), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=worker_env())
             for spec in specs]
    return finish_workers(procs)


def _race(specs: list[dict[str, Any]], work: Path) -> list[dict[str, Any]]:
    """Two ranks on one key: one compiles and is held half-way until the other is queued on
    the key's lock, so the other's lock wait lasts at least the rest of the compile (above
    the 50 ms the cache records), whatever the machine's load."""
    barrier, hold, waiting = work / "barrier", work / "hold", work / "waiting"
    procs = [subprocess.Popen(worker_command("get", {**spec, "barrier_dir": str(barrier),
                                                     "hold_dir": str(hold),
                                                     "waiting_dir": str(waiting)}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=worker_env())
             for spec in specs]  # fmt: skip
    release_barrier(str(barrier), len(procs), procs)
    wait_for(lambda: (hold / HELD).exists(), "a compile held half-way", procs)
    wait_for(lambda: waiting.is_dir() and len([n for n in os.listdir(waiting)
                                               if n.startswith(WAITING)]) == len(procs),
             "both ranks queued on the key's lock", procs)  # fmt: skip
    (hold / RESUME).touch()
    return finish_workers(procs)


def build_cache(root: Path, node_b: Path) -> Deployment:
    cache_a = root / "neuron" / "compile_cache"
    cache_b = node_b / "neuron" / "compile_cache"
    remote = root.parent / "remote-tier"
    for d in (cache_a, cache_b, remote):
        d.mkdir(parents=True, exist_ok=True)

    def spec(cache: Path, key: str) -> dict[str, Any]:
        # delay: the compile's four files over 0.4 s; after a hold, 0.3 s of it remain
        return {"cache_dir": str(cache), "remote": str(remote), "key": key, "delay": 0.4}

    first = _workers([spec(cache_a, KEYS[0])])
    race = _race([spec(cache_a, KEYS[1]) for _ in range(2)], root.parent)
    again = _workers([spec(cache_a, KEYS[0])])
    fetched = _workers([spec(cache_b, KEYS[0]), spec(cache_b, KEYS[1])])
    sources = [r["source"] for r in first + race + again + fetched]
    assert all(r["ok"] and r["wrong"] is None for r in first + race + again + fetched), sources
    assert sources[0] == "compiled" and sources[3] == "local", sources
    assert sorted(sources[1:3]) == ["compiled", "local-after-wait"], sources
    assert sources[4:] == ["remote", "remote"], sources  # node B fetched both
    return Deployment(root, node_b, cache_a, cache_b, remote)


def write_manifests(root: Path, model: str) -> None:
    from vllm_neuron.backends import open_store
    from vllm_neuron.manifest.schema import (
        GraphEntry,
        Manifest,
        ManifestConfig,
        Topology,
        encode_manifest,
    )

    def graph(key: str, ranks: list[int]) -> GraphEntry:
        return GraphEntry(graph_hash=key, neff_path=f"{key}/graph.bin", neff_size=4096,
                          created_timestamp="2026-12-01T10:00:00Z",
                          input_shapes=["4, 8", ""], output_shapes=["4, 8"], ranks=ranks)

    store = open_store(str(root / "manifests"))
    complete = Manifest(config=ManifestConfig(model=model, target="cpu-inductor",
                                              dtype="float32"),
                        graphs=[graph(KEYS[0], [0])])
    partial = Manifest(
        config=ManifestConfig(model="tiny-llama", target="cpu-inductor", dtype="bfloat16",
                              topology=Topology(world_size=2, tensor_parallel_size=2,
                                                has_collectives=True)),
        graphs=[graph(KEYS[0], [0, 1]), graph(KEYS[1], [0])],
    )
    store.write("nodev/manifest.json", encode_manifest(complete))
    store.write("dev0_1/manifest.json", encode_manifest(partial))


def capture_bundles(root: Path) -> list[str]:
    """Two ranks' bundles of one decode step; rank 1's first input is then perturbed, so
    its replay no longer matches its captured outputs. Returns the bundle prefixes."""
    import torch
    import torch.fx
    from snapshot_helpers import ctx, make_config

    from vllm_neuron.snapshot import (
        CaptureBudget,
        RankInfo,
        SnapshotCapturer,
        clear_current_forward,
        forward_context,
        reset_snapshot_config,
        resolve_capture_spec,
    )
    from vllm_neuron.snapshot.encoding import decode_tensor, encode_tensor

    class Shard(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.tanh(x @ w)
            return h, h.sum(dim=-1)

    class Graph:
        key = SNAP_HASH
        gm = torch.fx.symbolic_trace(Shard())
        example_inputs = [torch.zeros(2, 8), torch.zeros(8, 4)]
        artifact = type("A", (), {"toolchain": "host", "target": "cpu-inductor"})()

    snaps = root / "neuron" / "snapshots"
    cfg = make_config(str(snaps), CAPTURE_TOKEN="12", FORMAT="npy")
    gen = torch.Generator().manual_seed(0)
    fns = []
    for rank in range(2):
        spec = resolve_capture_spec(SNAP_HASH, config=cfg,
                                    ranks=RankInfo(global_rank=rank, tp_rank=rank),
                                    budget=CaptureBudget(cfg.max_captures))
        assert spec is not None
        fns.append(SnapshotCapturer(spec, graph=Graph()).wrap(Shard()))  # type: ignore[arg-type]
    weights = [torch.randn(8, 4, generator=gen) for _ in range(2)]
    try:
        for step in range(3):
            x = torch.randn(2, 8, generator=gen)
            with forward_context(ctx(step, ["a", "b"], [9 + step, 3 + step], True, config=cfg)):
                for fn, w in zip(fns, weights, strict=True):
                    fn(x, w)
    finally:
        reset_snapshot_config()
        clear_current_forward()
    prefixes = [f"{SNAP_HASH}/rank{r}/call2" for r in range(2)]
    tensor = snaps / prefixes[1] / "tensor0.npy"
    t = decode_tensor(tensor.read_bytes(), "npy", "float32", [2, 8]).clone()
    t.view(-1)[0] += 0.5
    tensor.write_bytes(encode_tensor(t, "npy"))
    return prefixes


def write_profile_runs(root: Path) -> None:
    import gzip
    import json

    from vllm_neuron.backends import open_store
    from vllm_neuron.profiling import artifacts
    from vllm_neuron.profiling.layout import RunLayout
    from vllm_neuron.profiling.run_record import ProfileManifest, Validation, write_manifest
    from vllm_neuron.profiling.run_spec import (
        RunSpec,
        ServeConfig,
        Workload,
        profiler_settings,
        write_run_spec,
    )

    for name, status in (("prefill-ok", "ok"), ("prefill-failed", "failed")):
        layout = RunLayout.for_run(str(root), name)
        os.makedirs(layout.output_dir, exist_ok=True)
        config, additional = profiler_settings("torch", layout.output_dir)
        spec = RunSpec(run_name=name, phase="prefill", recipe="prefill_isolation",
                       workload=Workload(concurrency=1, num_requests=1, output_len=1),
                       serve_config=ServeConfig(model="/m", profiler_config=config,
                                                additional_config=additional),
                       profiler="torch")
        store = open_store(layout.run_dir)
        write_run_spec(store, spec)
        if status == "ok":
            events = [{"ph": "X", "cat": "user_annotation", "ts": 1.0, "dur": 1.0,
                       "name": "execute_context_1(31)_generation_0(0)"}]
            trace = Path(layout.output_dir) / "rank0.1795947567611134459.pt.trace.json.gz"
            with gzip.open(trace, "wt") as f:
                json.dump({"distributedInfo": {"rank": 0}, "traceEvents": events}, f)
        found = artifacts.collect(layout.output_dir, "torch")
        write_manifest(store, ProfileManifest(
            run_name=name, recipe="prefill_isolation", phase="prefill", status=status,
            error=None if status == "ok" else "server exited with code 1 before it was ready",
            failed_stage=None if status == "ok" else "ready", run_dir=layout.run_dir,
            run_spec=layout.run_spec, serve_log=layout.serve_log, profile=found,
            validation=Validation(ok=status == "ok"),
        ))


def build_deployment(base: Path, model: str = "tiny-llama") -> Deployment:
    deployment = build_cache(base / "node-a", base / "node-b")
    write_manifests(deployment.root, model)
    capture_bundles(deployment.root)
    write_profile_runs(deployment.root)
    return deployment
