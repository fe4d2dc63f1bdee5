"""The remote tier: racing promoters (POSIX and S3), fetches from S3, and an outage.

S3 is moto's real HTTP API on loopback (tests/conftest.py); the outage test starts a
server of its own so that stopping it cannot disturb other tests.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import pytest
from cache_workers import entry_is_right, parse_result, release_barrier, worker_command

from vllm_neuron.backends import open_store
from vllm_neuron.backends.testing import free_port
from vllm_neuron.compile import save_cache
from vllm_neuron.compile.entry.events import read_stats
from vllm_neuron.compile.flow.cache import PrecompiledOnlyMiss, TwoTierCache
from vllm_neuron.compile.tiers.inventory import verify_entries

KEY = "feedfacefeedfacefeedfacefeedface"
NODES = 6


def _keys(n: int) -> list[str]:
    return [uuid.uuid5(uuid.NAMESPACE_OID, str(i)).hex for i in range(n)]


def _populate_nodes(tmp_path, compile_fn, n: int) -> list[str]:
    dirs = []
    for i in range(n):
        d = str(tmp_path / f"node-{i}")
        TwoTierCache(d).get_or_compile(KEY, compile_fn(KEY))
        dirs.append(d)
    return dirs


def _race_promoters(tmp_path, node_dirs: list[str], remote: str) -> list[dict]:
    barrier = str(tmp_path / "barrier")
    procs = [
        subprocess.Popen(
            worker_command("promote", {"cache_dir": d, "remote": remote, "key": KEY,
                                       "barrier_dir": barrier}),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for d in node_dirs
    ]
    release_barrier(barrier, len(procs), procs, timeout=60)
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(parse_result(out))
    return results


def test_racing_promoters_to_a_posix_remote_publish_exactly_once(tmp_path, compile_fn):
    nodes = _populate_nodes(tmp_path, compile_fn, NODES)
    remote = str(tmp_path / "remote")
    results = _race_promoters(tmp_path, nodes, remote)

    assert all(r["ok"] for r in results), results
    assert sorted(r["published"] for r in results) == [False] * (NODES - 1) + [True]
    store = open_store(remote)
    assert store.published_children("") == [KEY]
    assert entry_is_right(os.path.join(remote, KEY), KEY) is None
    assert os.listdir(os.path.join(remote, ".staging")) == []  # losers cleaned up
    assert [(r.key, r.ok) for r in verify_entries(store)] == [(KEY, True)]


def test_racing_promoters_to_s3_publish_exactly_once(tmp_path, compile_fn, s3_env, s3_store_url):
    nodes = _populate_nodes(tmp_path, compile_fn, NODES)
    results = _race_promoters(tmp_path, nodes, s3_store_url)

    assert all(r["ok"] for r in results), results
    assert sorted(r["published"] for r in results) == [False] * (NODES - 1) + [True]
    store = open_store(s3_store_url)
    assert store.published_children("") == [KEY]
    # One version under the entry: every loser removed what it had uploaded.
    assert len(store.list_dir(f"{KEY}/.v")) == 1
    assert [(r.key, r.ok) for r in verify_entries(store)] == [(KEY, True)]
    # And any node can use it.
    consumer = TwoTierCache(str(tmp_path / "consumer"), remote=s3_store_url)
    result = consumer.get_or_compile(KEY, compile_fn(KEY, fail="must not compile"))
    assert result.source == "remote"
    assert entry_is_right(result.path, KEY) is None


def test_fetch_from_s3_configured_through_the_environment(
    tmp_path, compile_fn, s3_env, s3_store_url, monkeypatch
):
    from vllm_neuron import envs
    from vllm_neuron.assembly import build_runtime

    builder = str(tmp_path / "builder")
    TwoTierCache(builder).get_or_compile(KEY, compile_fn(KEY))
    assert save_cache(builder, s3_store_url, KEY) is True

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "consumer"))
    monkeypatch.setenv("NEURON_LIBTORCH_REMOTE_CACHE", s3_store_url)
    monkeypatch.setenv("VLLM_NEURON_DISABLE_WARMUP_COMPILE", "1")
    monkeypatch.setenv("VLLM_NEURON_TOOLCHAIN", "host")
    monkeypatch.delenv("NEURON_LIBTORCH_DISABLE_COMPILE_CACHE", raising=False)
    envs.reset_for_tests()
    try:
        cache = build_runtime().cache
    finally:
        envs.reset_for_tests()
    result = cache.get_or_compile(KEY, compile_fn(KEY, fail="must not compile"))
    assert result.source == "remote"
    assert entry_is_right(result.path, KEY) is None
    stats = read_stats(cache.local_dir)
    assert (stats.fetches, stats.compiles) == (1, 0)
    # Pre-compiled-only: what the remote cannot serve is an error, not a compile.
    with pytest.raises(PrecompiledOnlyMiss, match=s3_store_url):
        cache.get_or_compile(_keys(1)[0], compile_fn(_keys(1)[0]))


def test_remote_outage_mid_run_compiles_locally_with_one_warning(
    tmp_path, compile_fn, cache_warnings, s3_server
):
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    stopped = False
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="outage")
        remote = "s3://outage/cache"
        options = {"endpoint_url": endpoint}
        builder = str(tmp_path / "builder")
        TwoTierCache(builder).get_or_compile(KEY, compile_fn(KEY))
        assert save_cache(builder, remote, KEY, remote_options=options) is True

        node = TwoTierCache(str(tmp_path / "node"), remote=remote, remote_options=options)
        assert node.get_or_compile(KEY, compile_fn(KEY)).source == "remote"  # remote is up

        server.stop()
        stopped = True
        start = time.monotonic()
        for key in _keys(4):
            result = node.get_or_compile(key, compile_fn(key))
            assert result.source == "compiled"
            assert entry_is_right(result.path, key) is None
        elapsed = time.monotonic() - start
    finally:
        if not stopped:
            server.stop()

    warnings = cache_warnings()
    assert len(warnings) == 1, warnings
    assert remote in warnings[0] and "NEURON_LIBTORCH_REMOTE_CACHE" in warnings[0]
    assert elapsed < 30, elapsed  # bounded timeouts: an outage does not stall start-up
    stats = read_stats(node.local_dir)
    assert stats.compiles == 4 and stats.remote_outages == 1


def test_unreachable_remote_in_precompiled_only_mode_is_still_a_clear_miss(
    tmp_path, compile_fn, cache_warnings, s3_server
):
    remote = "s3://nobody/cache"
    cache = TwoTierCache(str(tmp_path), remote=remote, precompiled_only=True,
                         remote_options={"endpoint_url": f"http://127.0.0.1:{free_port()}",
                                         "retries": 0})
    with pytest.raises(PrecompiledOnlyMiss, match="VLLM_NEURON_DISABLE_WARMUP_COMPILE"):
        cache.get_or_compile(KEY, compile_fn(KEY))
    assert len(cache_warnings()) == 1
