"""The local tier's size bound (VLLM_NEURON_CACHE_MAX_SIZE), pins, and prune --max-size.

Least recently used entries go first, recency folded from the events the cache already
records; a pinned entry, one whose key's lock a live process holds (held here by a real
subprocess, by file handshake), one the evicting process has loaded and one used in the
last minute never go.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest
from cache_workers import SAFETY, entry_is_right
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_neuron.backends import open_store
from vllm_neuron.cli import main
from vllm_neuron.compile.commands.prune import plan_prune
from vllm_neuron.compile.entry.events import EVENTS_STREAM, CacheHit, Compiled, Evicted, read_stats
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.build import compile_and_publish
from vllm_neuron.compile.tiers.inventory import list_entries
from vllm_neuron.compile.upkeep import eviction
from vllm_neuron.compile.upkeep.eviction import (
    EVICT_LOCK,
    IN_USE,
    Evictor,
    Recency,
    pin,
    pinned_keys,
)
from vllm_neuron.envs import ConfigError
from vllm_neuron.envs.compile_cache import cache_max_size, load_compile_cache_settings

ENTRY = 4 * 4096  # what the fake compile writes per entry
KEYS = [f"{i:x}" * 32 for i in range(1, 7)]  # "111...", "222...", ...


def run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def present(directory: str) -> list[str]:
    return sorted(e.key for e in list_entries(open_store(directory)))


def hit(directory: str, key: str, at: float) -> None:
    """A hit of `key` at `at`, as a process's cache records it."""
    open_store(directory).log(EVENTS_STREAM, writer="test").append(CacheHit(key=key, at=at))


