"""A lease's expiry is judged on the waiter's own monotonic clock, never on a wall clock.

Against the memory store, with the clocks of backends/locks.py in the test's hands
(lease_clocks.py): "one period later" is a number the test adds, and whose wall clock is
wrong is said around that party's calls. A holder's heartbeat thread is stopped at once
(`frozen_holder`); its renewals are the test's calls to `_renew`, so nothing here waits.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

import pytest
from lease_clocks import Clocks

from vllm_neuron.backends import LeaseLock, LeaseLost, LockTimeout, open_store
from vllm_neuron.backends.records import LEASE_RECORDS, Record, RecordCodec, Untagged
from vllm_neuron.backends.testing import HANG

PERIOD = 10.0
HOUR = 3600.0


@pytest.fixture
def store() -> Any:
    return open_store("memory://")


def lease(store: Any, name: str, period: float = PERIOD) -> LeaseLock:
    return LeaseLock(store, f".locks/{name}", lease_duration=period)


def frozen_holder(store: Any, name: str, clocks: Clocks, *, wall: float | None = None,
                  period: float = PERIOD) -> LeaseLock:  # fmt: skip
    """A holder whose wall clock is `wall` seconds off (None: as the clocks stand), its
    heartbeat thread stopped."""
    holder = lease(store, name, period)
    with clocks.wall(wall) if wall is not None else contextlib.nullcontext():
        holder.acquire(timeout=0)
    holder._stop.set()
    assert holder._heartbeat is not None
    holder._heartbeat.join(timeout=HANG)
    return holder


def refused(waiter: LeaseLock) -> bool:
    try:
        waiter.acquire(timeout=0)
    except LockTimeout:
        return True
    return False


def unique() -> str:
    return uuid.uuid4().hex[:12]  # sightings are per process: no test sees another's


@pytest.mark.parametrize("holder_wall", [-HOUR, +HOUR, 0.0])
def test_a_silent_lease_is_held_one_period_from_first_sight_whatever_its_expiry_says(
    store: Any, clocks: Clocks, holder_wall: float
) -> None:
    """The holder's clock an hour behind (its record says "expired an hour ago"), an hour
    ahead (says "an hour to go") or right: the waiter takes it over exactly one period
    after it first saw the record, and never before."""
    name = unique()
    holder = frozen_holder(store, name, clocks, wall=holder_wall)
    waiter = lease(store, name)
    assert refused(waiter)
    assert waiter.seconds_until_free() == PERIOD
    assert waiter.busy()
    clocks.advance(PERIOD - 0.01)
    assert refused(waiter)
    assert waiter.seconds_until_free() == pytest.approx(0.01)
    clocks.advance(0.01)
    assert not waiter.busy()
    waiter.acquire(timeout=0)
    assert waiter.generation == holder.generation + 1
    assert waiter.took_over_from == holder.owner
    with pytest.raises(LeaseLost):  # fencing: the old holder finds its successor
        holder.check()
    assert not holder._renew()  # ... and renews nothing over it
    waiter.check()
    waiter.release()
    holder.release()


@pytest.mark.parametrize("waiter_wall", [+HOUR, -HOUR])
def test_renewals_keep_a_lease_alive_while_the_waiters_wall_clock_is_far_off(
    store: Any, clocks: Clocks, waiter_wall: float
) -> None:
    """The waiter's clock an hour ahead (every record it reads says "expired an hour ago")
    or behind: as long as renewals come within a period, it never takes over; once they
    stop, one period after the last one it saw."""
    name = unique()
    holder = frozen_holder(store, name, clocks)
    waiter = lease(store, name)
    for _ in range(10):  # ten periods' worth of renewals, each 0.9 period apart
        with clocks.wall(waiter_wall):
            assert refused(waiter)
        clocks.advance(0.9 * PERIOD)
        with clocks.wall(waiter_wall):
            assert refused(waiter)  # seen unchanged for 0.9 period: still held
        assert holder._renew()
    with clocks.wall(waiter_wall):
        assert refused(waiter)  # sees the last renewal
        clocks.advance(PERIOD)
        waiter.acquire(timeout=0)
    assert waiter.took_over_from == holder.owner
    waiter.release()


def test_a_renewal_counts_even_when_the_holders_clock_stands_still(
    store: Any, clocks: Clocks
) -> None:
    """Two renewals at one wall-clock instant write the same `expires`; the renewal counter
    still changes the record, so the waiter sees each one."""
    name = unique()
    with clocks.wall(frozen=1_000_000.0):
        holder = frozen_holder(store, name, clocks)
        waiter = lease(store, name)
        first = store.read(holder._key(holder.generation))
        assert refused(waiter)
        clocks.advance(0.9 * PERIOD)
        assert holder._renew()
        second = store.read(holder._key(holder.generation))
        assert LEASE_RECORDS.decode(first).expires == LEASE_RECORDS.decode(second).expires
        assert first != second
        assert refused(waiter)
        clocks.advance(0.9 * PERIOD)  # 1.8 periods since the first sight: renewed meanwhile
        assert refused(waiter)
    holder.release()


def test_a_released_lease_is_free_at_once_and_none_is_free(store: Any, clocks: Clocks) -> None:
    name = unique()
    waiter = lease(store, name)
    assert not waiter.busy()
    holder = frozen_holder(store, name, clocks, wall=+HOUR)
    assert refused(waiter)
    holder.release()
    waiter.acquire(timeout=0)  # no period to wait: it was let go
    assert waiter.took_over_from is None
    waiter.release()


def test_a_new_lock_object_goes_on_from_what_the_process_saw(store: Any, clocks: Clocks) -> None:
    """The fleet makes a lock object per wait: what an earlier one of this process saw
    counts, so a dead holder costs one period from the process's first look."""
    name = unique()
    frozen_holder(store, name, clocks)
    assert refused(lease(store, name))
    clocks.advance(0.6 * PERIOD)
    later = lease(store, name)
    assert refused(later)
    assert later.seconds_until_free() == pytest.approx(0.4 * PERIOD)
    clocks.advance(0.4 * PERIOD)
    later.acquire(timeout=0)
    later.release()


