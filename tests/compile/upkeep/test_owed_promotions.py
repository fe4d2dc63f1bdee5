"""Promotions owed (compile/upkeep/owed.py): what a node compiled for the fleet reaches the
remote even when the promotion did not happen in the process that compiled it.

The process killed between its local publication and its promotion is the crash matrix's
``compile.published`` point (tests/test_crash_matrix.py, real processes on a folder, NFS
and S3, and a real Inductor compile). Here: a remote that was down during the compile, a
note whose entry is gone or corrupt, a read-only remote, and ``cache gc``'s view of notes.
"""

from __future__ import annotations

import os
import uuid

from cache_workers import entry_is_right

from vllm_neuron.backends import open_store
from vllm_neuron.backends.testing import HANG
from vllm_neuron.compile.entry.events import CACHE_EVENTS, EVENTS_STREAM, Promoted, read_stats
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.inventory import verify_entries
from vllm_neuron.compile.upkeep.collect import plan_gc
from vllm_neuron.compile.upkeep.owed import OWED_DIR, owe_promotion, owed_keys

KEY = uuid.uuid5(uuid.NAMESPACE_URL, "owed-a").hex
OTHER = uuid.uuid5(uuid.NAMESPACE_URL, "owed-b").hex
READER = {"create": False}  # the remote must be there: a missing folder is an outage


def test_a_compile_during_an_outage_is_promoted_by_the_next_start(
    tmp_path, compile_fn, cache_warnings
):
    node, remote = str(tmp_path / "node"), str(tmp_path / "remote")
    down = TwoTierCache(node, remote=remote, remote_options=READER)
    assert down.get_or_compile(KEY, compile_fn(KEY)).source == "compiled"
    assert down.remote is None  # the outage: one warning, the node went on alone
    assert len(cache_warnings()) == 1
    assert owed_keys(open_store(node)) == [KEY]

    os.mkdir(remote)  # the remote is back
    restarted = TwoTierCache(node, remote=remote, remote_options=READER)
    hit = restarted.get_or_compile(KEY, compile_fn(KEY, fail="must not compile"))
    assert hit.source == "local"  # served at once: the promotion runs beside it
    assert restarted.wait_for_upkeep(timeout=60)

    shared = open_store(remote)
    assert shared.published(KEY) is not None
    assert [r.ok for r in verify_entries(shared)] == [True]
    assert owed_keys(open_store(node)) == []
    assert read_stats(node).promotions == 1
    # Another node now fetches it instead of compiling it again.
    other = TwoTierCache(str(tmp_path / "other"), remote=remote, remote_options=READER)
    fetched = other.get_or_compile(KEY, compile_fn(KEY, fail="must not compile"))
    assert fetched.source == "remote" and entry_is_right(fetched.path, KEY) is None


def test_a_promotion_done_in_the_compiling_process_owes_nothing(tmp_path, compile_fn):
    node, remote = str(tmp_path / "node"), str(tmp_path / "remote")
    cache = TwoTierCache(node, remote=remote)
    assert cache.wait_for_upkeep(HANG)  # its pass is over: only the promotion settles
    assert cache.get_or_compile(KEY, compile_fn(KEY)).source == "compiled"
    assert open_store(remote).published(KEY) is not None
    assert owed_keys(open_store(node)) == []


def test_the_note_of_a_compile_still_running_survives_another_cache_s_start(
    tmp_path, compile_fn
):
    node, remote = str(tmp_path / "node"), str(tmp_path / "remote")
    # Short lock leases: the other cache gives up waiting for the compile's lock quickly.
    compiling = TwoTierCache(node, remote=remote, lease_duration=0.5)
    assert compiling.wait_for_upkeep(HANG)
    seen: dict[str, list[str]] = {}

    def compile_while_another_cache_starts(out: str) -> dict[str, str]:
        other = TwoTierCache(node, remote=remote, lease_duration=0.5)
        assert other.wait_for_upkeep(HANG)  # its pass met our note, without our entry
        seen["notes"] = owed_keys(open_store(node))
        return compile_fn(KEY)(out)

    assert compiling.get_or_compile(KEY, compile_while_another_cache_starts).source == (
        "compiled")
    assert seen["notes"] == [KEY]  # the live compile's note was left alone
    assert open_store(remote).published(KEY) is not None and owed_keys(open_store(node)) == []


def test_caches_opening_one_tier_settle_a_note_once(tmp_path, compile_fn):
    node, remote = str(tmp_path / "node"), str(tmp_path / "remote")
    down = TwoTierCache(node, remote=remote, remote_options=READER)
    down.get_or_compile(KEY, compile_fn(KEY))  # owed: the remote is not there
    os.mkdir(remote)
    ranks = [TwoTierCache(node, remote=remote, remote_options=READER) for _ in range(4)]
    for rank in ranks:  # all at once, as a TP engine's ranks start
        rank.get_or_compile(KEY, compile_fn(KEY, fail="must not compile"))
    assert all(rank.wait_for_upkeep(HANG) for rank in ranks)
    events = open_store(node).log(EVENTS_STREAM).read(CACHE_EVENTS).records
    promotions = [e for e in events if isinstance(e, Promoted)]
    assert [(e.key, e.published) for e in promotions] == [(KEY, True)]
    assert owed_keys(open_store(node)) == []


