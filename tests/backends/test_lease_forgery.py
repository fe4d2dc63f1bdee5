"""A lease directory written by someone without the lease: forged records, junk names.

Anyone who can write the store can write ``.locks/<name>/``. What they leave there costs a
waiter at most one of its own lease periods (backends/locks.py, "A malformed lease is held by
an unknown owner"): a record claiming a ten-year period, a name that is no generation, a
record that does not decode, a directory in a record's place. Never an exception out of a
look (a caller would take the whole store for down), never a wait without end.

The clocks of backends/locks.py are in the test's hands (lease_clocks.py): "one period
later" is a number the test adds. Each case runs on the memory store, a folder and S3
(moto's real HTTP API).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest
from lease_clocks import Clocks

from vllm_neuron.backends import LeaseLock, LeaseLost, LeaseUnusable, LockTimeout, locks, open_store
from vllm_neuron.backends.locks import generation_of
from vllm_neuron.backends.records import LeaseRecord, RecordError, encode

PERIOD = 10.0
TEN_YEARS = 10 * 365 * 86400.0


@pytest.fixture(params=["memory", "folder", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    if request.param == "memory":
        return open_store("memory://")
    if request.param == "folder":
        return open_store(str(tmp_path / "store"))
    url = request.getfixturevalue("s3_store_url")
    return open_store(url, endpoint_url=request.getfixturevalue("s3_server"))


def lease(store: Any, name: str) -> LeaseLock:
    return LeaseLock(store, f".locks/{name}", lease_duration=PERIOD)


def refused(waiter: LeaseLock) -> bool:
    try:
        waiter.acquire(timeout=0)
    except LockTimeout:
        return True
    return False


def unique() -> str:
    return uuid.uuid4().hex[:12]  # sightings are per process: no test sees another's


def forged(store: Any, name: str, generation: int, **fields: Any) -> str:
    record = LeaseRecord(**{"owner": "mallory:1:forged", "generation": generation,
                            "expires": 4102444800.0, "renewal": 1, **fields})  # fmt: skip
    store.write(f".locks/{name}/{generation:012d}", encode(record))
    return str(record.owner)


@pytest.mark.parametrize("duration", [TEN_YEARS, 1e9, 1e308])  # JSON has no inf nor NaN
def test_a_forged_record_claiming_a_long_period_is_held_one_period_of_the_waiters(
    store: Any, clocks: Clocks, duration: float
) -> None:
    name = unique()
    owner = forged(store, name, 7, duration=duration)
    waiter = lease(store, name)
    assert refused(waiter)
    assert waiter.seconds_until_free() == PERIOD  # not what the record claims
    assert waiter.busy()
    clocks.advance(PERIOD - 0.01)
    assert refused(waiter)
    clocks.advance(0.01)
    waiter.acquire(timeout=0)
    assert waiter.generation == 8 and waiter.took_over_from == owner
    waiter.check()  # fencing: the taker's generation is the latest
    waiter.release()


@pytest.mark.parametrize("junk", [
    "\u00b2",  # superscript two: str.isdigit(), but int() refuses it
    "\u0661\u0662\u0663",  # Arabic-Indic digits: int() reads 123, no record is named so
    "1e9", "notes.txt", "0000000000001",  # 13 digits: not how a generation is written
    "000000000000",  # generation 0 is never written
    "9" * 200,  # more digits than any generation
    "9" * 18,  # above MAX_GENERATION: its successor would have no name a generation may have
])  # fmt: skip
def test_a_directory_of_junk_names_is_busy_one_period_then_taken(
    store: Any, clocks: Clocks, junk: str
) -> None:
    name = unique()
    store.write(f".locks/{name}/{junk}", b"junk")
    waiter = lease(store, name)
    assert refused(waiter)  # held by an unknown owner ...
    assert waiter.busy()
    assert waiter.seconds_until_free() == PERIOD
    clocks.advance(PERIOD / 2)
    store.write(f".locks/{name}/more-{unique()}", b"junk")  # new junk restarts nothing
    assert refused(waiter)
    clocks.advance(PERIOD / 2)
    waiter.acquire(timeout=0)  # ... for one period
    assert waiter.generation == 1 and waiter.took_over_from == "an unreadable lease"
    waiter.check()
    other = lease(store, name)  # the junk stays; the lease is judged by its records now
    assert refused(other)
    waiter.release()
    other.acquire(timeout=0)
    assert other.generation == 2 and other.took_over_from is None
    other.release()


def test_junk_beside_a_live_holders_record_changes_nothing(store: Any, clocks: Clocks) -> None:
    name = unique()
    holder = lease(store, name)
    holder.acquire(timeout=0)
    holder._stop.set()  # its renewals are the test's calls
    assert holder._heartbeat is not None
    holder._heartbeat.join(timeout=30)
    store.write(f".locks/{name}/\u00b2", b"junk")
    store.write(f".locks/{name}/{'9' * 40}", b"junk")
    waiter = lease(store, name)
    for _ in range(3):
        assert refused(waiter)
        clocks.advance(0.9 * PERIOD)
        assert refused(waiter)
        assert holder._renew()
    holder.check()
    holder.release()
    waiter.acquire(timeout=0)  # released: free at once, junk or not
    assert waiter.took_over_from is None
    waiter.release()


@pytest.mark.parametrize("kind", ["undecodable", "directory", "empty"])
def test_a_latest_record_that_does_not_read_is_busy_one_period_then_taken(
    store: Any, clocks: Clocks, kind: str
) -> None:
    name = unique()
    where = f".locks/{name}/000000000003"
    if kind == "undecodable":
        store.write(where, b"\xff\x00 not a record {[")
    elif kind == "directory":
        store.write(f"{where}/inside", b"a directory where the record should be")
    else:
        store.write(where, b"")
    waiter = lease(store, name)
    assert refused(waiter)
    assert waiter.busy()
    clocks.advance(PERIOD)
    assert not waiter.busy()
    waiter.acquire(timeout=0)
    assert waiter.generation == 4 and waiter.took_over_from == "an unreadable lease"
    waiter.check()
    waiter.release()


def test_a_forged_newer_generation_fences_the_holder_out(store: Any, clocks: Clocks) -> None:
    """A forged record one generation up is a takeover as far as the holder can tell: it
    promotes nothing (`LeaseLost`), and renews nothing over it - the writer can make the
    fleet compile again, never make two holders."""
    name = unique()
    holder = lease(store, name)
    holder.acquire(timeout=0)
    forged(store, name, holder.generation + 1, duration=TEN_YEARS)
    with pytest.raises(LeaseLost):
        holder.check()
    holder.release()


def test_generation_names() -> None:
    assert generation_of("000000000001") == 1
    assert generation_of("123456789012345") == 123456789012345
    for name in ("1", "000000000000", "0000000000001", "\u00b2" * 12, "\u0661" * 12,
                 "1234567890123456789", "123456789012345678", "999999999999999999",
                 "00000000001a", " 00000000001"):
        assert generation_of(name) is None, name


def test_an_over_full_lease_folder_is_busy_one_period_then_unusable(
    store: Any, clocks: Clocks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Millions of names planted in ``.locks/<name>/`` (here the bound made small) are never
    listed whole: the lease is held one period by an unknown owner, then `acquire` says it
    cannot be used (a `RecordError`: the key's defect) - never a wait without end, never an
    outage, nothing written."""
    monkeypatch.setattr(locks, "LEASE_MAX_NAMES", 5)
    name = unique()
    for i in range(6):
        store.write(f".locks/{name}/junk-{i}", b"junk")
    listed: list[int | None] = []
    real = store.list_dir

    def spy(prefix: str = "", *, max_names: int | None = None) -> list[str]:
        listed.append(max_names)
        return real(prefix, max_names=max_names)

    monkeypatch.setattr(store, "list_dir", spy)
    waiter = lease(store, name)
    assert refused(waiter) and waiter.busy()
    assert listed and set(listed) == {5}  # every look is bounded
    clocks.advance(PERIOD)
    with pytest.raises(RecordError, match="more than the 5 names"):
        waiter.acquire(timeout=0)
    assert not waiter.held
    assert sorted(real(f".locks/{name}")) == [f"junk-{i}" for i in range(6)]  # none written


