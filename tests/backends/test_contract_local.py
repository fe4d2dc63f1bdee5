"""The store contract on local disk, in each of its profiles (forced, so they run here)."""

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_neuron.backends import Store, open_store
from vllm_neuron.backends.errors import RecordTooLarge
from vllm_neuron.backends.testing import StoreContractTests


class TestLocalStore(StoreContractTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        store = open_store(tmp_path / "store", profile="local")
        assert store.capabilities.kernel_locks and store.capabilities.atomic_rename
        return store


class TestNfsProfileStore(StoreContractTests):
    """NFS: rename publication, fsync before it, leases instead of flock."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        store = open_store(tmp_path / "store", profile="nfs")
        assert store.capabilities.profile == "nfs" and not store.capabilities.kernel_locks
        return store


class TestLustreProfileStore(StoreContractTests):
    """FSx/Lustre mounted without ``flock``: leases."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        store = open_store(tmp_path / "store", profile="lustre")
        assert store.capabilities.profile == "lustre" and not store.capabilities.kernel_locks
        return store


class TestLustreKernelLockStore(StoreContractTests):
    """FSx/Lustre mounted with ``flock``: kernel locks."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        store = open_store(tmp_path / "store", profile="lustre", lock="kernel")
        assert store.capabilities.profile == "lustre" and store.capabilities.kernel_locks
        return store


def test_in_flight_temp_files_are_not_keys(tmp_path: Path) -> None:
    """A writer's temp file (or a crashed writer's leftover) is never listed as a key."""
    store = open_store(tmp_path / "store")
    store.write("d/k", b"v")
    leftovers = [
        "d/k.0123456789abcdef-7.partial",  # LocalStore's own temp names
        "d/k.0123456789abcdef0123456789abcdef.partial",  # get_file / copy_tree temp names
    ]
    for name in leftovers:
        (tmp_path / "store" / name).write_bytes(b"half")
    store.write("d/user.partial", b"a key that merely ends in .partial")
    assert store.list("") == ["d/k", "d/user.partial"]
    assert store.list_dir("d") == ["k", "user.partial"]
    assert store.read("d/k") == b"v"


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store", profile="nfs")  # the fsync path too
    for i in range(20):
        store.write("a/b/k", b"%d" % i)
        store.create(f"a/c{i}", b"x")
        store.create(f"a/c{i}", b"y")
    names = sorted(p.name for p in (tmp_path / "store" / "a").iterdir())
    assert names == sorted(["b", *[f"c{i}" for i in range(20)]])
    assert [p.name for p in (tmp_path / "store" / "a" / "b").iterdir()] == ["k"]


def test_read_goes_on_to_the_end_of_a_file_that_grew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`read` sizes its buffer with fstat; a file appended to since (a log segment) or a
    short read must still come back whole, never truncated."""
    store = open_store(tmp_path / "store")
    data = os.urandom(300_000)
    store.write("segment.jsonl", data)
    stale = SimpleNamespace(st_size=1000, st_mode=stat.S_IFREG | 0o644)  # before the appends
    monkeypatch.setattr(os, "fstat", lambda fd: stale)
    assert store.read("segment.jsonl") == data
    # A bounded read (a record) of a file that grew past the bound stops one byte past it.
    reads: list[int] = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    with pytest.raises(RecordTooLarge, match="grew past"):
        store.read("segment.jsonl", max_size=5000)
    assert sum(reads) <= 5001
