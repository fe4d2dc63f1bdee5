"""Fixtures for the manifest tests: a real compile-cache entry with Neuron-shaped artifacts."""

from __future__ import annotations

import os

import pytest
from manifest_fixtures import SEED_KEY, neuron_like_compile

from vllm_neuron.compile.cache import TwoTierCache


@pytest.fixture
def cache_root(tmp_path: object) -> str:
    root = os.path.join(str(tmp_path), "compile_cache")
    TwoTierCache(root, toolchain="neuron", target="trn2").get_or_compile(
        SEED_KEY, neuron_like_compile(SEED_KEY)
    )
    return root
