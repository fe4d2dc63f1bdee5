"""Deferred compiles in one process (deferral.py, slots.py): what a busy node, a queued
worker job and a repeated graph cost. The fake compile stands in for the toolchain; the
"worker" here is a compile run by the cache's background thread (the real worker process is
tests/compile/workers/test_compile_workers.py's)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from cache_workers import entry_is_right, fake_compile

from vllm_neuron.backends import open_store
from vllm_neuron.compile.entry.failure_notes import FAILURES_DIR
from vllm_neuron.compile.entry.outcomes import CompileSlotTimeout, PendingCompile
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.workers.slots import SLOT_PREFIX

KEY = "defe44ed" * 4


def _cache(tmp_path: Any, **kwargs: Any) -> TwoTierCache:
    return TwoTierCache(str(tmp_path / "local"), **kwargs)


def test_a_node_whose_slots_stay_taken_is_no_failure_of_the_graph(tmp_path, compile_fn):
    remote = str(tmp_path / "remote")
    cache = _cache(tmp_path, remote=remote, remote_options={"lock": "lease"}, timeout=0.5,
                   compile_workers=1)
    held = open_store(str(tmp_path / "local")).lock(f"{SLOT_PREFIX}0")
    held.acquire(timeout=0)  # another process of the node compiles something else
    try:
        with pytest.raises(CompileSlotTimeout, match="VLLM_NEURON_COMPILE_WORKERS=1"):
            cache.get_or_compile(KEY, compile_fn(KEY))
    finally:
        held.release()
    # No note for the fleet (nor the node) that the graph failed: the next try compiles it.
    assert not open_store(remote).list(FAILURES_DIR)
    assert not cache.local.list(FAILURES_DIR)
    result = cache.get_or_compile(KEY, compile_fn(KEY))
    assert result.source == "compiled" and entry_is_right(str(result.path), KEY) is None


def test_a_repeated_graph_is_prepared_and_queued_once(tmp_path, compile_fn):
    cache = _cache(tmp_path)
    prepared: list[str] = []

    def worker() -> Any:
        prepared.append(KEY)
        return (lambda out: fake_compile(out, key=KEY, delay=0.2)), (lambda: None)

    first = cache.begin(KEY, compile_fn(KEY), piece="layer 0", worker=worker)
    again = cache.begin(KEY, compile_fn(KEY), piece="layer 1", worker=worker)
    assert isinstance(first, PendingCompile) and again is first
    assert prepared == [KEY]
    result = first.result()
    assert result.source == "compiled" and entry_is_right(str(result.path), KEY) is None


def test_a_worker_job_whose_slot_never_came_is_compiled_at_the_first_call(tmp_path, compile_fn):
    cache = _cache(tmp_path, timeout=0.5, compile_workers=1)
    held = open_store(str(tmp_path / "local")).lock(f"{SLOT_PREFIX}0")
    held.acquire(timeout=0)
    pending = cache.begin(KEY, compile_fn(KEY), piece="p", worker=lambda: (
        (lambda out: fake_compile(out, key=KEY)), (lambda: None)))
    assert isinstance(pending, PendingCompile)
    try:
        # The queued job gives up waiting for the slot while nothing calls the graph (its
        # thread ends: a handshake on the thread, not a pause) ...
        deadline = time.monotonic() + 60
        while any(t.name == "vllm-neuron-compile" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the queued job never gave up"
            time.sleep(0.01)
    finally:
        held.release()
    # ... and the first call compiles it here, under a fresh timeout, instead of raising.
    result = pending.result()
    assert result.source == "compiled" and entry_is_right(str(result.path), KEY) is None


def test_a_rank_holds_its_share_of_the_slots_and_leaves_the_rest_to_its_peers(tmp_path):
    from vllm_neuron.compile.workers.slots import CompileSlots

    store = open_store(str(tmp_path / "local"))
    peers = [2]
    # Three slots, two ranks tracing alongside: each may hold two, never all three.
    slots = CompileSlots(store, 3, peers=lambda: peers[0])
    assert slots.share == 2
    far = time.monotonic() + 60
    with slots.held(wait=False, deadline=far, what="a") as a, \
            slots.held(wait=False, deadline=far, what="b") as b:  # fmt: skip
        assert a and b
        with slots.held(wait=False, deadline=far, what="c") as c:
            assert not c  # no slot of its share left: the graph is deferred
        # ... while the node's last slot is still free for the other rank.
        other = store.lock(f"{SLOT_PREFIX}2")
        other.acquire(timeout=0)
        other.release()
        peers[0] = 1  # alone (vLLM's groups not up yet, or TP=1): the whole node's
        with slots.held(wait=False, deadline=far, what="c") as c:
            assert c
    # Given back: the share counts the slots held, not the ones ever taken.
    peers[0] = 8  # more ranks than slots: one each, never none
    assert slots.share == 1
    with slots.held(wait=False, deadline=far, what="d") as d, \
            slots.held(wait=False, deadline=far, what="e") as e:  # fmt: skip
        assert d and not e
    # One share per process and tier, however many caches it opens on the node's tier.
    again = CompileSlots(open_store(str(tmp_path / "local")), 3, peers=lambda: 8)
    with slots.held(wait=False, deadline=far, what="f") as f, \
            again.held(wait=False, deadline=far, what="g") as g:  # fmt: skip
        assert f and not g
    with again.held(wait=False, deadline=far, what="g") as g:  # given back: its turn now
        assert g


def test_a_graph_that_failed_on_another_node_is_not_compiled_again_at_trace(tmp_path, compile_fn):
    from vllm_neuron.compile.entry.outcomes import CompileError

    remote = str(tmp_path / "remote")
    options = {"lock": "lease"}
    node_a = TwoTierCache(str(tmp_path / "a"), remote=remote, remote_options=options)

    def broken(out_dir: str) -> Any:
        raise RuntimeError("the compiler rejected the graph")

    with pytest.raises(RuntimeError, match="rejected"):
        node_a.get_or_compile(KEY, broken)
    # Node B traces it: the lease is free (A let it go), so B wins it - and, having won it,
    # reads the fleet's failure note before compiling: A's error, named, and no compile.
    node_b = TwoTierCache(str(tmp_path / "b"), remote=remote, remote_options=options)
    called: list[str] = []
    with pytest.raises(CompileError, match=f"{KEY}.*rejected"):
        node_b.begin(KEY, lambda out: called.append(out) or compile_fn(KEY)(out))
    assert called == []


@pytest.mark.parametrize("who", ["won-by-a-node-that-leases", "as-a-node-that-cannot-sign"])
def test_a_failure_noted_between_the_look_and_the_lease_stops_the_waiter(
    tmp_path, compile_fn, monkeypatch, who
):
    """The holder's compile fails, and it notes that and lets the lease go, in the moment
    between a waiter's look for a failure note and its try for the lease (seen in a CI run:
    a second node compiled the failed graph). A holder notes before it lets go, so the
    waiter that wins the lease, or sees it free, must find the note: the graph's error,
    and no second compile."""
    from vllm_neuron.compile.entry.failure_notes import recent_failure, write_failure_note
    from vllm_neuron.compile.entry.outcomes import CompileError
    from vllm_neuron.compile.flow import fleet
    from vllm_neuron.compile.trust.policy import TrustPolicy

    remote = str(tmp_path / "remote")
    holder = open_store(remote, lock="lease").lock(KEY, lease_duration=60.0)
    holder.acquire(timeout=0)  # another node compiles the key
    looks: list[object] = []

    def the_holder_fails_right_after_this_look(store: Any, key: str, **kwargs: Any) -> Any:
        note = recent_failure(store, key, **kwargs)
        looks.append(note)
        if len(looks) == 1:  # the holder notes its failure, then lets the lease go
            assert note is None
            assert write_failure_note(store, key, "ValueError: the compiler crashed") is None
            holder.release()
        return note

    monkeypatch.setattr(fleet, "recent_failure", the_holder_fails_right_after_this_look)
    # A node that checks signatures but has no key to sign with waits, never leases
    # (`claim_without_lease`): it reads the lease as free instead of winning it.
    trust = TrustPolicy(mode="warn") if who == "as-a-node-that-cannot-sign" else None
    cache = _cache(tmp_path, remote=remote, remote_options={"lock": "lease"}, trust=trust)
    assert cache.trust.may_publish_remote is (trust is None)
    called: list[str] = []
    with pytest.raises(CompileError, match="the compiler crashed"):
        cache.get_or_compile(KEY, lambda out: called.append(out) or compile_fn(KEY)(out))
    assert called == []
    assert len(looks) == 2 and looks[1] is not None


def test_a_remote_that_fails_to_answer_after_the_lease_is_won_is_an_outage_not_a_failure(
    tmp_path, compile_fn, monkeypatch
):
    from vllm_neuron.compile.entry.events import read_stats
    from vllm_neuron.compile.flow import fleet

    looks: list[str] = []

    def unanswered(store: Any, key: str, **_: Any) -> None:
        looks.append(key)  # the failure-note read, on a remote that stopped answering
        raise ConnectionError("the remote did not answer")

    monkeypatch.setattr(fleet, "recent_failure", unanswered)
    cache = _cache(tmp_path, remote=str(tmp_path / "remote"), remote_options={"lock": "lease"})
    # Traced (no wait): the lease is won, and only then is the note looked for; that look
    # failing is a remote outage - the graph compiles here - never the trace's error.
    result = cache.begin(KEY, compile_fn(KEY))
    assert looks == [KEY]
    assert not isinstance(result, PendingCompile)
    assert result.source == "compiled" and entry_is_right(str(result.path), KEY) is None
    assert read_stats(cache.local_dir).remote_outages == 1


def test_a_rank_tracing_a_graph_another_rank_is_preparing_defers_to_it(tmp_path):
    """The preparation (a host export, a Neuron lowering) runs under the key's lock: a rank
    of the node that traces the same graph meanwhile defers to the one preparing it and
    never prepares it too."""
    rank_a, rank_b = _cache(tmp_path), _cache(tmp_path)  # two processes' caches, one node
    preparing, go = threading.Event(), threading.Event()
    prepared: list[str] = []

    def slow_worker() -> Any:
        prepared.append("a")
        preparing.set()
        assert go.wait(60)
        return (lambda out: fake_compile(out, key=KEY)), (lambda: None)

    def b_worker() -> Any:
        prepared.append("b")
        return (lambda out: fake_compile(out, key=KEY)), (lambda: None)

    outcome: list[Any] = []
    a = threading.Thread(target=lambda: outcome.append(
        rank_a.begin(KEY, lambda out: pytest.fail("compiled in place"), worker=slow_worker)))
    a.start()
    try:
        assert preparing.wait(60)
        deferred = rank_b.begin(KEY, lambda out: pytest.fail("B compiled it"), worker=b_worker)
        assert isinstance(deferred, PendingCompile) and deferred.reason == "local-lock"
    finally:
        go.set()
        a.join()
    assert prepared == ["a"]
    (pending,) = outcome
    assert isinstance(pending, PendingCompile) and pending.reason == "worker"
    assert pending.result().source == "compiled"
    result = deferred.result()
    assert result.source in ("local", "local-after-wait")
    assert entry_is_right(str(result.path), KEY) is None
