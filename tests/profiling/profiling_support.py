"""Helpers shared by the profile-capture tests (a unique module name: every test folder
has its own conftest.py, so tests import helpers from here, never from ``conftest``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DATA = HERE / "data"
FAKE_VLLM = HERE / "fake_vllm.py"


def group_alive(pgid: int) -> list[int]:
    """Live (non-zombie) members of process group `pgid`."""
    from vllm_neuron.profiling.lifecycle import group_members

    return group_members(pgid)


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()
