"""A graph deferred to a holder on another node is fetched as soon as the holder publishes
it, in the background, not at its first call (compile/flow/prefetch.py).

Two nodes in one test process, a folder remote with fenced leases: node A holds the graph's
lease and compiles it until the test lets it finish; node B traces it (deferred). The test
waits on B's local tier, never on a clock: with no prefetch, B's tier would stay empty until
B called the graph, and the wait would run out.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from cache_workers import entry_is_right, fake_compile

from vllm_neuron.backends import RecordCodec
from vllm_neuron.compile.entry.events import CACHE_EVENTS, EVENTS_STREAM, CacheHit, Fetched
from vllm_neuron.compile.entry.outcomes import PendingCompile
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.flow.prefetch import Prefetcher

KEYS = ["5ef0c4ed" * 4, "5ef0c4ee" * 4, "5ef0c4ef" * 4]
PATIENCE = 120.0  # far beyond any healthy run; only a broken prefetch waits this long


_CHANGED = threading.Condition()  # notified by the prefetchers the tests watch


def _notify() -> None:
    with _CHANGED:
        _CHANGED.notify_all()


def _watched(prefetcher: Prefetcher) -> Prefetcher:
    """`prefetcher`, telling the tests after each look it makes and each key it lets go."""
    fetch, forget = prefetcher._fetch, prefetcher.forget

    def fetch_and_tell(key: str) -> bool:
        try:
            return fetch(key)
        finally:
            _notify()

    def forget_and_tell(key: str) -> None:
        forget(key)
        _notify()

    prefetcher._fetch = fetch_and_tell  # type: ignore[method-assign]
    prefetcher.forget = forget_and_tell  # type: ignore[method-assign]
    return prefetcher


def _until(condition: Any, what: str) -> None:
    """Wait for `condition`, looked at again each time a watched prefetcher changes."""
    with _CHANGED:
        assert _CHANGED.wait_for(condition, PATIENCE), f"waited {PATIENCE} s for {what}"


def _node(tmp_path: Any, name: str) -> TwoTierCache:
    cache = TwoTierCache(str(tmp_path / name), remote=str(tmp_path / "remote"),
                         remote_options={"lock": "lease"})  # fmt: skip
    _watched(cache._prefetcher)
    return cache


def _defer_to_a_holder(node_a: TwoTierCache, node_b: TwoTierCache) -> list[PendingCompile]:
    """Node A compiles KEYS, holding the first until B has deferred it; A has published
    them all when this returns."""
    holding, go = threading.Event(), threading.Event()

    def held_compile(key: str) -> Any:
        def compile_fn(out_dir: str) -> Any:
            holding.set()
            assert go.wait(PATIENCE)
            return fake_compile(out_dir, key=key)
        return compile_fn

    def node_a_compiles() -> None:
        for key in KEYS:
            node_a.get_or_compile(key, held_compile(key))

    a = threading.Thread(target=node_a_compiles)
    a.start()
    try:
        assert holding.wait(PATIENCE), "node A never held the first graph"
        pending = [node_b.begin(key, lambda out: pytest.fail("B compiled a held graph"))
                   for key in KEYS[:1]]  # fmt: skip
        assert isinstance(pending[0], PendingCompile) and pending[0].reason == "remote-lease"
        assert node_b._prefetcher.pending == KEYS[:1]
    finally:
        go.set()
    a.join()
    return pending  # type: ignore[return-value]


def test_graphs_deferred_to_another_node_are_fetched_before_their_first_calls(tmp_path):
    node_a, node_b = _node(tmp_path, "a"), _node(tmp_path, "b")
    pending = _defer_to_a_holder(node_a, node_b)
    # Node A published all three; B deferred only the first, and fetches it unasked.
    _until(lambda: node_b.local_tier.lookup(KEYS[0]) is not None, "B's background fetch")
    _until(lambda: not node_b._prefetcher.pending, "B's prefetcher to let the key go")
    result = pending[0].result()
    assert result.source == "local" and entry_is_right(str(result.path), KEYS[0]) is None
    codec = RecordCodec(CACHE_EVENTS)
    events = [e for _, data in node_b.local.log(EVENTS_STREAM).segment_data()
              for e in codec.decode_lines(data).records]  # fmt: skip
    assert [e.key for e in events if isinstance(e, Fetched)] == KEYS[:1]
    # One use of the remote, counted once: the first call's local hit is that fetch.
    assert not [e for e in events if isinstance(e, CacheHit)], events
    assert node_b.get_or_compile(KEYS[0], lambda out: pytest.fail("compiled")).source == "memory"
    assert node_b.local_tier.lookup(KEYS[1]) is None  # nothing it did not defer


def test_a_prefetched_graph_is_not_evicted_before_its_first_call(tmp_path):
    node_a = _node(tmp_path, "a")
    node_b = TwoTierCache(str(tmp_path / "b"), remote=str(tmp_path / "remote"),
                          remote_options={"lock": "lease"}, max_size=1)  # fmt: skip
    _watched(node_b._prefetcher)
    evictor = node_b._upkeep._evictor
    assert evictor is not None
    evictor.recent_use_seconds = 0  # no grace for a recent use: only protection keeps it
    pending = _defer_to_a_holder(node_a, node_b)
    _until(lambda: not node_b._prefetcher.pending, "B's prefetcher to let the key go")
    # Above its bound once fetched, yet kept: it is about to be called, and an eviction
    # now would only fetch it again at that call.
    assert node_b.local_tier.lookup(KEYS[0]) is not None
    result = pending[0].result()
    assert result.source == "local" and entry_is_right(str(result.path), KEYS[0]) is None


def test_the_prefetcher_looks_round_the_keys_latest_first_and_leaves_each_to_its_first_call():
    looked: list[str] = []
    published = {"k3"}
    all_added = threading.Event()

    def fetch(key: str) -> bool:
        looked.append(key)
        _notify()  # before it may block below
        if len(looked) == 1:  # the thread started at the first key: hold it until all are in
            assert all_added.wait(PATIENCE)
        return key in published

    prefetcher = _watched(Prefetcher(fetch, patience=PATIENCE))
    prefetcher.add("k1")
    _until(lambda: looked == ["k1"], "the thread's first look")  # held there until all are in
    prefetcher.add("k2")
    prefetcher.add("k3")
    all_added.set()
    _until(lambda: "k3" not in prefetcher.pending, "k3's fetch")
    prefetcher.forget("k1")
    prefetcher.forget("k2")  # their first calls began
    _until(lambda: not prefetcher.pending, "the prefetcher to finish")
    assert looked[:2] == ["k1", "k3"], looked  # after the first look: latest deferral first
    assert looked.count("k3") == 1  # fetched: never looked at again
    prefetcher.add("k4")  # a new deferral starts a new thread
    _until(lambda: "k4" in looked, "a look at k4")
    prefetcher.forget("k4")


def test_a_published_graph_whose_fetch_fails_gets_one_try_and_is_left_to_its_first_call(
        tmp_path, compile_fn, monkeypatch):  # fmt: skip
    node_a, node_b = _node(tmp_path, "a"), _node(tmp_path, "b")
    node_a.get_or_compile(KEYS[0], compile_fn(KEYS[0]))  # published on the remote
    tries: list[str] = []
    # A fetch that fails where it is said (a full or read-only disk here, a defective or
    # untrusted entry) comes back None: looking again would copy it again and again.
    monkeypatch.setattr(node_b, "fetch_remote", lambda key: tries.append(key))
    node_b._prefetcher.add(KEYS[0])
    node_b._prefetcher.add(KEYS[1])  # never published: looked at until its first call
    _until(lambda: node_b._prefetcher.pending == [KEYS[1]], "the failed fetch's key to go")
    node_b._prefetcher.forget(KEYS[1])
    _until(lambda: not node_b._prefetcher.pending, "the prefetcher to finish")
    assert tries == [KEYS[0]]
