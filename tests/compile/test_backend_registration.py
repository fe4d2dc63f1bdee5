"""``backend="vllm_neuron"`` is known to torch.compile with and without importing us."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
import torch
from torch._dynamo.backends.registry import lookup_backend
{pre}
fn = lookup_backend("vllm_neuron")
print(fn.__module__ + "." + fn.__name__)
assembly = sys.modules.get("vllm_neuron.assembly")
print(assembly is not None and assembly._RUNTIME is not None)
"""


@pytest.mark.parametrize("pre", ["", "import vllm_neuron"], ids=["entry-point", "import"])
def test_backend_is_registered(pre):
    proc = subprocess.run([sys.executable, "-c", PROBE.format(pre=pre)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    name, runtime_loaded = proc.stdout.split()
    assert name == "vllm_neuron.dynamo_backend.vllm_neuron_backend"
    assert runtime_loaded == "False"  # registering the backend builds no runtime yet


COMPILE_WITHOUT_IMPORT = """
import torch
from torch._dynamo.backends.registry import list_backends
assert "vllm_neuron" in list_backends()  # discovered through the entry point
import vllm_neuron  # importing after discovery must not break dynamo's own registration
from torch._dynamo.backends.registry import lookup_backend
print(lookup_backend("vllm_neuron").__name__)
"""


def test_import_after_entry_point_discovery():
    proc = subprocess.run([sys.executable, "-c", COMPILE_WITHOUT_IMPORT], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["vllm_neuron_backend"]
