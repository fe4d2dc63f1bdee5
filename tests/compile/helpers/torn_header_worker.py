"""One host compile in a fresh process, for test_torn_headers.py:
``python torn_header_worker.py OUT_DIR SCALE [--tear]`` compiles a small graph (its constant
`SCALE`) with the host toolchain, loads it and checks its output; with ``--tear``, then tears
every precompiled header torch built (as a build killed mid-write leaves one). Prints one
JSON line: torch's header directory and the headers' sizes after."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.fx
from torch._inductor import codecache

from vllm_neuron.compile.toolchains.host import HostToolchain


class Scaled(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(self.linear(x)) * self.scale


def main(out_dir: str, scale: float, tear: bool) -> dict[str, object]:
    torch.manual_seed(0)
    module, x = Scaled(scale), torch.randn(4, 8)
    toolchain = HostToolchain()
    artifact = toolchain.compile(torch.fx.symbolic_trace(module), (x,), out_dir)
    out = toolchain.load(out_dir, artifact)(x)
    assert torch.allclose(out, module(x), atol=1e-5)
    headers = sorted(os.path.join(codecache._HEADER_DIR, name)
                     for name in os.listdir(codecache._HEADER_DIR) if name.endswith(".gch"))
    if tear:
        for path in headers:
            os.truncate(path, os.path.getsize(path) // 3)
    return {"header_dir": codecache._HEADER_DIR,
            "sizes": {os.path.basename(p): os.path.getsize(p) for p in headers
                      if os.path.exists(p)},
            "locks": sorted(os.listdir(codecache._HEADER_LOCK_DIR))}  # what torch named them


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], float(sys.argv[2]), "--tear" in sys.argv[3:])))
