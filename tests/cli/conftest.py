"""Fixtures of the command-line tests (their world of tiers is `cli_world`)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "compile", "helpers"))

from compile_fixtures import cache_warnings, compile_fn, shared_remote  # noqa: E402, F401


@pytest.fixture
def no_remote_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEURON_LIBTORCH_REMOTE_CACHE", raising=False)
    monkeypatch.delenv("VLLM_NEURON_CACHE_MAX_SIZE", raising=False)
    monkeypatch.delenv("VLLM_NEURON_FAULT", raising=False)
