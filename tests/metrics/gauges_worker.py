"""vLLM's first process for the gauge tests, in a process of its own.

``python gauges_worker.py``: install the live metrics as the general plugin does in vLLM's
first process (gauges on, prometheus_client's global registry), wait for the sampler's
first measurement (its handshake, never a sleep), and print what ``/metrics`` would serve.
"""

from __future__ import annotations

import sys

from prometheus_client import REGISTRY, generate_latest

from vllm_neuron.metrics import gauge_sampler, install


def main() -> int:
    assert install(gauges=True) is not None
    sampler = gauge_sampler()
    assert sampler is not None and sampler.sampled.wait(timeout=120)
    sys.stdout.write(generate_latest(REGISTRY).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
