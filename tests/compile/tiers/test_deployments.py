"""A deployment's record on the remote (tiers/deployments.py), and what a new node of a known
deployment does with it (head_start.py, CompileRuntime.start_for_deployment): real folder
tiers, the cache's own prefetcher, no compile worker and no CPU probe started."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from vllm_neuron.backends import open_store
from vllm_neuron.backends.records import encode
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.head_start import fleet_knows, start_cpu_probe_if_cold
from vllm_neuron.compile.runtime import CompiledGraph, CompileRuntime
from vllm_neuron.compile.tiers import deployments
from vllm_neuron.compile.tiers.deployments import (
    DeploymentRanks,
    deployment_keys,
    deployment_known,
    record_path,
    remember_keys,
)
from vllm_neuron.compile.tiers.location import holds_entries
from vllm_neuron.compile.toolchains.host import HostToolchain
from vllm_neuron.compile.trust.policy import TrustPolicy
from vllm_neuron.compile.workers.pool import WorkerPool
from vllm_neuron.envs import CompileCacheSettings
from vllm_neuron.envs.host_mode import VLLM_NEURON_CPU_PROBE_STARTED

DEPLOYMENT = "d" * 32
OTHER = "e" * 32
KEYS = [f"{i:032x}" for i in (3, 1, 2)]


@pytest.fixture
def remote(tmp_path: Path):
    return open_store(str(tmp_path / "remote"))


@pytest.mark.parametrize("kind", ["s3", "posix"])
def test_records_round_trip_on_every_backend_and_the_fleet_knows_them(request, tmp_path, kind):
    if kind == "s3":
        request.getfixturevalue("s3_env")
        url = request.getfixturevalue("s3_store_url")
    else:
        url = str(tmp_path / "remote")
    store = open_store(url)
    settings = CompileCacheSettings(cache_root=str(tmp_path / "root"), remote_cache=url)
    assert not fleet_knows(settings, None) and not fleet_knows(settings, DEPLOYMENT, 1)
    assert remember_keys(store, DEPLOYMENT, 0, KEYS)
    assert deployment_keys(store, DEPLOYMENT, 0) == sorted(KEYS)
    assert fleet_knows(settings, None) and fleet_knows(settings, DEPLOYMENT, 1)
    assert not fleet_knows(settings, DEPLOYMENT, 2)


def test_a_ranks_keys_round_trip_sorted_and_are_written_only_when_they_change(remote):
    assert deployment_keys(remote, DEPLOYMENT, 0) is None
    assert remember_keys(remote, DEPLOYMENT, 0, [*KEYS, KEYS[0], "not a key"]) is True
    assert deployment_keys(remote, DEPLOYMENT, 0) == sorted(KEYS)
    before = os.stat(remote.local_path(record_path(DEPLOYMENT, 0))).st_mtime_ns
    assert remember_keys(remote, DEPLOYMENT, 0, list(reversed(KEYS))) is False  # unchanged
    assert os.stat(remote.local_path(record_path(DEPLOYMENT, 0))).st_mtime_ns == before
    assert remember_keys(remote, DEPLOYMENT, 0, []) is False  # nothing loaded: nothing said
    assert remember_keys(remote, DEPLOYMENT, 0, KEYS[:1]) is True
    assert deployment_keys(remote, DEPLOYMENT, 0) == KEYS[:1]


def test_a_deployment_is_known_when_every_rank_is_recorded(remote):
    remember_keys(remote, DEPLOYMENT, 0, KEYS)
    assert deployment_known(remote, DEPLOYMENT, 1)
    assert not deployment_known(remote, DEPLOYMENT, 2)  # rank 1 never started
    remember_keys(remote, DEPLOYMENT, 1, KEYS)
    assert deployment_known(remote, DEPLOYMENT, 2)
    assert not deployment_known(remote, OTHER, 1)


@pytest.mark.parametrize("bad", ["D" * 32, "d" * 31, "../" + "d" * 29, ""])
def test_a_deployment_that_is_not_32_hex_digits_is_refused(remote, bad):
    with pytest.raises(ValueError, match="32 lowercase hex"):
        record_path(bad, 0)
    with pytest.raises(ValueError, match="not negative"):
        record_path(DEPLOYMENT, -1)


def _plant(remote, data: bytes, rank: int = 0) -> None:
    remote.write(record_path(DEPLOYMENT, rank), data)


@pytest.mark.parametrize("what", ["junk", "another deployment", "another rank", "a fifo",
                                  "too large"])
def test_a_record_someone_else_wrote_is_ignored_with_one_warning(remote, caplog, what):
    good = DeploymentRanks(deployment=DEPLOYMENT, rank=0, keys=KEYS, at=0.0, host="h")
    if what == "junk":
        _plant(remote, b"\x00{not json")
    elif what == "another deployment":
        _plant(remote, encode(DeploymentRanks(deployment=OTHER, rank=0, keys=KEYS, at=0.0,
                                              host="h\n")))  # fmt: skip
    elif what == "another rank":
        _plant(remote, encode(DeploymentRanks(deployment=DEPLOYMENT, rank=1, keys=KEYS, at=0.0,
                                              host="h")))  # fmt: skip
    elif what == "a fifo":
        path = remote.local_path(record_path(DEPLOYMENT, 0))
        os.makedirs(os.path.dirname(path))
        os.mkfifo(path)  # never waited on: the store refuses what is not a regular file
    else:
        _plant(remote, encode(good)[:-1] + b" " * (1 << 20) + b"}")
    with caplog.at_level(logging.WARNING, "vllm_neuron.compile"):
        for _ in range(2):
            assert deployment_keys(remote, DEPLOYMENT, 0) is None
            assert not deployment_known(remote, DEPLOYMENT, 1)
    said = [r for r in caplog.records if "is ignored" in r.getMessage()]
    assert len(said) == 1 and record_path(DEPLOYMENT, 0) in said[0].getMessage(), said
    assert "\n" not in said[0].getMessage()


def test_a_record_of_other_names_and_too_many_keys_is_used_only_for_its_keys(
        remote, monkeypatch, caplog):  # fmt: skip
    monkeypatch.setattr(deployments, "MAX_KEYS", 2)
    _plant(remote, encode(DeploymentRanks(deployment=DEPLOYMENT, rank=0, at=0.0, host="h",
                                          keys=[*KEYS, "../etc/passwd", "A" * 32])))
    with caplog.at_level(logging.WARNING, "vllm_neuron.compile"):
        assert deployment_keys(remote, DEPLOYMENT, 0) == sorted(KEYS)[:2]
    assert any("5 names, 3 of them keys" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------- the decisions that use it
@pytest.fixture
def first_process(monkeypatch, tmp_path):
    monkeypatch.setenv(VLLM_NEURON_CPU_PROBE_STARTED, "restored after the test")
    monkeypatch.delenv(VLLM_NEURON_CPU_PROBE_STARTED)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


def test_the_probe_waits_for_the_deployment_then_a_known_one_starts_none(tmp_path, remote,
                                                                          first_process):
    settings = CompileCacheSettings(cache_root=str(tmp_path / "root"),
                                    remote_cache=str(tmp_path / "remote"))  # fmt: skip
    assert not fleet_knows(settings, None)  # a fleet's first node: the probe starts early
    remember_keys(remote, OTHER, 0, KEYS)
    assert fleet_knows(settings, None) and not fleet_knows(settings, DEPLOYMENT, 1)
    # vLLM asks for its platform: a remote that records deployments leaves it to the
    # configuration (nothing marked, so the configured call decides).
    assert start_cpu_probe_if_cold(settings) is None
    assert VLLM_NEURON_CPU_PROBE_STARTED not in os.environ
    remember_keys(remote, DEPLOYMENT, 0, KEYS)
    assert start_cpu_probe_if_cold(settings, configured=True, deployment=DEPLOYMENT) is None
    assert os.environ[VLLM_NEURON_CPU_PROBE_STARTED] == str(os.getpid())  # decided
    assert not (tmp_path / "inductor").exists() and not any((tmp_path / "tmp").iterdir())


def test_a_remote_that_cannot_be_read_is_taken_for_a_cold_fleet(tmp_path):
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote" / ".deployments").write_bytes(b"a file where a folder should be")
    settings = CompileCacheSettings(cache_root=str(tmp_path / "root"),
                                    remote_cache=str(tmp_path / "remote"))  # fmt: skip
    assert not fleet_knows(settings, DEPLOYMENT, 1)
    assert not fleet_knows(CompileCacheSettings(cache_root=str(tmp_path / "root")), None)


def _graph(key: str, cache: TwoTierCache, compile_fn) -> CompiledGraph:
    result = cache.get_or_compile(key, compile_fn(key))
    return CompiledGraph(key=key, components={}, gm=None, example_inputs=(), compiler_flags=[],
                         toolchain=HostToolchain(), result=result, artifact=None)  # type: ignore[arg-type]


def test_a_new_node_of_a_known_deployment_fetches_its_graphs_and_starts_no_worker(
        tmp_path, compile_fn):  # fmt: skip
    remote_dir = str(tmp_path / "remote")
    builder = CompileRuntime(TwoTierCache(str(tmp_path / "builder"), remote=remote_dir,
                                          compile_workers=2), HostToolchain())  # fmt: skip
    builder.history.extend(_graph(k, builder.cache, compile_fn) for k in KEYS)
    assert builder.remember_deployment(DEPLOYMENT, 0) is True
    assert builder.remember_deployment(DEPLOYMENT, 0) is False  # said already
    assert builder.remember_deployment(None, 0) is False  # no deployment: nothing to say

    pool = WorkerPool(idle_seconds=3600.0)
    node = CompileRuntime(TwoTierCache(str(tmp_path / "node"), remote=remote_dir,
                                       compile_workers=2), HostToolchain())  # fmt: skip
    assert node.start_for_deployment(DEPLOYMENT, 0, pool) == f"fetch {len(KEYS)}"
    assert pool.started == []  # they will be fetched, not compiled
    deadline = time.monotonic() + 60
    while node.cache._prefetcher.pending and time.monotonic() < deadline:
        node.cache._prefetcher._wake.wait(0.05)  # the prefetcher's own pace
    for key in KEYS:  # every one a local hit now, counted once, as the fetch
        assert node.cache.get_or_compile(key, _never).source == "local"
    # A rank the fleet never recorded, or a node with entries: nothing begun here.
    assert node.start_for_deployment(DEPLOYMENT, 1, pool) is None
    other = CompileRuntime(TwoTierCache(str(tmp_path / "other"), remote=remote_dir,
                                        compile_workers=1), HostToolchain())  # fmt: skip
    assert other.start_for_deployment(OTHER, 0, pool) is None and pool.started == []
    assert holds_entries(node.cache.local_dir)


def test_each_rank_of_a_new_node_fetches_though_another_rank_fetched_first(tmp_path, compile_fn):
    """The ranks of one engine share the node's local tier. A rank that looks once another
    rank's fetch has landed there finds entries; what it was told the tier held before any
    rank could write (the worker looks before its device's rendezvous: plugin/worker.py)
    decides, so it fetches its own graphs too - one only it uses included."""
    remote_dir = str(tmp_path / "remote")
    seed = TwoTierCache(str(tmp_path / "seed"), remote=remote_dir)
    own = "a" * 32  # rank 1's alone
    for key in [*KEYS, own]:
        seed.get_or_compile(key, compile_fn(key))
    remember_keys(open_store(remote_dir), DEPLOYMENT, 0, KEYS)
    remember_keys(open_store(remote_dir), DEPLOYMENT, 1, [*KEYS[:2], own])
    node = str(tmp_path / "node")
    ranks = [CompileRuntime(TwoTierCache(node, remote=remote_dir, compile_workers=2),
                            HostToolchain()) for _ in range(2)]  # fmt: skip
    pool = WorkerPool(idle_seconds=3600.0)
    assert ranks[0].start_for_deployment(DEPLOYMENT, 0, pool, tier_was_empty=True) == "fetch 3"
    deadline = time.monotonic() + 60
    while not holds_entries(node) and time.monotonic() < deadline:
        ranks[0].cache._prefetcher._wake.wait(0.05)
    assert holds_entries(node)  # rank 0's fetch landed before rank 1 looks
    # Looked at now, rank 1 would take the node for a warm one and begin nothing.
    assert ranks[1].start_for_deployment(DEPLOYMENT, 1, pool) is None
    assert ranks[1].start_for_deployment(DEPLOYMENT, 1, pool, tier_was_empty=True) == "fetch 3"
    assert pool.started == []
    deadline = time.monotonic() + 60
    while ranks[1].cache._prefetcher.pending and time.monotonic() < deadline:
        ranks[1].cache._prefetcher._wake.wait(0.05)
    assert ranks[1].cache.get_or_compile(own, _never).source == "local"
    # Told the tier held entries before the start (a warm node): nothing begun.
    assert ranks[1].start_for_deployment(DEPLOYMENT, 1, pool, tier_was_empty=False) is None


def _never(out: str) -> dict:
    raise AssertionError("compiled a graph the remote had")


@pytest.mark.parametrize("who", ["a node that cannot sign under require",
                                 "a node whose remote is read-only",
                                 "a start served by its local tier"])
def test_only_a_node_that_publishes_and_learnt_something_records_its_keys(
        tmp_path, compile_fn, who):  # fmt: skip
    remote_dir = str(tmp_path / "remote")
    TwoTierCache(str(tmp_path / "seed"), remote=remote_dir).get_or_compile(
        KEYS[0], compile_fn(KEYS[0]))
    if who.startswith("a start served"):
        local = str(tmp_path / "warm")
        TwoTierCache(local).get_or_compile(KEYS[0], compile_fn(KEYS[0]))
        cache = TwoTierCache(local, remote=remote_dir)
    elif who.endswith("require"):
        cache = TwoTierCache(str(tmp_path / "node"), remote=remote_dir,
                             trust=TrustPolicy(mode="require"))  # trusted keys, none to sign
    else:
        cache = TwoTierCache(str(tmp_path / "node"), remote=remote_dir, remote_write="off")
    runtime = CompileRuntime(cache, HostToolchain())
    runtime.history.append(_graph(KEYS[0], cache, compile_fn))
    assert runtime.remember_deployment(DEPLOYMENT, 0) is False
    assert deployment_keys(open_store(remote_dir), DEPLOYMENT, 0) is None


def test_a_record_that_cannot_be_read_or_believed_starts_the_cold_machinery(
        tmp_path, compile_fn, monkeypatch):  # fmt: skip
    from vllm_neuron.compile import runtime as runtime_module

    remote_dir = str(tmp_path / "remote")
    remember_keys(open_store(remote_dir), DEPLOYMENT, 0, KEYS)
    pool = WorkerPool(idle_seconds=3600.0)
    # Under require a record is not believed (it is not signed): no fetch begun from it.
    strict = CompileRuntime(TwoTierCache(str(tmp_path / "strict"), remote=remote_dir,
                                         compile_workers=1, trust=TrustPolicy(mode="require")),
                            HostToolchain())  # fmt: skip
    assert strict.start_for_deployment(DEPLOYMENT, 0, pool) is None
    assert strict.cache._prefetcher.pending == []

    def down(*args, **kwargs):
        raise OSError("the remote does not answer")

    monkeypatch.setattr(runtime_module, "deployment_keys", down)
    node = CompileRuntime(TwoTierCache(str(tmp_path / "node"), remote=remote_dir,
                                       compile_workers=1), HostToolchain())  # fmt: skip
    assert node.start_for_deployment(DEPLOYMENT, 0, pool) is None  # as a cold start: no raise
    assert node.cache._prefetcher.pending == [] and pool.started == []


def test_after_the_start_up_nothing_of_the_record_is_waited_for_or_kept(tmp_path, compile_fn):
    remote_dir = str(tmp_path / "remote")
    seed = TwoTierCache(str(tmp_path / "seed"), remote=remote_dir)
    seed.get_or_compile(KEYS[0], compile_fn(KEYS[0]))
    absent = "f" * 32  # named by the record, never published
    remember_keys(open_store(remote_dir), DEPLOYMENT, 0, [KEYS[0], absent])
    node = CompileRuntime(TwoTierCache(str(tmp_path / "node"), remote=remote_dir,
                                       compile_workers=1), HostToolchain())  # fmt: skip
    assert node.start_for_deployment(DEPLOYMENT, 0) == "fetch 2"
    deadline = time.monotonic() + 60
    while holds_entries(node.cache.local_dir) is False and time.monotonic() < deadline:
        node.cache._prefetcher._wake.wait(0.05)
    assert absent in node.cache._prefetcher.pending
    assert node.remember_deployment(None, 0) is False  # the start-up is over
    assert node.cache._prefetcher.pending == []
    assert node.cache._prefetch_look.prefetched == set()  # no longer kept from eviction