def test_the_period_is_the_holders_as_its_record_says_up_to_the_waiters_own(
    store: Any, clocks: Clocks
) -> None:
    """A holder with a shorter lease is given its own period; one whose record claims a
    longer one than the waiter's is given the waiter's: what a record says never holds a
    waiter longer than its own setting (a writer of the store can write any record)."""
    name = unique()
    holder = frozen_holder(store, name, clocks, period=PERIOD / 2)
    waiter = lease(store, name)
    assert refused(waiter)
    clocks.advance(PERIOD / 2)
    waiter.acquire(timeout=0)
    assert waiter.took_over_from == holder.owner
    waiter.release()
    holder.release()

    name = unique()
    holder = frozen_holder(store, name, clocks, period=3 * PERIOD)
    waiter = lease(store, name)
    assert refused(waiter)
    assert waiter.seconds_until_free() == PERIOD
    clocks.advance(PERIOD)
    waiter.acquire(timeout=0)
    assert waiter.took_over_from == holder.owner
    waiter.release()


def test_a_blocking_acquire_waits_out_one_period_and_no_more(store: Any, clocks: Clocks) -> None:
    name = unique()
    frozen_holder(store, name, clocks)
    waiter = lease(store, name)
    start = clocks.mono
    waiter.acquire(timeout=HANG)  # its retry loop sleeps on the test's clock
    assert PERIOD <= clocks.mono - start <= PERIOD + waiter.lease_duration / 4
    waiter.release()