@pytest.fixture
def no_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Automatic eviction without the one-minute grace for just-used entries."""
    monkeypatch.setattr(eviction, "RECENT_USE_SECONDS", 0.0)


# ---------------------------------------------------------------- the setting
@pytest.mark.parametrize(("value", "size"), [("50G", 50 << 30), ("500M", 500 << 20),
                                             ("1.5GiB", 3 << 29), ("4096", 4096),
                                             ("  ", None), ("", None)])
def test_the_bound_reads_with_the_size_parsers_rules(value: str, size: int | None) -> None:
    env = {"VLLM_NEURON_CACHE_MAX_SIZE": value}
    assert cache_max_size(env) == size
    assert load_compile_cache_settings(env).cache_max_size == size


@pytest.mark.parametrize("value", ["lots", "5 GB of it", "-1G", "0", "0M"])
def test_a_bad_bound_is_a_start_up_error_naming_the_variable_and_value(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_compile_cache_settings({"VLLM_NEURON_CACHE_MAX_SIZE": value})
    assert f"VLLM_NEURON_CACHE_MAX_SIZE={value!r}" in str(info.value)


# ------------------------------------------------------------ automatic eviction
def test_a_publish_above_the_bound_evicts_the_least_recently_used(tmp_path, capsys,
                                                                  compile_fn, no_grace):
    d = str(tmp_path / "cache")
    builder = TwoTierCache(d)
    for key in KEYS[:3]:  # A, B, C compiled in that order
        builder.get_or_compile(key, compile_fn(key))
    TwoTierCache(d).get_or_compile(KEYS[0], compile_fn(KEYS[0]))  # A hit since: B is LRU

    node = TwoTierCache(d, max_size=3 * ENTRY + ENTRY // 2)  # 3 fit: nothing at start-up
    assert present(d) == sorted(KEYS[:3])
    node.get_or_compile(KEYS[3], compile_fn(KEYS[3]))  # D: 4 entries, above the bound
    assert present(d) == sorted([KEYS[0], KEYS[2], KEYS[3]])
    for key in (KEYS[0], KEYS[2], KEYS[3]):
        assert entry_is_right(os.path.join(d, key), key) is None
    stats = read_stats(d)
    assert (stats.evictions, stats.evicted_bytes) == (1, ENTRY)
    code, out, _ = run(capsys, "cache", "--cache-dir", d, "stats")
    assert code == 0 and "evictions              1 (16.0 KiB)" in out
    events = open_store(d).log(EVENTS_STREAM).read([Evicted]).records
    assert [(e.key, e.reason) for e in events] == [(KEYS[1], "size")]


def test_opening_the_cache_evicts_down_to_the_bound(tmp_path, compile_fn, no_grace):
    d = str(tmp_path / "cache")
    builder = TwoTierCache(d)
    for key in KEYS[:4]:
        builder.get_or_compile(key, compile_fn(key))
    hit(d, KEYS[0], time.time() + 1)  # the oldest, but the most recently used
    TwoTierCache(d, max_size=2 * ENTRY)
    assert present(d) == sorted([KEYS[0], KEYS[3]])
    assert read_stats(d).evictions == 2


def test_a_fetch_above_the_bound_evicts_too_and_never_the_fetched_entry(tmp_path, compile_fn,
                                                                        no_grace):
    d, remote = str(tmp_path / "cache"), str(tmp_path / "remote")
    TwoTierCache(str(tmp_path / "builder"), remote=remote).get_or_compile(
        KEYS[5], compile_fn(KEYS[5]))  # promoted to the remote
    local = TwoTierCache(d)
    for key in KEYS[:2]:
        local.get_or_compile(key, compile_fn(key))
    node = TwoTierCache(d, remote=remote, max_size=ENTRY)
    assert present(d) == [KEYS[1]]  # start-up: down to one entry, the newest
    assert node.get_or_compile(KEYS[5], compile_fn(KEYS[5])).source == "remote"
    assert present(d) == [KEYS[5]]


def test_the_process_never_evicts_what_it_has_loaded(tmp_path, compile_fn, no_grace,
                                                     cache_warnings):
    d = str(tmp_path / "cache")
    cache = TwoTierCache(d, max_size=ENTRY)
    for key in KEYS[:3]:
        cache.get_or_compile(key, compile_fn(key))
    assert present(d) == sorted(KEYS[:3])  # all loaded here: loaded from their directories
    assert any("above VLLM_NEURON_CACHE_MAX_SIZE" in m for m in cache_warnings())
    TwoTierCache(d, max_size=ENTRY)  # another process: none of them loaded there
    assert present(d) == [KEYS[2]]


def test_an_entry_used_in_the_last_minute_stays(tmp_path, compile_fn, cache_warnings):
    d = str(tmp_path / "cache")
    for key in KEYS[:3]:
        TwoTierCache(d).get_or_compile(key, compile_fn(key))
    TwoTierCache(d, max_size=ENTRY)
    assert present(d) == sorted(KEYS[:3])  # just compiled: about to be loaded elsewhere
    assert any("used in the last 60 s" in m for m in cache_warnings())


def test_a_failing_eviction_never_fails_a_compile(tmp_path, compile_fn, no_grace,
                                                  monkeypatch, cache_warnings):
    d = str(tmp_path / "cache")

    def broken(store: Any) -> Any:
        raise OSError("disk on fire")

    monkeypatch.setattr(eviction, "list_entries", broken)
    cache = TwoTierCache(d, max_size=ENTRY)
    for key in KEYS[:3]:
        assert cache.get_or_compile(key, compile_fn(key)).source == "compiled"
    assert [m for m in cache_warnings() if "disk on fire" in m] == [
        f"compile cache: eviction in {cache.local_dir} failed: disk on fire"]


def test_one_eviction_pass_at_a_time(tmp_path, compile_fn):
    d = str(tmp_path / "cache")
    for key in KEYS[:3]:
        TwoTierCache(d).get_or_compile(key, compile_fn(key))
    store = open_store(d)
    with store.lock(EVICT_LOCK, timeout=5):  # another process's pass is under way
        assert Evictor(store, 1, recent_use_seconds=0).run() is None
    assert present(d) == sorted(KEYS[:3])
    done = Evictor(store, 1, recent_use_seconds=0).run()
    assert done is not None and len(done.withdrawn) == 3


def test_a_hit_writes_nothing_more_with_a_bound(tmp_path, compile_fn):
    """Recency is the hit events the cache records anyway: a bound adds no write to a hit."""
    counts = []
    for bound in (None, 1 << 40):
        d = str(tmp_path / f"cache-{bound}")
        TwoTierCache(d).get_or_compile(KEYS[0], compile_fn(KEYS[0]))
        cache = TwoTierCache(d, max_size=bound)
        assert cache.get_or_compile(KEYS[0], compile_fn(KEYS[0])).source == "local"
        assert cache.get_or_compile(KEYS[0], compile_fn(KEYS[0])).source == "memory"
        lines = open_store(d).log(EVENTS_STREAM).read([CacheHit, Compiled]).records
        counts.append(len(lines))
    assert counts[0] == counts[1] == 3  # one compile, one local hit, one memory hit


# ------------------------------------------------------------------------ recency
def test_recency_is_the_last_hit_compile_or_fetch_and_reads_only_what_was_appended(tmp_path):
    store = open_store(str(tmp_path / "cache"))
    log = store.log(EVENTS_STREAM, writer="w1")
    recency = Recency(store)
    assert recency.last_used() == {}
    log.append(CacheHit(key=KEYS[0], at=10.0))
    log.append(Compiled(key=KEYS[1], at=20.0, seconds=1.0, toolchain="host", size=1))
    log.append(Evicted(key=KEYS[1], at=30.0, size=1, last_used=20.0))  # not a use
    assert recency.last_used() == {KEYS[0]: 10.0, KEYS[1]: 20.0}
    log.append(CacheHit(key=KEYS[0], at=40.0, tier="memory"))
    segment = store.local_path(log.segment_key)
    assert segment is not None
    with open(segment, "ab") as f:  # a writer mid-line: not read until it is whole
        f.write(b'{"type":"hit","key":"' + KEYS[1].encode())
    assert recency.last_used() == {KEYS[0]: 40.0, KEYS[1]: 20.0}
    with open(segment, "ab") as f:
        f.write(b'","at":50.0}\n')
    store.log(EVENTS_STREAM, writer="w2").append(CacheHit(key=KEYS[2], at=5.0))
    assert recency.last_used() == {KEYS[0]: 40.0, KEYS[1]: 50.0, KEYS[2]: 5.0}


def test_without_events_the_oldest_entry_goes_first(tmp_path, compile_fn):
    d = str(tmp_path / "cache")
    cache = TwoTierCache(d)
    for key in KEYS[:3]:
        cache.get_or_compile(key, compile_fn(key))
    store = open_store(d)
    store.log(EVENTS_STREAM).delete()
    plan = plan_prune(store, max_size=2 * ENTRY)
    assert [e.key for e in plan.delete] == [KEYS[0]]


# ------------------------------------------------------------------------- pins
def test_pin_and_unpin_from_the_command_line(tmp_path, capsys, compile_fn):
    d = str(tmp_path / "cache")
    code, _, err = run(capsys, "cache", "--cache-dir", d, "pin")  # no tier: nothing to list
    assert code == 2 and "no compile cache" in err and not os.path.exists(d)
    cache = TwoTierCache(d)
    for key in KEYS[:3]:
        cache.get_or_compile(key, compile_fn(key))
    code, out, _ = run(capsys, "cache", "--cache-dir", d, "pin", KEYS[0], KEYS[5],
                       "--note", "prod model")
    assert code == 0
    assert f"pinned {KEYS[0]}" in out and f"pinned {KEYS[5]} (not in the tier yet)" in out
    assert run(capsys, "cache", "--cache-dir", d, "pin", KEYS[0])[1].startswith(
        "already pinned")
    code, out, _ = run(capsys, "cache", "--cache-dir", d, "pin")
    assert code == 0 and "prod model" in out and "2 pinned entries" in out

    code, out, _ = run(capsys, "cache", "--cache-dir", d, "prune", "--max-size", "1")
    assert code == 0 and "2 entries deleted" in out
    assert present(d) == [KEYS[0]]  # pinned: kept whatever the bound
    code, out, _ = run(capsys, "cache", "--cache-dir", d, "prune", "--older-than", "0s")
    assert f"keep {KEYS[0]} (pinned)" in out and present(d) == [KEYS[0]]

    assert run(capsys, "cache", "--cache-dir", d, "unpin", KEYS[0])[0] == 0
    assert run(capsys, "cache", "--cache-dir", d, "prune", "--max-size", "1")[0] == 0
    assert present(d) == []
    code, out, _ = run(capsys, "cache", "--cache-dir", d, "unpin", "--all")
    assert code == 0 and "1 of 1 pins removed" in out and pinned_keys(open_store(d)) == set()
    assert run(capsys, "cache", "--cache-dir", d, "pin", "not-a-key")[0] == 2
    assert run(capsys, "cache", "--cache-dir", d, "unpin")[0] == 2


def test_a_pinned_entry_survives_automatic_eviction(tmp_path, compile_fn, no_grace):
    d = str(tmp_path / "cache")
    for key in KEYS[:3]:
        TwoTierCache(d).get_or_compile(key, compile_fn(key))
    assert pin(open_store(d), KEYS[0])  # the least recently used
    TwoTierCache(d, max_size=ENTRY)
    assert present(d) == [KEYS[0]]


def _manifest(tmp_path: Any, name: str, keys: list[str]) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"manifest_version": "1",
                                "graphs": [{"graph_hash": k, "ranks": [0]} for k in keys]}))
    return str(path)


def test_prune_keeps_what_a_manifest_lists(tmp_path, capsys, compile_fn):
    d = str(tmp_path / "cache")
    for key in KEYS[:3]:
        TwoTierCache(d).get_or_compile(key, compile_fn(key))
    manifest = _manifest(tmp_path, "prod", [KEYS[0], KEYS[1]])
    code, out, _ = run(capsys, "cache", "--cache-dir", d, "prune", "--older-than", "0s",
                       "--keep-manifest", manifest)
    assert code == 0 and "1 entries deleted" in out
    assert f"keep {KEYS[0]} (kept (--keep-manifest))" in out
    assert present(d) == sorted(KEYS[:2])
    code, out, _ = run(capsys, "cache", "--cache-dir", d, "pin", "--manifest", manifest)
    assert code == 0 and pinned_keys(open_store(d)) == set(KEYS[:2])
    assert run(capsys, "cache", "--cache-dir", d, "unpin", "--manifest", manifest)[0] == 0
    assert pinned_keys(open_store(d)) == set()


# ------------------------------------------------------------ an entry in use
HOLDER = r"""
import os, sys, time
from vllm_neuron.backends import open_store
store = open_store(sys.argv[1], create=False)
lock = store.lock(sys.argv[2])
lock.acquire(timeout=60)
open(sys.argv[3], "w").close()
deadline = time.monotonic() + float(sys.argv[5])
while not os.path.exists(sys.argv[4]):
    if time.monotonic() > deadline:
        sys.exit("the test never let go")
    time.sleep(0.01)
