"""Fixtures for the storage-layer tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from worker_pool import Workers  # tests/backends/worker_pool.py


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    pool = Workers(tmp_path)
    try:
        yield pool
    finally:
        pool.close()