def test_watching_an_unchanged_record_costs_one_read_a_look(
    store: Any, clocks: Clocks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter lists the lease once, then reads only the record it watches while that
    stays as seen or is renewed; it lists again when the record ran out."""
    name = unique()
    holder = frozen_holder(store, name, clocks)
    waiter = lease(store, name)
    calls = {"list_dir": 0, "read": 0}
    for op in calls:
        real = getattr(store, op)

        def counted(*args: Any, _op: str = op, _real: Any = real, **kwargs: Any) -> Any:
            calls[_op] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(store, op, counted)
    assert refused(waiter)
    assert calls == {"list_dir": 1, "read": 1}
    for _ in range(5):
        clocks.advance(0.1 * PERIOD)
        assert refused(waiter)
    holder._renew()
    assert refused(waiter)
    assert calls["list_dir"] == 1 + 1 and calls["read"] == 1 + 6  # the renewal's own listing
    clocks.advance(PERIOD)
    waiter.acquire(timeout=0)  # ran out: listed again, then taken
    assert calls["list_dir"] >= 3
    waiter.release()


def test_a_record_that_does_not_read_is_watched_like_any_other(
    store: Any, clocks: Clocks
) -> None:
    name = unique()
    store.write(f".locks/{name}/000000000004", b'{"type": "lease", "v": 99}')
    waiter = lease(store, name)
    assert refused(waiter)
    clocks.advance(PERIOD)
    waiter.acquire(timeout=0)
    assert waiter.generation == 5
    assert waiter.took_over_from == "an unreadable lease"
    waiter.release()


class _LeaseRecordBefore(Record, frozen=True, tag="lease"):
    """`LeaseRecord` as the versions before renewal counters declared it."""

    owner: str
    generation: int
    expires: float
    released: bool = False


def test_an_older_reader_reads_the_new_record_and_judges_it_as_before(
    store: Any, clocks: Clocks
) -> None:
    """A node not yet upgraded reads the new fields past (the version is still 1) and still
    finds a live holder's `expires` ahead of its own clock."""
    name = unique()
    holder = frozen_holder(store, name, clocks)
    data = store.read(holder._key(holder.generation))
    old = RecordCodec(_LeaseRecordBefore, untagged=Untagged("lease", 1)).decode(data)
    new = LEASE_RECORDS.decode(data)
    assert (old.owner, old.generation, old.expires, old.released) == (
        new.owner, new.generation, new.expires, new.released)
    assert new.renewal >= 1 and new.duration == PERIOD
    assert old.expires > time.time()  # what the older reader compares: held
    holder.release()
    old = RecordCodec(_LeaseRecordBefore).decode(store.read(holder._key(holder.generation)))
    assert old.released


GRACE = 600.0


def survey_says(store: Any, name: str, now: float) -> str:
    """What a survey (one look, `cache gc`) makes of the lease `name`."""
    survey = store.survey(older_than=6 * HOUR, lease_grace=GRACE, now=now)
    where = f".locks/{name}"
    if any(d.kind == "lease" and d.prefix == where for d in survey.debris):
        return "debris"
    (kept,) = [k for k in survey.kept if k.kind == "lease" and k.prefix == where]
    return "held" if kept.reason.startswith("held") else "grace"


def test_gc_never_takes_a_renewed_lease_for_dead_whatever_the_holders_clock(
    store: Any, clocks: Clocks
) -> None:
    """A survey cannot watch: it takes the later of the holder's `expires` and the record's
    last write as the store dated it (plus the holder's period). A holder whose clock is an
    hour behind (its `expires` an hour past) but that renewed just now is held; dead for
    longer than its period plus the grace on the store's clock, it is debris."""
    name = unique()
    holder = frozen_holder(store, name, clocks, wall=-HOUR)
    key = holder._key(holder.generation)
    now = time.time()
    assert survey_says(store, name, now) == "held"
    store.set_mtime(key, now - PERIOD - GRACE / 2)  # its last renewal, as the store dated it
    assert survey_says(store, name, now) == "grace"
    store.set_mtime(key, now - PERIOD - GRACE - 1)
    assert survey_says(store, name, now) == "debris"


def test_gc_keeps_the_dead_lease_of_a_holder_whose_clock_ran_ahead(
    store: Any, clocks: Clocks
) -> None:
    """The margin's price: a dead holder whose clock was an hour ahead leaves a lease the
    survey keeps until that hour (and the grace) passed; waiters take it over after one
    period all the same (they do not read `expires`)."""
    name = unique()
    holder = frozen_holder(store, name, clocks, wall=+HOUR)
    now = time.time()
    store.set_mtime(holder._key(holder.generation), now - 2 * GRACE)
    assert survey_says(store, name, now) == "held"
    assert survey_says(store, name, now + HOUR + PERIOD + GRACE + 1) == "debris"
    waiter = lease(store, name)
    assert refused(waiter)
    clocks.advance(PERIOD)
    waiter.acquire(timeout=0)
    waiter.release()