lock.release()
"""


@pytest.fixture
def lock_holder(tmp_path: Any) -> Any:
    """`hold(directory, key)`: a live process holding `key`'s lock (until `let_go()`)."""
    procs: list[subprocess.Popen[bytes]] = []

    def hold(directory: str, key: str) -> Any:
        held, release = tmp_path / f"held-{key}", tmp_path / f"release-{key}"
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, directory, key, str(held),
                                 str(release), str(SAFETY)])
        procs.append(proc)
        deadline = time.monotonic() + SAFETY
        while not held.exists():
            assert proc.poll() is None, "the lock holder died"
            assert time.monotonic() < deadline, "the lock holder never took the lock"
            time.sleep(0.01)

        def let_go() -> None:
            release.touch()
            assert proc.wait(timeout=SAFETY) == 0

        return let_go

    yield hold
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_entry_whose_lock_a_live_process_holds_is_never_evicted(tmp_path, capsys,
                                                                    compile_fn, lock_holder):
    d = str(tmp_path / "cache")
    for key in KEYS[:3]:
        TwoTierCache(d).get_or_compile(key, compile_fn(key))
    let_go = lock_holder(d, KEYS[0])  # the least recently used, in use elsewhere

    done = Evictor(open_store(d), ENTRY, recent_use_seconds=0).run()  # automatic
    assert done is not None and done.stayed == {KEYS[0]: IN_USE}
    assert present(d) == [KEYS[0]]  # B and C went instead, to fit the bound
    assert entry_is_right(os.path.join(d, KEYS[0]), KEYS[0]) is None

    code, out, _ = run(capsys, "cache", "--cache-dir", d, "prune", "--max-size", "1")
    assert code == 0 and f"kept {KEYS[0]} (in use)" in out and "0 entries deleted" in out
    assert present(d) == [KEYS[0]]

    let_go()  # the holder lets go (the kernel drops a dead holder's lock the same way)
    code, out, _ = run(capsys, "cache", "--cache-dir", d, "prune", "--max-size", "1")
    assert code == 0 and "1 entries deleted" in out and present(d) == []


