"""vLLM's first process for the gauge tests, in a process of its own.

``python gauges_worker.py``: install the live metrics by the general plugin's own call
(`install_in_vllm`, prometheus_client's global registry), wait for the sampler's first
measurement (its handshake, never a sleep), and print what ``/metrics`` would serve.
`install_in_vllm` acts only in a process where vLLM imported itself before calling its
plugins; a stand-in module plays that part (the real server: tests/plugin/test_vllm_serve.py).
"""

from __future__ import annotations

import sys
import types

from prometheus_client import REGISTRY, generate_latest

from vllm_neuron.metrics import gauge_sampler, install_in_vllm


def main() -> int:
    sys.modules.setdefault("vllm", types.ModuleType("vllm"))
    assert install_in_vllm() is not None
    sampler = gauge_sampler()
    assert sampler is not None and sampler.sampled.wait(timeout=120)
    sys.stdout.write(generate_latest(REGISTRY).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
