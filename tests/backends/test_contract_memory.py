"""The store contract on the in-memory backend, and how memory stores are shared."""

import uuid

import fsspec
import pytest

from vllm_neuron.backends import Store, open_store
from vllm_neuron.backends._memory import forget_memory_store
from vllm_neuron.backends.testing import CommitRecordContractTests, StoreContractTests


class TestMemoryStore(StoreContractTests, CommitRecordContractTests):
    @pytest.fixture
    def store(self) -> Store:
        return open_store("memory://")  # anonymous: a fresh table every time


def test_named_memory_store_is_shared_by_name_only() -> None:
    name = f"shared-{uuid.uuid4().hex}"
    try:
        first, second = open_store(f"memory://{name}"), open_store(f"memory://{name}/")
        other = open_store(f"memory://{name}-other")
        first.write("k", b"v")
        assert second.read("k") == b"v"
        assert other.read("k") is None
        assert open_store("memory://").read("k") is None
        # Not fsspec's process-global memory filesystem either.
        assert not fsspec.filesystem("memory").exists(f"/{name}/k")
        with second.stage("e") as staging:
            staging.write("f", b"F")
            assert staging.commit() is True
        assert first.published("e") is not None
    finally:
        forget_memory_store(name)
    assert open_store(f"memory://{name}").read("k") is None  # forgotten: a fresh machine


def test_anonymous_memory_stores_are_independent() -> None:
    a, b = open_store("memory://"), open_store("memory://")
    a.write("k", b"a")
    assert b.read("k") is None
