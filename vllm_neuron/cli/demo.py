"""The demo: one model, three processes, two "nodes", one shared remote tier.

    vllm-neuron demo [--workdir DIR] [--remote URL]     (python3 dev.py demo does this)

1. a cold process on node A compiles every graph through ``backend="vllm_neuron"``;
   its entries are then promoted to the remote tier with ``save_cache``;
2. a second process on node A finds them in its local tier: no compile;
3. a process on node C, whose local tier is empty, fetches them from the remote: no compile.

Each process checks its outputs against eager PyTorch. The host toolchain (TorchInductor)
does the compiling, each process with a fresh Inductor cache so the timings are ours.
The exit status is non-zero if any step compiled when it should not have, or diverged.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_neuron.assembly import get_runtime
from vllm_neuron.compile import save_cache

from .format import table
from .progress import ByteProgress, callback

if TYPE_CHECKING:
    import torch

RESULT_PREFIX = "VLLM_NEURON_DEMO_RESULT "


def build_model() -> torch.nn.Module:
    """A small two-block MLP with a residual and a norm: one graph, real weights."""
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch

    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.up = torch.nn.Linear(width, 4 * width)
            self.down = torch.nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    return torch.nn.Sequential(Block(64), Block(64), torch.nn.Linear(64, 16)).eval()


def worker() -> int:
    """One demo process: compile through the cache, compare with eager, report as JSON."""
    import torch  # heavy: imported only by the worker process that compiles

    model = build_model()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model, backend="vllm_neuron", dynamic=False)
        start = time.perf_counter()
        actual = compiled(x)
        seconds = time.perf_counter() - start
    history = get_runtime().history
    result = {
        "sources": [g.result.source for g in history],
        "keys": [g.key for g in history],
        "compiles": sum(g.result.source == "compiled" for g in history),
        "seconds": seconds,
        "max_abs_diff": float((actual - expected).abs().max()),
        "matches_eager": bool(torch.allclose(actual, expected, rtol=1e-4, atol=1e-5)),
        "toolchain": get_runtime().toolchain.name,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


@dataclass
class Step:
    label: str
    node: str
    expect_compiles: bool
    result: dict[str, object]


def run_worker(workdir: str, node: str, remote: str | None) -> dict[str, object]:
    env = dict(os.environ)
    env["VLLM_CACHE_ROOT"] = os.path.join(workdir, node)
    env.pop("NEURON_LIBTORCH_REMOTE_CACHE", None)
    if remote:
        env["NEURON_LIBTORCH_REMOTE_CACHE"] = remote
    # A fresh Inductor cache per process: what is saved is saved by our cache, not Inductor's.
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(workdir, "inductor", f"{node}-{time.time_ns()}")
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_neuron.cli", "demo", "--worker"],
        env=env, capture_output=True, text=True, check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return dict(json.loads(line[len(RESULT_PREFIX):]))
    sys.stderr.write(proc.stdout + proc.stderr)
    raise RuntimeError(f"demo worker on {node} failed with exit status {proc.returncode}")


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "demo", help="one model, three processes, two nodes, one shared remote tier",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workdir", default=os.path.join(os.getcwd(), "demo-output"),
                        help="where the demo's caches live (default: ./demo-output, wiped first)")
    parser.add_argument("--remote", default=None,
                        help="remote tier URL (default: <workdir>/remote-cache; s3://... works)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(handler=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.worker:
        return worker()
    workdir = os.path.abspath(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    remote = args.remote or os.path.join(workdir, "remote-cache")
    print(f"demo: caches under {workdir}, remote tier {remote}\n", flush=True)

    steps = []
    print("1/3 cold process on node-a (compiles)...", flush=True)
    steps.append(Step("cold process", "node-a", True, run_worker(workdir, "node-a", None)))
    local_a = os.path.join(workdir, "node-a", "neuron", "compile_cache")
    promote_start = time.perf_counter()
    with ByteProgress() as bars:
        for key in dict.fromkeys(steps[0].result["keys"]):  # type: ignore[call-overload]
            save_cache(local_a, remote, key,
                       progress=callback(bars.task(f"    promote {key[:12]}")))
    promote_seconds = time.perf_counter() - promote_start
    print("2/3 second process on node-a (local hit)...", flush=True)
    steps.append(Step("second process", "node-a", False, run_worker(workdir, "node-a", None)))
    print("3/3 new node-c with an empty local tier (remote fetch)...", flush=True)
    steps.append(Step("new node, shared remote", "node-c", False,
                      run_worker(workdir, "node-c", remote)))

    rows = []
    ok = True
    for s in steps:
        compiles = int(s.result["compiles"])  # type: ignore[call-overload]
        good = bool(s.result["matches_eager"]) and (compiles > 0) == s.expect_compiles
        ok &= good
        rows.append((s.label, s.node, ",".join(s.result["sources"]), compiles,  # type: ignore[arg-type]
                     f"{float(s.result['seconds']):.2f} s",  # type: ignore[arg-type]
                     "yes" if s.result["matches_eager"] else "NO", "ok" if good else "FAILED"))
    print()
    print(table(["STEP", "NODE", "SOURCE", "COMPILES", "FIRST CALL", "MATCHES EAGER", "CHECK"],
                rows))
    print(f"\npromotion to the remote tier (save_cache): {promote_seconds:.2f} s; "
          f"toolchain: {steps[0].result['toolchain']}")
    print("demo " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1

