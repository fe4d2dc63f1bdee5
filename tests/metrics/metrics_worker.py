"""What a vLLM engine process does for the live-metrics tests, in a process of its own.

``python metrics_worker.py CACHE_DIR KEY [KEY ...]``: install the live counters (the
directory comes from the inherited ``_VLLM_NEURON_METRICS_DIR``, as in a process vLLM
started), then ``get_or_compile`` each key in order through a real cache, and print the
path of this process's counter file.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.metrics import install


def small_compile(out_dir: str) -> dict[str, Any]:
    """A compile that writes one small artifact: what the cache stores is all that counts."""
    with open(os.path.join(out_dir, "graph.pt2"), "wb") as f:
        f.write(b"artifact" * 64)
    return {"toolchain": "host", "target": "cpu-inductor", "files": ["graph.pt2"],
            "output_shapes": ["[4, 8]"], "out_spec": "", "num_inputs": 1}


def main(argv: list[str]) -> int:
    live = install()
    assert live is not None
    cache = TwoTierCache(argv[0])
    for key in argv[1:]:
        cache.get_or_compile(key, small_compile)
    print(live.path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
