"""One process of the fleet cold-start benchmark (`bench_fleet_cold_start`): one rank of one
simulated node. ``python -m benchmarks.fleet_worker MODE JSON``; prints one result line.

``fake``: the cache with a test toolchain, light imports (no torch): a compile sleeps
``compile_seconds`` and then writes ``files`` files of ``file_mib`` MiB whose bytes are a
function of the key and the file's name, so any process can check the artifact it got.
Each compile started leaves a marker file, so compiles are counted even if the cache's
event log missed one.

``torch``: a real ``torch.compile(model, backend="vllm_neuron")`` of a tiny MLP with
TorchInductor behind it; the cache settings come from the environment the benchmark sets
(``VLLM_CACHE_ROOT`` per node, ``NEURON_LIBTORCH_REMOTE_CACHE`` shared, ...).

Both do their start-up (imports, building the cache, opening and probing the remote and
warming its client up, see `warm_up`; for ``torch`` also the model, ``torch.compile``'s
wrapper and Inductor's CPU-ISA probe) before the barrier: ``ready-<pid>`` in the barrier
directory, then an ``open`` of the barrier's FIFO, which blocks in the kernel (no polling:
64 sleeping processes cost nothing on 2 cores) until the benchmark opens the other end,
which wakes them all. Each reports the CPU time it used from the release to its result.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

RESULT = "FLEET_WORKER_RESULT "
GO_FIFO = "go"  # in the barrier directory
MIB = 1 << 20


def content_for(key: str, name: str, size: int) -> bytes:
    """The bytes a fake compile of `key` writes to `name`: a function of both, nothing else."""
    seed = hashlib.sha256(f"{key}/{name}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def file_names(files: int) -> list[str]:
    return ["graph.neff"] + [f"weights/part{i:02d}.bin" for i in range(1, files)]


def wrong_bytes(path: str, key: str, files: int, size: int) -> str | None:
    """None if the entry at `path` holds exactly the key's files, else what is wrong."""
    for name in file_names(files):
        try:
            with open(os.path.join(path, name), "rb") as f:
                data = f.read()
        except OSError as exc:
            return f"{name}: {exc}"
        if data != content_for(key, name, size):
            return f"{name}: wrong bytes"
    return None


def wait_for_go(barrier_dir: str) -> float:
    """Say ready, block until the benchmark releases the barrier; the release time seen."""
    with open(os.path.join(barrier_dir, f"ready-{os.getpid()}"), "w"):
        pass
    fd = os.open(os.path.join(barrier_dir, GO_FIFO), os.O_RDONLY)  # blocks until released
    os.close(fd)
    return time.time()


def warm_up(cache: Any) -> None:
    """The remote requests of a miss and of a lease, on a key no graph has, before the barrier.

    An S3 client builds each operation's model on its first use (~0.07 s of CPU per
    process): a real node pays that once on its own cores, but 64 simulated nodes would pay
    it one after another on this machine's 2 cores (~2 s) and the benchmark would measure
    that instead of the coordination. Both designs get the same warm-up.
    """
    from vllm_neuron.backends import LockTimeout

    remote = cache.remote
    if remote is None:
        raise RuntimeError(f"remote {cache.remote_url} is not reachable")
    unused = "0" * 32
    cache.fetch_remote(unused)
    lease = remote.lock(unused, lease_duration=30.0)
    try:
        lease.acquire(timeout=0)
    except LockTimeout:  # another process of the fleet is warming up the same lease
        return
    lease.check()
    lease.release()


def run_fake(args: Mapping[str, Any]) -> dict[str, Any]:
    from vllm_neuron.compile.flow.cache import TwoTierCache

    compile_seconds = float(args["compile_seconds"])
    files, size = int(args["files"]), int(float(args["file_mib"]) * MIB)
    marker_dir = args["marker_dir"]

    def compile_for(key: str) -> Any:
        def compile_fn(out: str) -> dict[str, Any]:
            with open(os.path.join(marker_dir, f"compile-{key}-{os.getpid()}-{time.time_ns()}"),
                      "w"):
                pass
            time.sleep(compile_seconds)  # the compiler's time, on this node's own cores
            for name in file_names(files):
                path = os.path.join(out, name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(content_for(key, name, size))
            return {"fake": True}

        return compile_fn

    workers = args.get("compile_workers")
    cache = TwoTierCache(
        args["node_dir"],
        remote=args["remote"],
        remote_options=args.get("remote_options") or {},
        remote_write=args["remote_write"],
        remote_lease_seconds=float(args.get("lease_seconds", 30.0)),
        timeout=float(args.get("timeout", 600.0)),
        compile_workers=None if workers is None else int(workers),
        defer_compiles=bool(args.get("defer", False)),
    )
    warm_up(cache)  # opens and probes the remote too: start-up, not the cold start
    keys = list(args["keys"])
    released = wait_for_go(args["barrier_dir"])
    cpu = time.process_time()
    if args.get("defer"):  # traced as vLLM's piecewise backend does: every graph, then calls
        from vllm_neuron.compile.entry.outcomes import PendingCompile

        traced = [cache.begin(key, compile_for(key)) for key in keys]
        results = [t.result() if isinstance(t, PendingCompile) else t for t in traced]
    else:
        results = [cache.get_or_compile(key, compile_for(key)) for key in keys]
    finished = time.time()
    cpu = time.process_time() - cpu
    wrong = [w for key, r in zip(keys, results, strict=True)
             if (w := wrong_bytes(str(r.path), key, files, size)) is not None]
    return {
        "released": released,
        "finished": finished,
        "sources": [r.source for r in results],
        "seconds": [r.seconds for r in results],
        "wrong": wrong,
        "cpu": cpu,
        "pid": os.getpid(),
    }


def _model() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)
    ).eval()
    return model, torch.randn(4, 16)


def run_torch(args: Mapping[str, Any]) -> dict[str, Any]:
    import torch
    import torch._inductor  # noqa: F401 - an import like any other: before the barrier
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    import vllm_neuron  # noqa: F401 - registers the backend
    from vllm_neuron.assembly import get_runtime

    cache = get_runtime().cache  # settings, toolchain, cache: start-up
    # The baseline's remote_write="off", on the runtime's cache itself: the benchmark also
    # sets VLLM_NEURON_REMOTE_WRITE, which a runtime that does not read it would ignore.
    cache.remote_write = args["remote_write"]
    warm_up(cache)
    # Inductor's one-time CPU-ISA probe builds a small program into TORCHINDUCTOR_CACHE_DIR
    # (fresh per process here, so only our cache can save the graph's compile); on a real
    # node that cache is shared and the probe paid once. Start-up, not the graph compile.
    pick_vec_isa()
    model, x = _model()
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model, backend="vllm_neuron", dynamic=False)
        released = wait_for_go(args["barrier_dir"])
        cpu = time.process_time()
        actual = compiled(x)
        finished = time.time()
        cpu = time.process_time() - cpu
    history = get_runtime().history
    matches = bool(torch.allclose(actual, expected, rtol=1e-4, atol=1e-5))
    return {
        "released": released,
        "finished": finished,
        "sources": [g.result.source for g in history],
        "seconds": [g.result.seconds for g in history],
        "keys": [g.key for g in history],
        "wrong": [] if matches else ["output differs from eager"],
        "cpu": cpu,
        "pid": os.getpid(),
    }


def main(argv: list[str]) -> int:
    mode, raw = argv
    result = {"fake": run_fake, "torch": run_torch}[mode](json.loads(raw))
    print(RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
