"""The README's main command: ``vllm-neuron demo`` (python3 dev.py demo) on a fresh machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_runs_end_to_end_and_prints_its_table(tmp_path):
    env = dict(os.environ)
    for name in ("NEURON_LIBTORCH_REMOTE_CACHE", "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE",
                 "VLLM_NEURON_DISABLE_WARMUP_COMPILE", "VLLM_CACHE_ROOT"):
        env.pop(name, None)
    env["VLLM_NEURON_TOOLCHAIN"] = "host"
    workdir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_neuron.cli", "demo", "--workdir", str(workdir)],
        env=env, capture_output=True, text=True, timeout=840, cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("STEP"))
    assert "SOURCE" in lines[header] and "COMPILES" in lines[header]
    rows = {line.split("  ")[0]: line for line in lines[header + 2 : header + 5]}
    assert set(rows) == {"cold process", "second process", "new node, shared remote"}
    assert "compiled" in rows["cold process"]
    assert " local " in rows["second process"] + " "
    assert "remote" in rows["new node, shared remote"]
    assert all(row.rstrip().endswith("ok") for row in rows.values()), rows
    assert "demo passed" in proc.stdout
    # Node C fetched, it did not compile: its local tier holds the promoted entries.
    node_c = workdir / "node-c" / "neuron" / "compile_cache"
    assert [p for p in os.listdir(node_c) if not p.startswith(".")]