def test_a_pass_killed_mid_delete_leaves_whole_entries_and_the_next_one_finishes(
        tmp_path, capsys, compile_fn):
    d = str(tmp_path / "cache")
    for key in KEYS[:3]:
        TwoTierCache(d).get_or_compile(key, compile_fn(key))
    env = {**os.environ, "VLLM_NEURON_FAULT": "evict.mid-delete"}
    proc = subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "cache", "--cache-dir", d,
                           "prune", "--max-size", "1"], env=env, capture_output=True,
                          timeout=SAFETY)
    assert proc.returncode == -9, proc.stderr  # SIGKILL after the first withdrawal
    left = present(d)
    assert left == sorted(KEYS[1:3])  # the least recently used went, whole; the rest stay
    for key in left:
        assert entry_is_right(os.path.join(d, key), key) is None
    code, out, _ = run(capsys, "cache", "--cache-dir", d, "prune", "--max-size", "1")
    assert code == 0 and "2 entries deleted" in out and present(d) == []


# ---------------------------------------------------------------- a remote tier
def test_prune_max_size_on_s3_orders_by_creation_and_keeps_its_pins(tmp_path, capsys,
                                                                     compile_fn, s3_env,
                                                                     s3_store_url):
    d = str(tmp_path / "cache")
    cache = TwoTierCache(d)
    for key in KEYS[:4]:
        cache.get_or_compile(key, compile_fn(key))
    assert run(capsys, "cache", "--cache-dir", d, "promote", "--to", s3_store_url,
               "--all")[0] == 0
    assert run(capsys, "cache", "--cache-dir", s3_store_url, "pin", KEYS[0])[0] == 0
    code, out, _ = run(capsys, "cache", "prune", s3_store_url, "--max-size", f"{2 * ENTRY}",
                       "--dry-run")
    assert code == 0 and f"would delete {KEYS[1]}" in out and f"would delete {KEYS[2]}" in out
    code, out, _ = run(capsys, "cache", "prune", s3_store_url, "--max-size", f"{2 * ENTRY}")
    assert code == 0 and "2 entries deleted" in out
    assert present(s3_store_url) == [KEYS[0], KEYS[3]]
    assert read_stats(d).evictions == 0  # a remote's withdrawals are not this node's


