"""Fixtures of the report tests: one deployment, built once, read by every test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report_deployment import Deployment, build_deployment  # noqa: E402

# A model name that would be markup if the page did not escape what it reads.
HOSTILE_MODEL = '<script>console.error("injected")</script><img src="http://x.invalid/a">'


@pytest.fixture(scope="session")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    """Node A's root (cache, manifests, snapshots, profiles) and node B's (a cache)."""
    return build_deployment(tmp_path_factory.mktemp("deployment"), model=HOSTILE_MODEL)


def run_report(*argv: str) -> subprocess.CompletedProcess[str]:
    """`vllm-neuron report ...` as a user runs it: its own process."""
    return subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "report", *argv],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def report_page(deployment: Deployment, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report of both nodes, replays included."""
    out = tmp_path_factory.mktemp("report") / "report.html"
    done = run_report(str(deployment.root), str(deployment.node_b), "--replay", "-o", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    return out
