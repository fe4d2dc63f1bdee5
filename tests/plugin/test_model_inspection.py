"""vLLM's inspection of a model class in the process that asks, in host mode
(vllm_neuron/plugin/model_inspection.py), with vLLM's own registry in the vLLM environment
(model_inspection_probe.py); no server is started. The serve tests start real servers with
the plugin, whose first start of a model inspects it this way."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

PROBE = Path(__file__).with_name("model_inspection_probe.py")
FILE = "vllm-model_executor-models-llama-LlamaForCausalLM.json"


def _probe(vllm_python: Path, tmp_path: Path, mode: str, **env: str) -> dict[str, object]:
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("VLLM_", "NEURON_LIBTORCH_", "_VLLM_NEURON_"))}  # fmt: skip
    environ.update(VLLM_CACHE_ROOT=str(tmp_path / "cache"), **env)
    proc = subprocess.run([str(vllm_python), str(PROBE), mode], env=environ,
                          capture_output=True, text=True, timeout=600, cwd=vllm_python.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("INSPECTION "))
    return dict(json.loads(line.removeprefix("INSPECTION ")))


def test_in_host_mode_vllm_inspects_here_with_its_own_answer(
        vllm_python: Path, tmp_path: Path) -> None:
    out = _probe(vllm_python, tmp_path, "host", VLLM_NEURON_HOST_MODE="1")
    assert out["replaced"]
    # vLLM's own call, as it builds a configuration: no second interpreter, the answer its
    # subprocess gives, kept in vLLM's cache as vLLM keeps it.
    assert out["processes_started"] == 0
    assert out["same_answer"] and out["architecture"] == "LlamaForCausalLM"
    assert out["vllm_cached"] == [FILE]
    # An inspection that fails here is vLLM's again: its subprocess answers, said once.
    assert out["fallback"] == 42 and out["fallback_processes"] == 1
    warnings = out["warnings"]
    assert isinstance(warnings, list) and len(warnings) == 1, warnings
    assert "an import that fails in this process" in warnings[0]
    assert "vLLM inspects it in its subprocess" in warnings[0]


@pytest.mark.parametrize(("mode", "env"), [
    ("off", {"VLLM_NEURON_HOST_MODE": "0"}),
    ("off", {"VLLM_NEURON_HOST_MODE": "1", "_VLLM_NEURON_WITHOUT": "in-process-inspection"}),
    ("gpu-build", {"VLLM_NEURON_HOST_MODE": "1"}),
], ids=["host-mode-off", "ab-without", "gpu-build"])
def test_elsewhere_vllm_keeps_its_subprocess(
        vllm_python: Path, tmp_path: Path, mode: str, env: dict[str, str]) -> None:
    assert _probe(vllm_python, tmp_path, mode, **env) == {"replaced": False}
