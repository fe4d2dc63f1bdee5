"""Fixtures for the storage-layer tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from lease_clocks import Clocks  # tests/backends/lease_clocks.py
from worker_pool import Workers  # tests/backends/worker_pool.py

from vllm_neuron.backends import locks as locks_module


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    pool = Workers(tmp_path)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def clocks(monkeypatch: pytest.MonkeyPatch) -> Clocks:
    """The clocks of backends/locks.py in the test's hands (see lease_clocks.py)."""
    fake = Clocks()
    monkeypatch.setattr(locks_module, "time", fake)
    return fake
