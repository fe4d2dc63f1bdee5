"""One rank of tests/compile/toolchains/test_host_collectives.py:
``python collective_worker.py DIR RANK``.

Joins a two-rank gloo group (file rendezvous in DIR), compiles a piece shaped like a
tensor-parallel row-parallel layer (a matmul, then torch's functional all-reduce and its
wait, as vLLM's graph calls it where the CPU has no shared-memory all-reduce) with the host
toolchain on rank 0, loads that artifact on both ranks, and calls it CALLS times back to
back, keeping the last outputs alive in Python as vLLM keeps a piece's output for the next
piece. Writes ``done<RANK>.json`` (calls made, whether every output matched eager) and exits 0.

The loop is the warm TP=2 server's decode in miniature: before the host toolchain routed
collectives through Python, gloo's worker and the calling thread deadlocked on the GIL and
gloo's queue lock within a few thousand calls; the parent then sees no file and times out.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.fx

from vllm_neuron.compile.toolchains.host import HostToolchain

CALLS = int(os.environ.get("COLLECTIVE_WORKER_CALLS", "4000"))


def main(work: Path, rank: int) -> int:
    dist.init_process_group("gloo", init_method=f"file://{work / 'rendezvous'}", rank=rank,
                            world_size=2)  # fmt: skip
    group = dist.new_group([0, 1], backend="gloo")  # as vLLM's TP group: not the default one
    name = group.group_name
    torch.manual_seed(0)  # the same weight on both ranks
    weight = torch.randn(64, 64)

    class RowParallel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("weight", weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x @ self.weight
            y = torch.ops._c10d_functional.all_reduce(y, "sum", name)
            return torch.ops._c10d_functional.wait_tensor(y)

    gm = torch.fx.symbolic_trace(RowParallel())
    x = torch.randn(4, 64)
    toolchain = HostToolchain()
    out_dir = work / "rank0"
    # Rank 0 compiles; rank 1 loads its artifact, as a cache hit would (one compile's CPU,
    # not two at once on a small machine).
    meta = [toolchain.compile(gm, [x], str(out_dir)) if rank == 0 else None]
    dist.broadcast_object_list(meta, src=0)
    run = toolchain.load(str(out_dir), meta[0])
    expected = (x @ weight) * 2
    kept: list[torch.Tensor] = []
    matched = True
    dist.barrier()
    for _ in range(CALLS):
        out = run(x)
        matched = matched and bool(torch.allclose(out, expected, rtol=1e-5, atol=1e-5))
        kept = [*kept[-2:], out]
    (work / f"done{rank}.json").write_text(json.dumps({"calls": CALLS, "matched": matched}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2])))
