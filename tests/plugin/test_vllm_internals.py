"""vLLM's private names behind the fence (vllm_neuron/vllm_internals.py), at the pinned vLLM.

One process of the vLLM environment (vllm_fence_probe.py) checks every fenced name (the
canary: there, of its kind, with the signatures the package overrides or calls), then removes
each in turn from its module, as a vLLM that moved it would, imports the plugin anew and shows
it still loads and degrades as the fence says: host mode off, vLLM's own compile, vLLM's own
worker, vLLM's own embedding, no settings registered; one warning naming it; never a crash.
No server is started.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from vllm_neuron.envs import OWN_SETTINGS
from vllm_neuron.vllm_internals import FENCED

pytestmark = pytest.mark.vllm

PROBE = Path(__file__).with_name("vllm_fence_probe.py")
HOST = "vllm_neuron.plugin.platform.NeuronHostPlatform"
ADAPTOR = "vllm_neuron.plugin.compiler.NeuronCompilerAdaptor"
WORKER = "vllm_neuron.plugin.worker.NeuronHostWorker"
EMBEDDING = (
    "vllm.model_executor.custom_op.", "vllm.distributed.tensor_model_parallel_all_reduce",
    "vllm.model_executor.layers.",
)


def _degraded(qualname: str, baseline: dict[str, object]) -> dict[str, object]:
    """What the plugin does without `qualname` (the fence's `without`), from the baseline."""
    out = dict(baseline)
    if qualname == "vllm.platforms.cpu.CpuPlatform":
        out["platform"] = None
        del out["backend"]
    elif qualname in ("vllm.compilation.compiler_interface.CompilerInterface",
                      "vllm.config.CompilationMode"):
        out["backend"] = "inductor"  # vLLM's CPU platform's own
    elif qualname == "vllm.v1.worker.cpu_worker.CPUWorker":
        out["worker"] = None  # as vLLM's CPU platform, which names that path
    elif qualname == "vllm.envs.environment_variables":
        out["registered"] = 0
        out["model_info"] = [False, False]  # vLLM's VLLM_CACHE_ROOT cannot be read either
    elif qualname.startswith(EMBEDDING):
        out["embedding"] = False
    elif qualname.endswith("._LazyRegisteredModel"):
        out["model_info"] = [False, False]  # nothing carried: vLLM inspects on its own
    elif qualname.endswith(("._ModelInfo", ".AttnTypeStr", "PoolingType")):
        out["model_info"] = [True, True]  # no carried file is believed
    elif qualname.endswith("._run_in_subprocess"):
        out["inspects_in_process"] = False  # vLLM's subprocess inspects
    return out


def test_every_fenced_vllm_name_is_there_and_each_missing_one_degrades(
        vllm_python: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    proc = subprocess.run([str(vllm_python), str(PROBE)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=vllm_python.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FENCE "))
    report = json.loads(line.removeprefix("FENCE "))
    # The canary: every name as fenced at the pinned vLLM, and none feeds a cache key.
    assert report["canary"] == {q: None for q in FENCED}
    assert report["feeds_key"] == []
    # What the plugin replaces has one caller in vLLM, the one it was written for.
    assert report["callers"] == {
        "_run_in_subprocess": ["model_executor/models/registry.py:inspect_model_cls"]}
    baseline = report["baseline"]
    assert baseline == {"platform": HOST, "backend": ADAPTOR, "worker": WORKER,
                        "embedding": True, "registered": len(OWN_SETTINGS), "ranks": [0, 1],
                        "model_info": [True, False], "inspects_in_process": True}
    assert report["baseline_warnings"] == 0
    assert sorted(report["missing"]) == sorted(FENCED)
    for qualname, outcome in report["missing"].items():
        assert outcome.pop("warned") == 1, (qualname, outcome)
        assert outcome == _degraded(qualname, baseline), qualname