def test_a_pass_killed_holding_the_upkeep_lease_is_taken_over(
    tmp_path, compile_fn, monkeypatch
):
    """On a tier without kernel locks (NFS) a process killed mid-pass leaves the tier's
    upkeep lock held by its lease for up to one period: the next start's pass takes it
    over and pays what was owed, rather than leaving it to a start weeks later (the crash
    matrix's ``compile.published`` on NFS met this when its killed process was mid-pass)."""
    from vllm_neuron.backends import router
    from vllm_neuron.compile.upkeep.background import UPKEEP_LOCK

    node, remote = str(tmp_path / "node"), str(tmp_path / "remote")
    real_profile_for = router.profile_for

    def nfs_node(path: str, mounts_text: str | None = None) -> tuple[str, bool]:
        inside = os.path.abspath(path).startswith(node)
        return ("nfs", False) if inside else real_profile_for(path, mounts_text)

    monkeypatch.setattr(router, "profile_for", nfs_node)
    period = 0.5
    down = TwoTierCache(node, remote=remote, remote_options=READER, lease_duration=period)
    assert down.get_or_compile(KEY, compile_fn(KEY)).source == "compiled"  # owed
    assert down.wait_for_upkeep(HANG)
    local = open_store(node)
    assert not local.capabilities.kernel_locks  # the tier under test takes leases
    dead = local.lock(UPKEEP_LOCK, lease_duration=period)
    dead.acquire(timeout=0)
    dead._stop.set()  # type: ignore[attr-defined] - its heartbeat dies with its process
    os.mkdir(remote)

    restarted = TwoTierCache(node, remote=remote, remote_options=READER,
                             lease_duration=period)  # fmt: skip
    assert restarted.get_or_compile(KEY, compile_fn(KEY, fail="must not compile")).source == (
        "local")
    assert restarted.wait_for_upkeep(HANG)
    assert open_store(remote).published(KEY) is not None
    assert owed_keys(local) == []


def test_a_note_without_its_entry_is_dropped_and_promotes_nothing(tmp_path):
    node, remote = str(tmp_path / "node"), str(tmp_path / "remote")
    owe_promotion(open_store(node), KEY, remote)  # a compile killed before it published
    cache = TwoTierCache(node, remote=remote)
    assert cache.wait_for_upkeep(timeout=60)
    assert owed_keys(open_store(node)) == []
    assert open_store(remote).list("") == []


def test_a_corrupt_entry_is_never_shared(tmp_path, compile_fn, cache_warnings):
    node, remote = str(tmp_path / "node"), str(tmp_path / "remote")
    TwoTierCache(node).get_or_compile(KEY, compile_fn(KEY))  # no remote: nothing owed
    store = open_store(node)
    prefix = store.published(KEY)
    assert prefix is not None
    victim = next(k for k in store.list(prefix) if not k.endswith("entry.json"))
    data = bytearray(store.read(victim) or b"")
    data[0] ^= 0xFF  # same size: only a checksum tells
    store.write(victim, bytes(data))
    owe_promotion(store, KEY, remote)

    cache = TwoTierCache(node, remote=remote)
    assert cache.wait_for_upkeep(timeout=60)
    assert open_store(remote).published(KEY) is None
    assert owed_keys(store) == []
    assert any(KEY in w and "not promoting" in w for w in cache_warnings())
    assert store.published(KEY) is None  # quarantined: never served again either


def test_a_read_only_remote_is_owed_nothing(tmp_path, compile_fn):
    node, remote = str(tmp_path / "node"), str(tmp_path / "remote")
    cache = TwoTierCache(node, remote=remote, remote_write="off")
    assert cache.get_or_compile(KEY, compile_fn(KEY)).source == "compiled"
    assert owed_keys(open_store(node)) == []
    assert open_store(remote).published(KEY) is None


def test_gc_keeps_a_note_whose_entry_is_there_and_collects_one_without(tmp_path, compile_fn):
    node = str(tmp_path / "node")
    TwoTierCache(node).get_or_compile(KEY, compile_fn(KEY))
    store = open_store(node)
    owe_promotion(store, KEY, "s3://bucket/cache")
    owe_promotion(store, OTHER, "s3://bucket/cache")  # its compile never published

    plan = plan_gc(store, older_than=-1)
    assert [i.where for i in plan.items] == [f"{OWED_DIR}/{OTHER}.json"]
    assert f"{OWED_DIR}/{KEY}.json" in {i.where for i in plan.kept}
    outcome = plan.execute()
    assert not outcome.failed and not outcome.stayed
    assert owed_keys(store) == [KEY]


def test_an_unusable_lease_folder_drops_that_keys_note_never_the_remote(
    tmp_path, compile_fn, cache_warnings
):
    """A writer of the remote plants a file where one owed key's lease folder goes: the
    next start's promotion of that key waits one lease period, then drops its note with
    one warning (the fleet compiles it where it misses it); the remote is no outage, and
    the other owed key is promoted (docs/trust.md, issue 39)."""
    node, remote = str(tmp_path / "node"), str(tmp_path / "remote")
    down = TwoTierCache(node, remote=remote, remote_options=READER)
    for key in (KEY, OTHER):
        assert down.get_or_compile(key, compile_fn(key)).source == "compiled"
    assert owed_keys(open_store(node)) == sorted([KEY, OTHER])

    os.mkdir(remote)
    open_store(remote).write(f".locks/{KEY}", b"not a folder")
    restarted = TwoTierCache(node, remote=remote, remote_options={**READER, "lock": "lease"},
                             remote_lease_seconds=0.5)  # fmt: skip
    assert restarted.wait_for_upkeep(timeout=60)

    shared = open_store(remote)
    assert shared.published(OTHER) is not None and shared.published(KEY) is None
    assert owed_keys(open_store(node)) == []
    assert read_stats(node).remote_outages == 1  # the first start's, only
    assert [w for w in cache_warnings() if "cannot be used" in w and KEY in w]
