"""Fixtures of the input-snapshot tests: a clean process-global state around each test."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_neuron.snapshot import (  # noqa: E402
    CaptureBudget,
    RankInfo,
    SnapshotCapturer,
    SnapshotConfig,
    clear_current_forward,
    reset_snapshot_config,
    resolve_capture_spec,
)


@pytest.fixture(autouse=True)
def _clean_snapshot_state() -> Iterator[None]:
    """No cached config, budget or published forward leaks between tests."""
    reset_snapshot_config()
    clear_current_forward()
    yield
    reset_snapshot_config()
    clear_current_forward()


@pytest.fixture
def memory_root() -> str:
    """A fresh memory:// snapshot root."""
    return f"memory://snap-{uuid.uuid4().hex[:12]}"


CapturerFactory = Callable[..., SnapshotCapturer]


@pytest.fixture
def capturer_for() -> CapturerFactory:
    """``capturer_for(config, hash=..., rank=RankInfo(), budget=None, writer=None)``."""

    def make(
        config: SnapshotConfig,
        compilation_hash: str = "0123456789abcdef0123456789abcdef",
        rank: RankInfo | None = None,
        budget: CaptureBudget | None = None,
        **kwargs: object,
    ) -> SnapshotCapturer:
        spec = resolve_capture_spec(
            compilation_hash,
            config=config,
            ranks=rank or RankInfo(),
            budget=budget or CaptureBudget(config.max_captures),
        )
        assert spec is not None
        return SnapshotCapturer(spec, **kwargs)  # type: ignore[arg-type]

    return make
