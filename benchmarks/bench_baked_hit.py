"""Issue 40: a hit from a baked read-only tier against a local hit, time to first output.

Both are fresh processes of the same kind, running production's path: settings and the cache
built by `vllm_neuron.assembly.get_runtime`, then `CompileRuntime.compile(gm, inputs)` as
``torch.compile(backend="vllm_neuron")`` calls it - key the graph, look it up, load the
artifact (from the verified unpacked copy of its package) - then the first call. The clock
runs from that call to the first output (bench_hit_load.py's method; the graph is captured
through dynamo before it, untimed).

* **local** (the baseline, in the same run): the graph's entry is in the process's own local
  tier (``VLLM_CACHE_ROOT``), where a compile put it;
* **baked**: the process's local tier is empty and writable; the entry is in a directory that
  `vllm-neuron cache bake` filled from that local tier, named by
  ``NEURON_LIBTORCH_BAKED_CACHE`` and made read-only (no write bit; the benchmark also lists
  it with sizes and mtimes before and after: nothing may be written there).

Checked in every process: the output equals eager PyTorch's, the hit came from the expected
tier (``source`` ``local`` / ``baked``), no ``aotinductor_*`` directory was left in the temp
dir. Target: baked / local <= 1.1x (median of per-round ratios, the cases alternating).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from ._harness import machine, sized
from .bench_hit_load import _capture, _env, _root, build

RESULT = "BENCH_BAKED_HIT "
TARGET = 1.1
CASES = ("local", "baked")


def worker() -> int:
    import torch

    from vllm_neuron.assembly import get_runtime

    gm, inputs = _capture()
    with torch.no_grad():
        expected = gm(*inputs)
    runtime = get_runtime()  # settings and the cache: built at start-up in production
    with torch.no_grad():
        start = time.perf_counter()
        fn, graph = runtime.compile(gm, inputs)
        out = fn(*inputs)
        seconds = time.perf_counter() - start
    got = out[0] if isinstance(out, list | tuple) else out
    want = expected[0] if isinstance(expected, list | tuple) else expected
    left = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("aotinductor_")]
    print(RESULT + json.dumps({
        "seconds": seconds, "source": graph.result.source, "left": len(left),
        "matches": bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5)),
    }), flush=True)  # fmt: skip
    return 0


def listing(root: str) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its size and mtime: what "nothing written" compares."""
    found = {}
    for where, dirs, files in os.walk(root):
        for name in dirs + files:
            info = os.lstat(os.path.join(where, name))
            found[os.path.relpath(os.path.join(where, name), root)] = (info.st_size,
                                                                       info.st_mtime_ns)
    return found


def bake(workdir: str, package: str) -> str:
    """`vllm-neuron cache bake` of the built graph into ``<workdir>/baked``, made read-only."""
    entry = os.path.dirname(package)
    key, tier = os.path.basename(entry), os.path.dirname(entry)
    manifest = os.path.join(workdir, "manifest.json")
    with open(manifest, "w") as f:
        json.dump({"manifest_version": "1", "config": {"topology": {"world_size": 1}},
                   "graphs": [{"graph_hash": key, "ranks": [0]}]}, f)
    baked = os.path.join(workdir, "baked")
    done = subprocess.run(
        [sys.executable, "-m", "vllm_neuron.cli", "cache", "bake", manifest, "--into", baked,
         "--from", tier], env=_env(workdir, "bake"), capture_output=True, text=True,
        cwd=_root(), timeout=600)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the bake failed:\n{done.stdout}\n{done.stderr}")
    for where, dirs, files in os.walk(baked):
        for name in dirs + files:
            path = os.path.join(where, name)
            os.chmod(path, os.lstat(path).st_mode & ~0o222)
    os.chmod(baked, 0o555)
    return baked


def run_case(workdir: str, case: str, baked: str, name: str) -> dict[str, Any]:
    env = _env(workdir, name)
    if case == "baked":  # an empty, writable local tier of its own; the baked tier
        env.update(VLLM_CACHE_ROOT=os.path.join(workdir, "pods", name),
                   NEURON_LIBTORCH_BAKED_CACHE=baked)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_baked_hit", "--worker"], env=env,
        capture_output=True, text=True, cwd=_root(), timeout=600)  # fmt: skip
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith(RESULT)), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"{case} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    result: dict[str, Any] = json.loads(line[len(RESULT):])
    if not result["matches"] or result["source"] != case or result["left"]:
        raise RuntimeError(f"{case}: not a clean {case} hit: {result}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks baked_hit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=sized(7, 1))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args([] if argv is None else argv)
    if args.worker:
        return worker()
    print(machine())
    print(f"{args.rounds} rounds of {', '.join(CASES)} (alternating first), each a fresh process")
    times: dict[str, list[float]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory(prefix="bench-baked-hit-") as workdir:
        package = build(workdir)
        baked = bake(workdir, package)
        before = listing(baked)
        for r in range(args.rounds):
            for case in CASES if r % 2 == 0 else CASES[::-1]:
                times[case].append(run_case(workdir, case, baked, f"{case}-{r}")["seconds"])
            print(f" round {r + 1}: " + ", ".join(
                f"{case} {times[case][-1] * 1e3:.2f} ms" for case in CASES)
                + f"  ({machine().rsplit(', ', 1)[-1]})", flush=True)  # fmt: skip
        untouched = listing(baked) == before
        for where, dirs, _ in os.walk(baked):  # writable again, so that it can be removed
            for name in dirs:
                os.chmod(os.path.join(where, name), 0o755)
        os.chmod(baked, 0o755)
    for case in CASES:
        print(f"  {case:<6} hit to first output: best {min(times[case]) * 1e3:8.2f} ms, "
              f"median {statistics.median(times[case]) * 1e3:8.2f} ms")
    paired = statistics.median(b / lo for b, lo in zip(times["baked"], times["local"],
                                                       strict=True))  # fmt: skip
    best = min(times["baked"]) / min(times["local"])
    print(f"  baked / local, fresh processes: {paired:.3f}x median of per-round ratios "
          f"(best/best {best:.3f}x); target <= {TARGET}x: "
          f"{'met' if paired <= TARGET else 'MISSED'}")
    print(f"  baked tier unchanged by the hits: {'yes' if untouched else 'NO'}")
    return 0 if paired <= TARGET and untouched else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