def test_prune_of_s3_never_removes_an_entry_whose_lease_is_held(tmp_path, capsys, compile_fn,
                                                                s3_env, s3_store_url):
    d = str(tmp_path / "cache")
    cache = TwoTierCache(d)
    for key in KEYS[:2]:
        cache.get_or_compile(key, compile_fn(key))
    assert run(capsys, "cache", "--cache-dir", d, "promote", "--to", s3_store_url,
               "--all")[0] == 0
    lease = open_store(s3_store_url).lock(KEYS[0], lease_duration=60)
    lease.acquire(timeout=10)  # a node re-promoting KEYS[0] right now
    try:
        code, out, _ = run(capsys, "cache", "prune", s3_store_url, "--max-size", "1")
        assert code == 0 and f"kept {KEYS[0]} (in use)" in out and "1 entries deleted" in out
        assert present(s3_store_url) == [KEYS[0]]
    finally:
        lease.release()
    assert run(capsys, "cache", "prune", s3_store_url, "--max-size", "1")[0] == 0
    assert present(s3_store_url) == []


# ------------------------------------------------------------------ the property
def _publish(store: Any, key: str, size: int) -> None:
    def compile_fn(out: str) -> dict[str, Any]:
        with open(os.path.join(out, "graph.bin"), "wb") as f:
            f.write(b"x" * size)
        return {}

    compile_and_publish(store, key, compile_fn, components={}, toolchain="host", target="cpu",
                        on_failure=lambda exc: None)


