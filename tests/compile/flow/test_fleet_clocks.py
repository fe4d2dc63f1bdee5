"""Compile once per fleet when the nodes' wall clocks disagree by minutes.

Two nodes (processes with their own local tiers) on one S3 remote (moto's real HTTP API on
loopback), one with its clock five minutes ahead and one five minutes behind, by
libfaketime (LD_PRELOAD; the `libfaketime` wheel ships the library, a test dependency). The
lease a holder renews carries its wall-clock expiry, which a waiter used to compare with its
own clock: the node ahead took over a live compile at once, and the node behind waited ten
minutes on a dead one. A waiter now judges by watching the record change on its own
monotonic clock (backends/locks.py). Five minutes stays inside what S3 itself accepts (a
request signed more than 15 minutes off is refused).

Every "meanwhile" is a handshake on files or on the lease's record (cache_workers.py); time
limits only catch hangs, and the one upper bound on a takeover is far from both the lease
(2 s) and the ten minutes the old rule cost.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

import pytest
from cache_workers import (
    FLEET_WAITING,
    HELD,
    RESUME,
    SAFETY,
    finish_workers,
    wait_for,
    worker_command,
    worker_env,
)

from vllm_neuron.backends import open_store
from vllm_neuron.backends.records import LEASE_RECORDS, LeaseRecord
from vllm_neuron.compile.entry.events import CACHE_EVENTS, EVENTS_STREAM, LeaseWaited, read_stats

KEY = "c10c4c10c4c10c4c10c4c10c4c10c4aa"
LEASE = 2.0  # seconds: VLLM_NEURON_REMOTE_LEASE_SECONDS of every node
SKEW = 300.0  # seconds each node's clock is off: one ahead, one behind


@pytest.fixture
def fleet(tmp_path: Any, s3_env: str, s3_store_url: str) -> dict[str, Any]:
    return {"remote": s3_store_url, "remote_options": {}}


def faketime_env(offset: float) -> dict[str, str]:
    """The environment that runs a process with its wall clock `offset` seconds off (its
    monotonic clock untouched: libfaketime's DONT_FAKE_MONOTONIC)."""
    import libfaketime

    _, env = libfaketime.get_reload_information()
    return {**env, "FAKETIME": f"{offset:+.0f}", "FAKETIME_DID_REEXEC": "true"}


def start_node(tmp_path: Any, fleet: dict[str, Any], name: str, offset: float,
               **args: Any) -> subprocess.Popen[str]:  # fmt: skip
    """One node of one rank whose clock is `offset` seconds off, getting `KEY` at once."""
    worker_args = {
        "key": KEY,
        "cache_dir": str(tmp_path / name),
        "marker_dir": str(tmp_path / "markers"),
        "fleet_wait_dir": str(tmp_path / "fleet-waits"),
        "hold_dir": str(tmp_path / "hold"),
        "remote_lease_seconds": LEASE,
        "timeout": SAFETY,
        **fleet,
        **args,
    }
    return subprocess.Popen(worker_command("get", worker_args),
                            env=worker_env(**faketime_env(offset)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def held_by(tmp_path: Any, procs: list[subprocess.Popen[str]]) -> int:
    hold = tmp_path / "hold"
    return int(wait_for(lambda: (hold / HELD).exists() and (hold / HELD).read_text(),
                        "a compile to stop half-way", procs))  # fmt: skip


def waiting_on_the_fleet(tmp_path: Any, proc: subprocess.Popen[str]) -> None:
    marker = tmp_path / "fleet-waits" / f"{FLEET_WAITING}{proc.pid}"
    wait_for(marker.exists, "the other node to wait on the fleet", [proc])


def lease_now(fleet: dict[str, Any]) -> tuple[int, LeaseRecord | None]:
    """The key's latest lease generation on the remote and its record."""
    remote = open_store(fleet["remote"], create=False)
    directory = f".locks/{KEY}"
    generations = [int(n) for n in remote.list_dir(directory) if n.isdigit()]
    if not generations:
        return 0, None
    data = remote.read(f"{directory}/{max(generations):012d}")
    return max(generations), None if data is None else LEASE_RECORDS.decode(data)


def started(tmp_path: Any) -> int:
    path = tmp_path / "markers"
    return len([n for n in os.listdir(path) if n.startswith("started-")]) if path.exists() else 0


def lease_waits(cache_dir: str) -> list[LeaseWaited]:
    log = open_store(cache_dir, create=False).log(EVENTS_STREAM)
    return [e for e in log.read(CACHE_EVENTS).records if isinstance(e, LeaseWaited)]


def assert_clock_off(result: dict[str, Any], offset: float, before: float, after: float) -> None:
    """The worker's wall clock (its `started`) really was `offset` seconds off the test's:
    libfaketime took hold, so the test is not vacuous."""
    assert before + offset - 5 <= result["started"] <= after + offset + 5, (result, offset)


@pytest.mark.timeout(2 * SAFETY)
def test_a_node_minutes_ahead_never_takes_over_a_live_compile(tmp_path, fleet):
    """The holder's clock is five minutes behind, so every record it writes says "expired
    five minutes ago" to the waiter, whose clock is five minutes ahead. The waiter waits
    through two full lease periods of renewals (counted on the record itself) and fetches
    what the holder promotes: one compile in the fleet, no takeover."""
    before = time.time()
    behind = start_node(tmp_path, fleet, "behind", -SKEW)
    assert held_by(tmp_path, [behind]) == behind.pid
    holder_generation, record = lease_now(fleet)
    assert record is not None and holder_generation >= 1
    ahead = start_node(tmp_path, fleet, "ahead", +SKEW)
    waiting_on_the_fleet(tmp_path, ahead)
    assert record.expires < time.time() + SKEW  # what the old rule read as "expired"

    _, at_wait = lease_now(fleet)
    assert at_wait is not None

    def renewed_for_two_periods() -> bool:
        generation, now = lease_now(fleet)
        assert generation == holder_generation, "the lease was taken over"
        return now is not None and now.renewal >= at_wait.renewal + 7  # 3 renewals a period

    wait_for(renewed_for_two_periods, "two lease periods of renewals", [behind, ahead])
    assert started(tmp_path) == 1  # the waiter never started a compile of its own
    (tmp_path / "hold" / RESUME).touch()
    holder, waiter = finish_workers([behind, ahead])
    after = time.time()

    assert_clock_off(holder, -SKEW, before, after)
    assert_clock_off(waiter, +SKEW, before, after)
    assert holder["ok"] and holder["source"] == "compiled" and holder["wrong"] is None
    assert waiter["ok"] and waiter["source"] == "remote" and waiter["wrong"] is None
    assert started(tmp_path) == 1
    stats = [read_stats(str(tmp_path / n)) for n in ("behind", "ahead")]
    assert [s.compiles for s in stats] == [1, 0]
    assert sum(s.lease_takeovers for s in stats) == 0
    # It waited until the holder published (then fetched) or let go (then took the free
    # lease and found the entry published): never "acquired" by taking a live lease over.
    (wait,) = lease_waits(str(tmp_path / "ahead"))
    assert wait.outcome in ("fetched", "acquired")


@pytest.mark.timeout(2 * SAFETY)
def test_a_killed_holder_minutes_ahead_is_taken_over_after_about_one_lease(tmp_path, fleet):
    """The holder's clock is five minutes ahead, so its records say "ten minutes to go" to
    the waiter, five minutes behind, which the old rule believed. Killed, it is taken over
    about one lease after it stopped renewing: the taker records the takeover and compiles."""
    before = time.time()
    ahead = start_node(tmp_path, fleet, "ahead", +SKEW)
    holder_pid = held_by(tmp_path, [ahead])
    assert holder_pid == ahead.pid
    holder_generation, record = lease_now(fleet)
    assert record is not None and record.expires > time.time() + SKEW  # "ten minutes to go"
    behind = start_node(tmp_path, fleet, "behind", -SKEW)
    waiting_on_the_fleet(tmp_path, behind)

    os.kill(holder_pid, signal.SIGKILL)
    assert ahead.wait(timeout=SAFETY) == -signal.SIGKILL
    killed = time.monotonic()
    wait_for(lambda: lease_now(fleet)[0] > holder_generation, "a successor's lease", [behind])
    taken_after = time.monotonic() - killed
    (waiter,) = finish_workers([behind])
    after = time.time()

    assert_clock_off(waiter, -SKEW, before, after)
    assert waiter["ok"] and waiter["source"] == "compiled" and waiter["wrong"] is None
    assert taken_after < 60, taken_after  # about one lease (2 s), never the old ten minutes
    assert started(tmp_path) == 2  # the killed compile and the taker's
    stats = read_stats(str(tmp_path / "behind"))
    assert stats.compiles == 1 and stats.lease_takeovers == 1 and stats.promotions == 1
    (wait,) = lease_waits(str(tmp_path / "behind"))
    assert wait.outcome == "acquired"
    assert wait.seconds >= LEASE  # it watched the dead lease for a full period first
    assert f"took over the compile of {KEY} from" in waiter["stderr"], waiter["stderr"]
    remote = open_store(fleet["remote"], create=False)
    assert remote.published(KEY) is not None
