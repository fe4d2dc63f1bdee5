"""Fixtures of the report tests: one deployment, built once, read by every test (helpers
are imported from `report_deployment` and `report_browser`, never from here: every test
folder has a conftest.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report_deployment import (  # noqa: E402
    HOSTILE_MODEL,
    Deployment,
    build_deployment,
    run_report,
)


@pytest.fixture(scope="session")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    """Node A's root (cache, manifests, snapshots, profiles) and node B's (a cache)."""
    return build_deployment(tmp_path_factory.mktemp("deployment"), model=HOSTILE_MODEL)


@pytest.fixture(scope="session")
def report_page(deployment: Deployment, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report of both nodes, replays included."""
    out = tmp_path_factory.mktemp("report") / "report.html"
    done = run_report(str(deployment.root), str(deployment.node_b), "--replay", "-o", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    return out
