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
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

RESULT = "SERVE_WORKER_RESULT "
HERE = Path(__file__).resolve().parent
# Settings a test's environment must not leak into a served process (each test sets its own).
_STRIP = ("VLLM_CACHE_ROOT", "NEURON_LIBTORCH_REMOTE_CACHE", "VLLM_NEURON_DISABLE_WARMUP_COMPILE",
          "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE", "VLLM_NEURON_MANIFEST_DIR",
          "VLLM_NEURON_CACHE_SIGNING_KEY", "VLLM_NEURON_CACHE_TRUSTED_KEYS",
          "VLLM_NEURON_CACHE_TRUST")  # fmt: skip


def serve(cache_root: Path, inductor_cache: Path, **env: str
          ) -> tuple[int, dict[str, Any] | None, str]:  # fmt: skip
    """Run this worker (the test's side): (exit status, its result or None, stderr).
    ``inductor_cache``: Inductor's own cache, shared by a module's processes (it only makes
    the real compiles faster; where a graph comes from is this package's cache)."""
    base = {k: v for k, v in os.environ.items() if k not in _STRIP}
    done = subprocess.run(
        [sys.executable, str(HERE / "serve_worker.py")],
        env={**base, "VLLM_CACHE_ROOT": str(cache_root),
             "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache),
             "PYTHONPATH": str(HERE.parents[2]), **env},
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    result = json.loads(lines[-1][len(RESULT):]) if lines else None
    return done.returncode, result, done.stderr


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
    from vllm_neuron.snapshot.context import SnapshotForwardContext, forward_context

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(4, 32)
    compiled = torch.compile(model, backend="vllm_neuron")
    with torch.no_grad():
        matched = bool(torch.allclose(compiled(x), model(x), rtol=1e-5, atol=1e-5))
        if os.environ.get("VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_ENABLE"):
            # Forwards as a model runner publishes them (the first call above was warm-up):
            # input snapshot capture selects these.
            for step in range(3):
                with forward_context(SnapshotForwardContext(step=step)):
                    out = compiled(x)
                matched = matched and bool(torch.allclose(out, model(x), rtol=1e-5, atol=1e-5))
    runtime = get_runtime()
    from torch._inductor import codecache

    print(RESULT + json.dumps({
        "matched": matched,
        "sources": [graph.result.source for graph in runtime.history],
        "keys": [graph.key for graph in runtime.history],
        "local_dir": runtime.cache.local_dir,
        "warnings": warnings.messages,
        # Where Inductor's cache and torch's precompiled headers were (node_files.py).
        "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "headers": getattr(codecache, "_HEADER_DIR", None),
        "header_files": (sorted(os.listdir(codecache._HEADER_DIR))
                         if os.path.isdir(codecache._HEADER_DIR) else []),  # none built: a hit
    }), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
