"""Lint runs with the tests, so CI (the README's test command) enforces it.

ruff (style and errors), mypy (types of the package) and import-linter (the layer
contract in pyproject.toml: storage <- settings <- compile <- features <- assembly <-
entry points, and profile capture never compiling). The checkers are pinned in the
``lint`` extra, so a new release cannot turn a fresh machine red.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)


LINTED = ("vllm_neuron", "backends", "tests", "benchmarks", "dev.py", ".ci/vllm_env.py",
          ".ci/tiny_model.py")


def test_ruff_is_clean() -> None:
    done = run(sys.executable, "-m", "ruff", "check", *LINTED)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_is_clean() -> None:
    done = run(sys.executable, "-m", "mypy", "vllm_neuron")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_layer_contract_is_kept() -> None:
    done = run(str(BIN / "lint-imports"), "--no-cache")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout, done.stdout
