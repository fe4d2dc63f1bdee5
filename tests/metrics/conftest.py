"""Fixtures of the metrics tests: a live-metrics install undone after each test."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_neuron.compile.tiers.local import EVENT_OBSERVERS  # noqa: E402
from vllm_neuron.metrics import uninstall  # noqa: E402


@pytest.fixture(autouse=True)
def no_live_metrics_left() -> Iterator[None]:
    """A test that installs the live counters leaves no observer in this process."""
    before = list(EVENT_OBSERVERS)
    yield
    uninstall()
    EVENT_OBSERVERS[:] = before
