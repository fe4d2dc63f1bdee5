"""Records the storage layer wrote before its records were tagged still read.

The files under ``data/records/`` were written by the code of commit 6d14dc9, before every
persisted object became a tagged, versioned record (``lease-*-tagged.json``: by commit 53498bb,
tagged, before a lease record counted its renewals); they are never regenerated. A lease or
commit record in that form must keep working: a deployment upgrades one node at a time, so
a new reader meets the old writers' files.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from lease_clocks import Clocks

from vllm_neuron.backends import LeaseLock, LockTimeout, open_store
from vllm_neuron.backends.records import LEASE_RECORDS

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


def test_an_old_held_lease_is_honoured_for_one_period_from_first_sight(clocks: Clocks) -> None:
    """A held record of the old form (no `renewal`, no `duration`) is watched like any
    other: held for one of this lock's periods from the first look, whatever its `expires`
    (the old holder's wall clock) says, and taken over from its owner then."""
    store = open_store("memory://")
    record = fixture("lease-held.json")
    store.write(".locks/old-held/000000000001", record)
    lease = LeaseLock(store, ".locks/old-held", lease_duration=60)
    expires = json.loads(record)["expires"]
    for wall in (expires - 3600, expires + 3600):  # its expiry an hour ahead, an hour ago
        with clocks.wall(wall - time.time()), pytest.raises(LockTimeout):
            lease.acquire(timeout=0)
    clocks.advance(59.9)
    with pytest.raises(LockTimeout):
        lease.acquire(timeout=0)
    clocks.advance(0.1)
    lease.acquire(timeout=0)
    try:
        assert lease.generation == 2
        assert lease.took_over_from == json.loads(record)["owner"]
    finally:
        lease.release()


@pytest.mark.parametrize("name", ["lease-held-tagged.json", "lease-released-tagged.json"])
def test_a_tagged_lease_from_before_renewal_counters_still_reads(name: str) -> None:
    """Written by the code of commit 53498bb, before `renewal` and `duration`: both read as
    0 (a waiter then uses its own period)."""
    data = fixture(name)
    record = LEASE_RECORDS.decode(data)
    raw = json.loads(data)
    assert (record.owner, record.generation, record.expires, record.released) == (
        raw["owner"], raw["generation"], raw["expires"], raw["released"])
    assert (record.renewal, record.duration) == (0, 0.0)


def test_an_old_released_lease_is_free() -> None:
    store = open_store("memory://")
    store.write(".locks/k/000000000001", fixture("lease-released.json"))
    with LeaseLock(store, ".locks/k", lease_duration=60, timeout=0) as lease:
        assert lease.generation == 2
        lease.check()
