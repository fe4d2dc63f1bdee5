"""`vllm-neuron debug env`: this machine as the compile cache sees it (what a bug report needs)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import torch

from vllm_neuron.compile.toolchains.host import HostToolchain


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "debug", "env", *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_json_names_the_cpu_the_toolchain_and_what_enters_the_key() -> None:
    done = run("--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert found["torch"] == torch.__version__
    # No vLLM in the test environment: said, not an error.
    assert found["vllm"] is None and found["vllm_kernels"] == "vLLM not installed"
    assert found["toolchain"] == "host" and found["target"] == HostToolchain().target
    assert found["key_versions"] == HostToolchain().versions()
    assert found["compiler_args"] == []


def test_the_table_says_the_same() -> None:
    table = run()
    document = json.loads(run("--json").stdout)
    assert table.returncode == 0, table.stderr
    rows = dict(re.findall(r"^(\S.*?)  +(\S.*)$", table.stdout, re.M))
    assert rows["cpu_capability"] == document["cpu_capability"]
    assert rows["toolchain"] == document["toolchain"]
    for name, value in document["key_versions"].items():
        assert rows[f"key version {name}"] == value
    assert "enter every cache key" in table.stdout