entries_st = st.lists(
    st.tuples(st.integers(1, 64) , st.integers(0, 3), st.booleans(), st.booleans(),
              st.booleans()),
    min_size=1, max_size=7,
)  # (size in KiB, hits, pinned, locked, protected) per entry


@settings(max_examples=40)
@given(entries=entries_st, bound_kib=st.integers(1, 256), order=st.randoms())
def test_eviction_keeps_the_bound_and_never_removes_a_kept_entry(entries, bound_kib, order):
    with tempfile.TemporaryDirectory() as d:
        store = open_store(d)
        keys = [f"{i:032x}" for i in range(len(entries))]
        log = store.log(EVENTS_STREAM, writer="test")
        base = time.time() - 3600
        uses = [(k, n) for k, (_, hits, _, _, _) in zip(keys, entries, strict=True)
                for n in range(hits)]
        order.shuffle(uses)
        for key, (size, *_rest) in zip(keys, entries, strict=True):
            _publish(store, key, size << 10)
        for i, (key, _) in enumerate(uses):
            log.append(CacheHit(key=key, at=base + i))
        kept, locks = set(), []
        protect = set()
        for key, (_, _, pinned, locked, protected) in zip(keys, entries, strict=True):
            if pinned:
                pin(store, key)
            if locked:  # another open file: flock refuses the evictor as another process
                lock = store.lock(key)
                lock.acquire(timeout=5)
                locks.append(lock)
            if protected:
                protect.add(key)
            if pinned or locked or protected:
                kept.add(key)
        last = Recency(store).last_used()
        before = {e.key: e for e in list_entries(store)}
        bound = bound_kib << 10
        try:
            Evictor(store, bound, recent_use_seconds=0).run(protect=protect)
        finally:
            for lock in locks:
                lock.release()
        after = {e.key: e for e in list_entries(store)}
        total = sum(e.size for e in after.values())
        removed = set(before) - set(after)
        assert kept <= set(after)  # never a pinned, locked or protected entry
        assert total <= bound or set(after) <= kept  # within the bound, or nothing else left
        if total <= bound and removed:  # no more than needed: the last one removed was due
            assert bound - total < max(before[k].size for k in removed)

        def recency(key: str) -> tuple[float, str]:
            return max(before[key].created, last.get(key, 0.0)), key

        evictable_left = [recency(k) for k in after if k not in kept]
        if removed and evictable_left:  # least recently used first
            assert max(recency(k) for k in removed) < min(evictable_left)
        for key in after:
            assert store.publication(key).state == "published"


def test_the_bound_counts_an_entrys_unpacked_copy_and_not_one_without_its_entry(tmp_path,
                                                                               compile_fn):
    d = str(tmp_path / "cache")
    builder = TwoTierCache(d)
    for key in KEYS[:2]:
        builder.get_or_compile(key, compile_fn(key))
    store = open_store(d)
    # A copy of KEYS[0]'s package (compile/tiers/unpacked.py), and one whose entry is gone.
    store.write(f".unpacked/{KEYS[0]}-{'a' * 32}/model.so", b"x" * ENTRY)
    store.write(f".unpacked/{KEYS[5]}-{'b' * 32}/model.so", b"y" * (3 * ENTRY))
    hit(d, KEYS[1], time.time() + 1)  # KEYS[0] is the least recently used

    # The entries' records alone (2 x ENTRY) fit; with KEYS[0]'s copy they do not.
    done = Evictor(store, 2 * ENTRY, recent_use_seconds=0).run()
    assert done is not None and [e.key for e in done.withdrawn] == [KEYS[0]]
    assert done.withdrawn[0].size == 2 * ENTRY  # its record's files and its copy
    assert present(d) == [KEYS[1]]
    assert not store.list(f".unpacked/{KEYS[0]}-{'a' * 32}")  # the copy went with it
    # The orphan copy is `cache gc`'s: it never makes the bound evict an entry.
    assert Evictor(store, ENTRY, recent_use_seconds=0).run() == eviction.Withdrawn(total=ENTRY)
    assert present(d) == [KEYS[1]]
    plan = plan_prune(store, max_size=ENTRY)
    assert not plan.delete, plan
