"""Records the storage layer wrote before its records were tagged still read.

The files under ``data/records/`` were written by the code of commit 6d14dc9, before every
persisted object became a tagged, versioned record; they are never regenerated. A lease or
commit record in that form must keep working: a deployment upgrades one node at a time, so
a new reader meets the old writers' files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_neuron.backends import LeaseLock, LockTimeout, open_store
from vllm_neuron.backends import locks as locks_module

DATA = Path(__file__).parent / "data" / "records"


def fixture(name: str) -> bytes:
    return (DATA / name).read_bytes()


def test_an_old_commit_record_still_publishes_its_version() -> None:
    store = open_store("memory://")
    record = fixture("commit.json")
    version = json.loads(record)["version"]
    store.write(f"entry/.v/{version}/a.txt", b"a")
    store.write("entry/.commit", record)
    assert store.published("entry") == f"entry/.v/{version}"
    assert store.published_children() == ["entry"]
    assert store.unpublish("entry")
    assert store.published("entry") is None


def test_an_old_held_lease_is_honoured_until_it_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store("memory://")
    record = fixture("lease-held.json")
    store.write(".locks/k/000000000001", record)
    expires = json.loads(record)["expires"]
    lease = LeaseLock(store, ".locks/k", lease_duration=60)
    monkeypatch.setattr(locks_module.time, "time", lambda: expires - 10)
    with pytest.raises(LockTimeout):
        lease.acquire(timeout=0)
    monkeypatch.setattr(locks_module.time, "time", lambda: expires + 10)
    lease.acquire(timeout=0)
    try:
        assert lease.generation == 2
    finally:
        lease.release()


def test_an_old_released_lease_is_free() -> None:
    store = open_store("memory://")
    store.write(".locks/k/000000000001", fixture("lease-released.json"))
    with LeaseLock(store, ".locks/k", lease_duration=60, timeout=0) as lease:
        assert lease.generation == 2
        lease.check()
