"""vLLM's own platform selection with this package installed, on a (fake) Neuron host.

Runs vLLM's real `resolve_current_platform_cls_qualname` (the vLLM environment of the
``vllm`` tests) with device detection pointed at a directory holding ``neuron0``: outside
host mode vLLM must select exactly what it selects without this package (here its CPU
platform), and the package says once that it steps aside.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

SELECT = """
import sys
import vllm_neuron.plugin as plugin
plugin.DEVICE_DIR = sys.argv[1]  # the module vLLM's entry point loads: the same object
from vllm.platforms import resolve_current_platform_cls_qualname
print("SELECTED", resolve_current_platform_cls_qualname())
"""


def select(vllm_python: Path, dev: Path, **extra: str) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_NEURON_HOST_MODE", "VLLM_TARGET_DEVICE", "VLLM_PLUGINS")}
    env.update(extra)
    proc = subprocess.run([str(vllm_python), "-c", SELECT, str(dev)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    selected = [line.split()[1] for line in proc.stdout.splitlines()
                if line.startswith("SELECTED ")]
    assert len(selected) == 1, proc.stdout
    return selected[0], proc.stderr


def test_vllm_selects_its_own_platform_on_a_neuron_host(vllm_python: Path, tmp_path: Path) -> None:
    (tmp_path / "neuron0").touch()
    selected, log = select(vllm_python, tmp_path)
    assert selected == "vllm.platforms.cpu.CpuPlatform"  # what vLLM picks without us
    assert log.count("this package claims no vLLM platform here") == 1
    selected, log = select(vllm_python, tmp_path, VLLM_NEURON_HOST_MODE="1")
    assert selected == "vllm_neuron.plugin.platform.NeuronHostPlatform"
    assert "claims no vLLM platform" not in log
