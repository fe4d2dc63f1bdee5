"""A process that serves a small model through ``torch.compile(backend="vllm_neuron")``, as a
user's would: ``python serve_worker.py`` with the cache's settings in its environment.

Prints one line ``SERVE_WORKER_RESULT {json}``: whether every output matched eager PyTorch,
where each graph came from (``compiled``, ``local``, ``uncached`` ...), and every warning
the package logged (so a test can count them), then exits 0. Any exception propagates:
the exit status and stderr say what went wrong, as they would for the user.
"""

from __future__ import annotations

import json
import logging

import torch

RESULT = "SERVE_WORKER_RESULT "


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> int:
    warnings = _Warnings()
    logging.getLogger("vllm_neuron").addHandler(warnings)
    import vllm_neuron  # noqa: F401 - registers the backend
    from vllm_neuron.assembly import get_runtime

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(4, 32)
    compiled = torch.compile(model, backend="vllm_neuron")
    with torch.no_grad():
        matched = bool(torch.allclose(compiled(x), model(x), rtol=1e-5, atol=1e-5))
    runtime = get_runtime()
    print(RESULT + json.dumps({
        "matched": matched,
        "sources": [graph.result.source for graph in runtime.history],
        "keys": [graph.key for graph in runtime.history],
        "local_dir": runtime.cache.local_dir,
        "warnings": warnings.messages,
    }), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