def test_a_lease_folder_linked_out_of_a_folder_store_is_never_written(
    tmp_path: Any, clocks: Clocks
) -> None:
    """``.locks/<name>`` a symbolic link to a folder outside the store: our records would be
    written (and old ones deleted) there. Held one period, then unusable; the folder it
    leads to stays untouched."""
    store = open_store(str(tmp_path / "store"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "000000000001").write_bytes(b"node-local, not a lease")
    name = unique()
    os.makedirs(tmp_path / "store" / ".locks")
    os.symlink(outside, tmp_path / "store" / ".locks" / name)
    waiter = lease(store, name)
    assert refused(waiter)
    clocks.advance(PERIOD)
    with pytest.raises(RecordError, match="leads out of the store"):
        waiter.acquire(timeout=0)
    assert sorted(os.listdir(outside)) == ["000000000001"]
    assert (outside / "000000000001").read_bytes() == b"node-local, not a lease"


def test_a_file_in_place_of_the_lease_directory_is_busy_one_period_then_unusable(
    store: Any, clocks: Clocks
) -> None:
    """``.locks/<name>`` planted as a file. On a folder no record can be created under it
    (ENOTDIR): busy, held by an unknown owner, for one period, then `LeaseUnusable` (the
    caller goes on without this lease) - never NotADirectoryError, which a caller would take
    for the store's outage. On S3 a key and a prefix of that name coexist: nothing is in the
    way (the bounded listing reads the prefix ``.locks/<name>/`` only), the lease is taken."""
    name = unique()
    store.write(f".locks/{name}", b"not a directory")
    waiter = lease(store, name)
    if store.url.startswith("s3://"):  # no folder in the way
        waiter.acquire(timeout=0)
        assert waiter.generation == 1
        waiter.release()
        return
    assert refused(waiter)
    assert waiter.seconds_until_free() == PERIOD
    clocks.advance(PERIOD - 0.01)
    assert refused(waiter)
    clocks.advance(0.01)
    if store.url.startswith("memory://"):  # its listing shows the file first: a junk name
        assert refused(waiter)  # for one period, then no record can be made: one more
        clocks.advance(PERIOD)
    with pytest.raises(LeaseUnusable, match="is not a directory"):
        waiter.acquire(timeout=0)
    store.delete(f".locks/{name}")  # the file gone: the lease is taken again
    waiter.acquire(timeout=0)
    assert waiter.generation == 1
    waiter.release()
