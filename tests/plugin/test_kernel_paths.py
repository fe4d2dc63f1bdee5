"""vLLM's CPU kernel paths in real vLLM processes: forcing the AVX2 one works on any CPU, and
this package loads the library vLLM picks (tests/cpu_kernels.py).

`vllm-neuron debug env` in the vLLM environment loads vLLM's kernels the way vLLM does
(``current_platform.import_kernels()``) and names the library it got: ``_C_AVX2`` on the
AVX2 path, whatever the CPU; on an AVX-512 CPU's own path, that CPU's build. The same
function loads the kernels of a replay's rank workers, which imported ``vllm._C`` by name
before, and died of SIGILL on AVX2-only CPUs.
"""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest
from cpu_kernels import AVX2, kernel_env, kernel_paths, native_path, note
from plugin_support import ROOT, server_env

LIBRARY = {"avx2": "_C_AVX2.abi3.so", "avx512": "_C_AVX512.abi3.so",
           "avx512-bf16": "_C.abi3.so"}  # fmt: skip


@pytest.mark.vllm
@pytest.mark.parametrize("path", kernel_paths())
def test_debug_env_names_the_kernel_library_vllm_loads(path: str, vllm_python: Path) -> None:
    done = subprocess.run(
        [str(vllm_python), "-m", "vllm_neuron.cli", "debug", "env", "--json"],
        cwd=ROOT, env=server_env(kernel_env(path)), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["vllm"] == "0.32.0"
    assert found["vllm_kernels"] == LIBRARY[path], found
    features = found["key_versions"]["cpu_features"].split(",")
    if path == AVX2:  # what the key's target is made of: the CPU vLLM and Inductor see
        assert found["cpu_capability"] == "AVX2" and "avx512" not in features, found
    else:
        assert "avx512" in features, found
    note("debug env in the vLLM environment", path)


def test_nothing_imports_an_isa_specific_vllm_library() -> None:
    """The class of the two red suites: no module imports vLLM's kernel library by name
    (``vllm._C`` is the AVX-512-BF16 build); op_libraries.import_vllm_kernels asks vLLM."""
    offenders = []
    for source in sorted((ROOT / "vllm_neuron").rglob("*.py")):
        tree = ast.parse(source.read_text(), str(source))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Call) and node.args and isinstance(
                node.args[0], ast.Constant
            ) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
                names = [str(node.args[0].value)]
            if any(n == "vllm._C" or n.startswith("vllm._C_") or n.startswith("vllm._C.")
                   for n in names):  # fmt: skip
                offenders.append(f"{source.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], offenders
    assert native_path() in LIBRARY
