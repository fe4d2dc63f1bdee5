"""Hot local hit of the compile cache vs the bare `os` calls the same check needs.

A hit, from a known key to a ready, size-checked artifact path, is
`TwoTierCache.lookup_local(key)`: read the commit record (``entry.json``), decode it, one
`os.stat` per listed file, compare sizes. The baseline is only the system calls that check
cannot avoid: ``os.open`` + ``os.read`` + ``os.close`` of the record and one ``os.stat``
per file (no decoding, no comparison). Target: lookup <= 1.5x the baseline.

Key computation is reported separately: `compute_cache_key` of a 1,000-node FX graph
captured by dynamo (so its nodes carry the fake-tensor metadata a real graph has).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from ._harness import machine, measure

KEY = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
COMPONENTS = {
    n: "5d41402abc4b2a76b9719d911017c592"
    for n in ("graph", "inputs", "versions", "compiler_args", "target", "replica_groups")
}
META = {  # what the host toolchain stores: the shape of a real record
    "toolchain": "host",
    "target": "cpu-inductor",
    "files": ["graph.pt2"],
    "output_shapes": ["[4, 8]"],
    "out_spec": '[1, {"type": null, "context": "null", "children_spec": []}]',
    "num_inputs": 1,
}


def _entry(directory: str, files: int) -> Any:
    from vllm_neuron.compile.cache import TwoTierCache

    def compile_into(out: str) -> dict[str, Any]:
        for i in range(files):
            name = "graph.pt2" if i == 0 else f"weights/part{i}.bin"
            path = os.path.join(out, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(os.urandom(64 << 10))
        return META

    cache = TwoTierCache(directory)
    cache.get_or_compile(KEY, compile_into, components=COMPONENTS)
    return cache


def bench_hit(n: int, rounds: int, files: int) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-cache-hit-") as directory:
        cache = _entry(os.path.join(directory, "cache"), files)
        entry_dir = os.path.join(cache.local_dir, KEY)
        record_path = os.path.join(entry_dir, "entry.json")
        paths = [os.path.join(entry_dir, rel) for rel in cache.read_entry(KEY).files]
        lookup = cache.lookup_local
        assert lookup(KEY) is not None

        def ours(count: int) -> None:
            for _ in range(count):
                lookup(KEY)

        def bare(count: int) -> None:
            open_, read, close, stat = os.open, os.read, os.close, os.stat
            for _ in range(count):
                fd = open_(record_path, os.O_RDONLY)
                read(fd, 1 << 16)
                close(fd)
                for p in paths:
                    stat(p)

        ours_name = f"lookup_local ({files} file{'s' if files > 1 else ''})"
        bare_name = f"os.open/read/close + {files} os.stat"
        timings = measure({ours_name: ours, bare_name: bare}, n, rounds)
        print(timings[ours_name].line())
        print(timings[bare_name].line())
        ratio = timings[bare_name].best / timings[ours_name].best
        us_ours = 1e6 / timings[ours_name].best
        us_bare = 1e6 / timings[bare_name].best
        verdict = "meets" if ratio <= 1.5 else "MISSES"
        print(f"  lookup/bare {ratio:.2f}x ({us_ours:.1f} us vs {us_bare:.1f} us per hit); "
              f"{verdict} the <= 1.5x target")
        return ratio


def _graph_of(nodes: int) -> tuple[Any, list[Any]]:
    """A dynamo-captured GraphModule with about `nodes` nodes."""
    import torch

    blocks = max(1, (nodes - 2) // 6)  # a block is 6 dynamo nodes (2 of them parameters)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.relu(self.lin(x)) * 0.5

    model = torch.nn.Sequential(*[Block() for _ in range(blocks)]).eval()
    captured: list[Any] = []

    def capture(gm: Any, example_inputs: list[Any]) -> Any:
        captured.append((gm, list(example_inputs)))
        return gm.forward

    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.config.inline_inbuilt_nn_modules = True
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.compile(model, backend=capture, dynamic=False)(x)
    gm, inputs = max(captured, key=lambda c: len(c[0].graph.nodes))
    return gm, inputs


def bench_key(nodes: int, repeats: int) -> float:
    from vllm_neuron.compile.key import compute_cache_key
    from vllm_neuron.compile.toolchains.host import HostToolchain

    gm, inputs = _graph_of(nodes)
    toolchain = HostToolchain()
    versions = toolchain.versions()
    times = []
    key = None
    for _ in range(repeats):
        start = time.perf_counter()
        k = compute_cache_key(gm, inputs, toolchain_versions=versions, compiler_args=[],
                              target=toolchain.target)
        times.append(time.perf_counter() - start)
        assert key is None or k.key == key  # deterministic
        key = k.key
    print(f"  compute_cache_key, {len(gm.graph.nodes)}-node dynamo graph: "
          f"best {min(times) * 1e3:.1f} ms, median {statistics.median(times) * 1e3:.1f} ms "
          f"({repeats} runs)")
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks cache_hit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20_000, help="lookups per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--nodes", type=int, default=1000, help="graph size for the key")
    parser.add_argument("--key-repeats", type=int, default=5)
    parser.add_argument("--skip-key", action="store_true", help="do not import torch")
    args = parser.parse_args([] if argv is None else argv)
    print(machine())
    print(f"hot local hit, {args.n:,} lookups x {args.rounds} rounds:")
    ratios = [bench_hit(args.n, args.rounds, files) for files in (1, 4)]
    if not args.skip_key:
        print("key computation:")
        bench_key(args.nodes, args.key_repeats)
    return 0 if max(ratios) <= 1.5 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
