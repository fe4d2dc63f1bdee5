"""Fixtures for the manifest tests: a real compile-cache entry with Neuron-shaped artifacts."""

from __future__ import annotations

import os
import uuid

import pytest
from manifest_fixtures import SEED_KEY, neuron_like_compile

from vllm_neuron.compile.flow.cache import TwoTierCache


@pytest.fixture
def cache_root(tmp_path: object) -> str:
    root = os.path.join(str(tmp_path), "compile_cache")
    TwoTierCache(root, toolchain="neuron", target="trn2").get_or_compile(
        SEED_KEY, neuron_like_compile(SEED_KEY)
    )
    return root


@pytest.fixture(autouse=True)
def engine_run(monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test is one engine run of its own, its VLLM_NEURON_RUN_ID set as vLLM's first
    process sets it (processes the test starts inherit it), and unset again afterwards, so
    no run id leaks into later tests or into the servers they start."""
    run = f"test-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("VLLM_NEURON_RUN_ID", run)
    return run
