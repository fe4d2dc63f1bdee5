"""The compile-cache tests' fixtures, shared by tests/compile and tests/cli (their conftests
import them; a conftest cannot be imported by name, every test folder has one)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from cache_workers import fake_compile

from vllm_neuron.compile.flow.cache import CompileFn


@pytest.fixture
def compile_fn() -> Callable[..., CompileFn]:
    """``compile_fn(key, **options)``: a fake compile of `key` (see cache_workers)."""

    def make(key: str, **options: Any) -> CompileFn:
        return lambda out: fake_compile(out, key=key, **options)

    return make


@pytest.fixture
def cache_warnings(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The WARNING-or-worse messages the compile cache logged so far in this test."""
    caplog.set_level(logging.WARNING, logger="vllm_neuron.compile")

    def messages() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name.startswith("vllm_neuron.compile") and r.levelno >= logging.WARNING
        ]

    return messages


@pytest.fixture(params=["folder", "s3"])
def shared_remote(request: pytest.FixtureRequest, tmp_path: Any) -> dict[str, Any]:
    """A fleet's remote tier, for worker processes: where it is, and how a worker opens it.

    The folder remote uses leases, not kernel locks, as on NFS or FSx: nodes share no
    kernel there, and a lease is what expires when a holder dies.
    """
    if request.param == "folder":
        return {"remote": str(tmp_path / "remote"), "remote_options": {"lock": "lease"}}
    request.getfixturevalue("s3_env")  # AWS_ENDPOINT_URL for the workers
    return {"remote": request.getfixturevalue("s3_store_url"), "remote_options": {}}
