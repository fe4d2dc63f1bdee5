"""Helpers for the compile-cache tests: deterministic fake compiles, and the worker
processes the multi-process tests start (``python cache_workers.py MODE JSON``).

A fake compile writes files whose bytes are derived from the key, so any process can tell
a right artifact from a wrong one without a registry of what was compiled. It can be slow
(to leave a window for a SIGKILL or a racing reader) and can fail on purpose. It leaves a
marker file per call in ``marker_dir``, so a test counts how many compiles *started*
(the cache's events only count the ones that finished).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from collections.abc import Mapping
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT_PREFIX = "CACHE_WORKER_RESULT "
FILE_NAMES = ("graph.bin", "weights/w0.bin", "weights/w1.bin", "meta.txt")


def content_for(key: str, name: str, size: int = 4096) -> bytes:
    """The bytes a fake compile of `key` writes to `name`: a function of both, nothing else."""
    seed = hashlib.sha256(f"{key}/{name}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def expected_files(key: str) -> dict[str, bytes]:
    return {name: content_for(key, name) for name in FILE_NAMES}


def fake_compile(
    out_dir: str,
    *,
    key: str,
    delay: float = 0.0,
    marker_dir: str | None = None,
    fail: str | None = None,
) -> dict[str, Any]:
    """Write the key's files into `out_dir`, one at a time over `delay` seconds."""
    if marker_dir is not None:
        os.makedirs(marker_dir, exist_ok=True)
        with open(os.path.join(marker_dir, f"started-{os.getpid()}-{time.time_ns()}"), "w") as f:
            f.write(str(os.getpid()))
    step = delay / len(FILE_NAMES)
    for name, data in expected_files(key).items():
        path = os.path.join(out_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            half = len(data) // 2
            f.write(data[:half])  # half a file exists for a while: a reader must never see it
            f.flush()
            time.sleep(step)
            f.write(data[half:])
        if fail is not None and name == FILE_NAMES[1]:
            raise ValueError(fail)
    return {"fake": True, "key": key}


def entry_is_right(path: str, key: str) -> str | None:
    """None if the entry directory at `path` holds exactly the key's files, else why not."""
    for name, data in expected_files(key).items():
        try:
            with open(os.path.join(path, name), "rb") as f:
                actual = f.read()
        except OSError as exc:
            return f"{name}: {exc}"
        if actual != data:
            return f"{name}: wrong bytes"
    return None


def _wait_until(start_at: float | None, barrier_dir: str | None = None) -> None:
    """Line up with the other workers: at a wall-clock moment, or at a file barrier
    (write ``ready-<pid>``, wait for ``go``; see `release_barrier`)."""
    if barrier_dir is not None:
        os.makedirs(barrier_dir, exist_ok=True)
        with open(os.path.join(barrier_dir, f"ready-{os.getpid()}"), "w"):
            pass
        while not os.path.exists(os.path.join(barrier_dir, "go")):
            time.sleep(0.01)
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))


def release_barrier(barrier_dir: str, parties: int, procs: list[Any], timeout: float) -> float:
    """Wait until `parties` workers are ready (failing if one died first), then let them go."""
    deadline = time.monotonic() + timeout
    while True:
        ready = [n for n in os.listdir(barrier_dir) if n.startswith("ready-")] if (
            os.path.isdir(barrier_dir)) else []
        if len(ready) >= parties:
            break
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            out, err = dead[0].communicate()
            raise AssertionError(f"a worker exited before the barrier:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"only {len(ready)} of {parties} workers reached the barrier")
        time.sleep(0.02)
    with open(os.path.join(barrier_dir, "go"), "w"):
        pass
    return time.time()


def run_get(args: Mapping[str, Any]) -> dict[str, Any]:
    """One "rank": get the key's entry through the cache, check it, report what happened."""
    from vllm_neuron.backends import open_store
    from vllm_neuron.compile.cache import TwoTierCache

    local = open_store(args["cache_dir"], lock=args.get("lock", "auto"))
    cache = TwoTierCache(
        local,
        remote=args.get("remote"),
        timeout=float(args.get("timeout", 120)),
        lease_duration=float(args.get("lease_duration", 30)),
        precompiled_only=bool(args.get("precompiled_only", False)),
    )
    key = args["key"]
    _wait_until(args.get("start_at"), args.get("barrier_dir"))
    t0 = time.time()
    try:
        result = cache.get_or_compile(
            key,
            lambda out: fake_compile(
                out,
                key=key,
                delay=float(args.get("delay", 0)),
                marker_dir=args.get("marker_dir"),
                fail=args.get("fail"),
            ),
        )
    except Exception as exc:  # reported to the test, which asserts on it
        return {"ok": False, "error_type": type(exc).__name__, "error": str(exc),
                "started": t0, "finished": time.time(), "pid": os.getpid()}
    assert result.path is not None
    return {
        "ok": True,
        "source": result.source,
        "path": result.path,
        "wrong": entry_is_right(result.path, key),
        "started": t0,
        "finished": time.time(),
        "pid": os.getpid(),
    }


def run_promote(args: Mapping[str, Any]) -> dict[str, Any]:
    """One "node": promote its local entry with `save_cache` at the agreed moment."""
    from vllm_neuron.compile import save_cache

    _wait_until(args.get("start_at"), args.get("barrier_dir"))
    try:
        published = save_cache(args["cache_dir"], args["remote"], args["key"])
    except Exception as exc:
        return {"ok": False, "error_type": type(exc).__name__, "error": str(exc),
                "traceback": traceback.format_exc()}
    return {"ok": True, "published": published}


def build_model(name: str) -> Any:
    """Tiny models for real compiles; two names give two different graphs."""
    import torch

    torch.manual_seed(0)
    width = {"mlp_a": 16, "mlp_b": 24}[name]
    layers: list[Any] = [torch.nn.Linear(width, width), torch.nn.ReLU(),
                         torch.nn.Linear(width, 8)]
    if name == "mlp_b":
        layers.insert(2, torch.nn.Tanh())
    return torch.nn.Sequential(*layers).eval(), torch.randn(4, width)


def run_torch(args: Mapping[str, Any]) -> dict[str, Any]:
    """One rank compiling a real model through ``torch.compile(backend="vllm_neuron")``."""
    import torch

    import vllm_neuron  # noqa: F401 - registers the backend
    from vllm_neuron.compile.runtime import get_runtime

    model, x = build_model(args["model"])
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model, backend="vllm_neuron", dynamic=False)
        _wait_until(args.get("start_at"), args.get("barrier_dir"))
        t0 = time.time()
        actual = compiled(x)
        t1 = time.time()
        again = compiled(x)
    history = get_runtime().history
    return {
        "ok": True,
        "sources": [g.result.source for g in history],
        "keys": [g.key for g in history],
        "matches": bool(torch.allclose(actual, expected, rtol=1e-4, atol=1e-5))
        and bool(torch.allclose(again, expected, rtol=1e-4, atol=1e-5)),
        "started": t0,
        "finished": t1,
        "pid": os.getpid(),
    }


def main(argv: list[str]) -> int:
    mode, raw = argv[0], argv[1]
    args = json.loads(raw)
    result = {"get": run_get, "promote": run_promote, "torch": run_torch}[mode](args)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


def parse_result(stdout: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return dict(json.loads(line[len(RESULT_PREFIX):]))
    raise AssertionError(f"no result line in worker output:\n{stdout}")


def worker_command(mode: str, args: Mapping[str, Any]) -> list[str]:
    return [sys.executable, os.path.join(HERE, "cache_workers.py"), mode, json.dumps(dict(args))]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
