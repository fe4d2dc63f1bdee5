"""Compile once per fleet: nodes (separate local tiers) with several ranks each, on one
shared remote (a folder, and S3 on moto's real HTTP API), started together.

Each "rank" is a real process (cache_workers.run_get) with the fake compile, whose bytes
say which key they belong to and which leaves a marker per compile *started*, so a test
counts compiles across the fleet even for a process it killed. Every "meanwhile" is a
handshake on files: the held compile says where it stopped (``hold_dir``), a process
polling the remote for another node's compile says so (``fleet_wait_dir``); time limits
only catch hangs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from typing import Any

import pytest
from cache_workers import (
    FLEET_WAITING,
    HELD,
    RESUME,
    SAFETY,
    finish_workers,
    release_barrier,
    wait_for,
    worker_command,
    worker_env,
)

from vllm_neuron.backends import open_store
from vllm_neuron.backends.records import LEASE_RECORDS
from vllm_neuron.backends.testing import free_port
from vllm_neuron.compile.entry.events import read_stats
from vllm_neuron.compile.entry.record import ENTRY_RECORD
from vllm_neuron.compile.tiers.inventory import verify_entries
from vllm_neuron.compile.trust.signing import SIGNATURE_FILE, decode_signature, generate_key_pair

KEY = "f1ee7f1ee7f1ee7f1ee7f1ee7f1ee7aa"
OTHER = "f1ee7f1ee7f1ee7f1ee7f1ee7f1ee7bb"


def _spawn(tmp_path: Any, fleet: dict[str, Any], *, nodes: int, ranks: int,
           key: str = KEY, **args: Any) -> list[subprocess.Popen[str]]:
    """`nodes` x `ranks` getters, lined up at one barrier (released by the caller)."""
    procs = []
    for node in range(nodes):
        for _ in range(ranks):
            worker_args = {
                "key": key,
                "cache_dir": str(tmp_path / f"node{node}"),
                "barrier_dir": str(tmp_path / "barrier"),
                "marker_dir": str(tmp_path / "markers"),
                "fleet_wait_dir": str(tmp_path / "fleet-waits"),
                "timeout": SAFETY,
                **fleet,
                **args,
            }
            procs.append(subprocess.Popen(
                worker_command("get", worker_args), env=worker_env(),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _go(tmp_path: Any, procs: list[subprocess.Popen[str]]) -> None:
    release_barrier(str(tmp_path / "barrier"), len(procs), procs)


def _started(tmp_path: Any, marker: str = "markers") -> int:
    path = tmp_path / marker
    return len([n for n in os.listdir(path) if n.startswith("started-")]) if path.exists() else 0


def _fleet_waiters(tmp_path: Any) -> list[str]:
    path = tmp_path / "fleet-waits"
    return [n for n in os.listdir(path) if n.startswith(FLEET_WAITING)] if path.exists() else []


def _remote_store(fleet: dict[str, Any]) -> Any:
    return open_store(fleet["remote"], create=False)


def _node_stats(tmp_path: Any, nodes: int) -> list[Any]:
    return [read_stats(str(tmp_path / f"node{n}")) for n in range(nodes)]


@pytest.mark.timeout(2 * SAFETY)
def test_a_cold_fleet_compiles_a_graph_once(tmp_path, shared_remote):
    procs = _spawn(tmp_path, shared_remote, nodes=4, ranks=2, delay=1.0)
    _go(tmp_path, procs)
    results = finish_workers(procs)

    assert all(r["ok"] and r["wrong"] is None for r in results), results
    assert _started(tmp_path) == 1  # compiles *started* in the whole fleet
    sources = sorted(r["source"] for r in results)
    assert sources.count("compiled") == 1, sources
    assert set(sources) <= {"compiled", "remote", "local-after-wait"}, sources
    remote = _remote_store(shared_remote)
    assert remote.published(KEY) is not None  # promoted without a manual step
    assert [(v.key, v.ok) for v in verify_entries(remote)] == [(KEY, True)]
    stats = _node_stats(tmp_path, 4)
    assert sum(s.compiles for s in stats) == 1
    assert sum(s.promotions for s in stats) == 1
    assert sum(s.hits_by_tier.get("remote", 0) for s in stats) == 3  # one fetch per other node
    assert sum(s.misses for s in stats) == 1  # a fetch is a hit of the remote tier


@pytest.mark.timeout(2 * SAFETY)
def test_two_graphs_are_compiled_once_each_and_at_the_same_time(tmp_path, shared_remote):
    # A compile waits until the other key's compile is running too: if the two keys waited
    # on each other anywhere in the fleet, this would hang (and the safety limit trips).
    procs = []
    for key, half in ((KEY, "a"), (OTHER, "b")):
        procs += _spawn(tmp_path / half, shared_remote, nodes=4, ranks=1, key=key,
                        barrier_dir=str(tmp_path / "barrier"),
                        rendezvous_dir=str(tmp_path / "rendezvous"),
                        rendezvous=2)
    _go(tmp_path, procs)
    results = finish_workers(procs)

    assert all(r["ok"] and r["wrong"] is None for r in results), results
    assert _started(tmp_path / "a") == 1 and _started(tmp_path / "b") == 1
    remote = _remote_store(shared_remote)
    assert remote.published(KEY) is not None and remote.published(OTHER) is not None


@pytest.mark.timeout(2 * SAFETY)
def test_a_killed_holder_costs_one_lease_and_a_successor_finishes(tmp_path, shared_remote):
    hold = tmp_path / "hold"
    procs = _spawn(tmp_path, shared_remote, nodes=3, ranks=2, hold_dir=str(hold),
                   remote_lease_seconds=2)
    _go(tmp_path, procs)
    holder_pid = int(wait_for(lambda: (hold / HELD).exists() and (hold / HELD).read_text(),
                               "a compile to stop half-way", procs))
    # Every other node polls the remote for the held compile (its second rank queues on
    # the node's lock): the kill lands while the fleet waits on the holder's lease.
    wait_for(lambda: len(_fleet_waiters(tmp_path)) >= 2, "the other nodes to wait", procs)
    os.kill(holder_pid, signal.SIGKILL)

    survivors = [p for p in procs if p.pid != holder_pid]
    results = finish_workers(survivors)
    assert [p for p in procs if p.pid == holder_pid][0].wait() == -signal.SIGKILL

    assert all(r["ok"] and r["wrong"] is None for r in results), results
    assert _started(tmp_path) == 2  # the killed compile and one successor's
    stats = _node_stats(tmp_path, 3)
    assert sum(s.compiles for s in stats) == 1
    assert sum(s.lease_takeovers for s in stats) == 1
    remote = _remote_store(shared_remote)
    content = remote.published(KEY)
    assert content is not None and remote.read(f"{content}/{ENTRY_RECORD}") is not None
    assert [(v.key, v.ok) for v in verify_entries(remote)] == [(KEY, True)]


@pytest.mark.timeout(2 * SAFETY)
def test_a_late_holder_cannot_replace_what_its_successor_promoted(tmp_path):
    """Fencing: a holder frozen past its lease (SIGSTOP: a long GC pause, a stalled VM)
    comes back after a successor took the lease over and promoted; it keeps its own local
    entry but promotes nothing, and says why."""
    fleet = {"remote": str(tmp_path / "remote"), "remote_options": {"lock": "lease"}}
    hold = tmp_path / "hold"
    procs = _spawn(tmp_path, fleet, nodes=2, ranks=1, hold_dir=str(hold),
                   remote_lease_seconds=1)
    _go(tmp_path, procs)
    late_pid = int(wait_for(lambda: (hold / HELD).exists() and (hold / HELD).read_text(),
                             "a compile to stop half-way", procs))
    wait_for(lambda: _fleet_waiters(tmp_path), "the other node to wait", procs)
    os.kill(late_pid, signal.SIGSTOP)  # no more heartbeats: the lease runs out
    late = next(p for p in procs if p.pid == late_pid)
    successor = next(p for p in procs if p.pid != late_pid)
    (winner,) = finish_workers([successor])
    assert winner["ok"] and winner["source"] == "compiled" and winner["wrong"] is None
    os.kill(late_pid, signal.SIGCONT)
    (hold / RESUME).touch()
    (loser,) = finish_workers([late])

    assert loser["ok"] and loser["source"] == "compiled" and loser["wrong"] is None
    assert "taken over" in loser["stderr"], loser["stderr"]
    stats = {r["pid"]: read_stats(r["local_dir"]) for r in (winner, loser)}
    assert stats[winner["pid"]].lease_takeovers == 1
    assert stats[winner["pid"]].promotions == 1 and stats[loser["pid"]].promotions == 0
    remote = _remote_store(fleet)
    assert [(v.key, v.ok) for v in verify_entries(remote)] == [(KEY, True)]


@pytest.mark.timeout(2 * SAFETY)
def test_a_failed_compile_reaches_every_node_at_once_and_later_starts_during_cool_down(
    tmp_path, shared_remote
):
    hold = tmp_path / "hold"
    procs = _spawn(tmp_path, shared_remote, nodes=3, ranks=2, hold_dir=str(hold),
                   fail="the compiler crashed")
    _go(tmp_path, procs)
    wait_for(lambda: (hold / HELD).exists(), "a compile to stop half-way", procs)
    wait_for(lambda: len(_fleet_waiters(tmp_path)) >= 2, "the other nodes to wait", procs)
    (hold / RESUME).touch()
    results = finish_workers(procs)

    # Nobody waited for the timeout (SAFETY, far away) and nobody compiled again.
    assert not any(r["ok"] for r in results), results
    assert {r["error_type"] for r in results} <= {"ValueError", "CompileError",
                                                  "FleetCompileError"}, results
    assert all("the compiler crashed" in r["error"] for r in results), results
    assert sum(r["error_type"] == "FleetCompileError" for r in results) >= 2
    assert _started(tmp_path) == 1

    # A process that starts within the cool-down raises the recorded error, compiling
    # nothing; once the cool-down is over (here: a zero cool-down) it compiles again.
    later = _spawn(tmp_path / "later", shared_remote, nodes=1, ranks=1,
                   marker_dir=str(tmp_path / "markers"))
    _go(tmp_path / "later", later)
    (again,) = finish_workers(later)
    assert again["error_type"] == "FleetCompileError" and "the compiler crashed" in again["error"]
    assert _started(tmp_path) == 1
    retry = _spawn(tmp_path / "retry", shared_remote, nodes=1, ranks=1,
                   marker_dir=str(tmp_path / "markers"), compile_retry_after=1e-6)
    _go(tmp_path / "retry", retry)
    (retried,) = finish_workers(retry)
    assert retried["ok"] and retried["source"] == "compiled" and retried["wrong"] is None
    assert _started(tmp_path) == 2


@pytest.mark.timeout(2 * SAFETY)
def test_remote_write_off_is_the_node_alone_design(tmp_path, shared_remote):
    procs = _spawn(tmp_path, shared_remote, nodes=2, ranks=1, remote_write="off")
    _go(tmp_path, procs)
    results = finish_workers(procs)
    assert all(r["ok"] and r["source"] == "compiled" for r in results), results
    assert _started(tmp_path) == 2  # each node compiles: the remote is read-only
    assert _remote_store(shared_remote).published(KEY) is None


@pytest.mark.timeout(2 * SAFETY)
def test_an_s3_outage_mid_wait_sends_every_node_on_alone_with_one_warning(tmp_path, s3_server):
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    stopped = False
    hold = tmp_path / "hold"
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="outage")
        fleet = {"remote": "s3://outage/cache", "remote_options": {"endpoint_url": endpoint}}
        procs = _spawn(tmp_path, fleet, nodes=3, ranks=2, hold_dir=str(hold))
        _go(tmp_path, procs)
        wait_for(lambda: (hold / HELD).exists(), "a compile to stop half-way", procs)
        wait_for(lambda: len(_fleet_waiters(tmp_path)) >= 2, "the other nodes to wait", procs)
        server.stop()
        stopped = True
        (hold / RESUME).touch()
        results = finish_workers(procs)
    finally:
        if not stopped:
            server.stop()

    assert all(r["ok"] and r["wrong"] is None for r in results), results
    assert _started(tmp_path) == 3  # each node went on alone: one compile per node
    warned = [sum("s3://outage/cache" in line for line in r["stderr"].splitlines())
              for r in results]
    assert max(warned) == 1 and sum(warned) >= 3, [r["stderr"] for r in results]
    assert sum(s.remote_outages for s in _node_stats(tmp_path, 3)) >= 3


# ------------------------------------------------------------ real compiles (slow)


@pytest.mark.slow
@pytest.mark.timeout(3 * SAFETY)
def test_a_cold_fleet_compiles_a_real_inductor_graph_once(tmp_path, shared_remote):
    """4 nodes x 2 ranks, each rank a process running ``torch.compile(backend="vllm_neuron")``
    with its own Inductor cache (only our cache can save a compile): one compile in all."""
    remote = shared_remote["remote"]
    barrier = str(tmp_path / "barrier")
    procs = [
        subprocess.Popen(
            worker_command("torch", {"model": "mlp_a", "barrier_dir": barrier}),
            env=worker_env(VLLM_CACHE_ROOT=str(tmp_path / f"node{node}"),
                           NEURON_LIBTORCH_REMOTE_CACHE=remote, VLLM_NEURON_TOOLCHAIN="host"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in range(4)
        for rank in range(2)
    ]
    _go(tmp_path, procs)
    results = finish_workers(procs, timeout=2 * SAFETY)

    assert all(r["matches"] for r in results), results
    sources = sorted(s for r in results for s in r["sources"])
    assert sources.count("compiled") == 1, sources
    assert set(sources) <= {"compiled", "remote", "local-after-wait"}, sources
    (key,) = {k for r in results for k in r["keys"]}
    stats = [read_stats(str(tmp_path / f"node{n}" / "neuron" / "compile_cache"))
             for n in range(4)]
    assert sum(s.compiles for s in stats) == 1
    assert sum(s.hits_by_tier.get("remote", 0) for s in stats) == 3
    assert _remote_store(shared_remote).published(key) is not None


@pytest.mark.timeout(2 * SAFETY)
def test_a_builder_signs_and_serving_nodes_fetch_and_verify_without_leasing(
    tmp_path, shared_remote
):
    """One builder (the signing key) and serving nodes (trusted public keys only): the
    builder compiles once and promotes it signed; every serving node waits for it - never
    taking the lease - then fetches and verifies (docs/trust.md)."""
    private, public, key_id = generate_key_pair(str(tmp_path / "keys"), "builder")
    hold = tmp_path / "hold"
    args = {"key": KEY, "barrier_dir": None, "marker_dir": str(tmp_path / "markers"),
            "fleet_wait_dir": str(tmp_path / "fleet-waits"), "timeout": SAFETY, **shared_remote}

    def start(node: str, env: dict[str, str], **extra: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(
            worker_command("get", {**args, "cache_dir": str(tmp_path / node), **extra}),
            env=worker_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    builder = start("builder", {"VLLM_NEURON_CACHE_SIGNING_KEY": private,
                                "VLLM_NEURON_CACHE_TRUSTED_KEYS": public}, hold_dir=str(hold))
    wait_for(lambda: (hold / HELD).exists(), "the builder to hold the lease, mid-compile",
             [builder])
    serving = [start(f"node{n}", {"VLLM_NEURON_CACHE_TRUSTED_KEYS": public})
               for n in range(3) for _ in range(2)]
    # One rank per node polls the remote for the builder's entry (the other queues on
    # the node's lock); then the builder goes on.
    wait_for(lambda: len(_fleet_waiters(tmp_path)) >= 3, "the serving nodes to wait",
             [builder, *serving])
    (hold / RESUME).touch()
    results = finish_workers([builder, *serving])

    assert all(r["ok"] and r["wrong"] is None for r in results), results
    assert _started(tmp_path) == 1  # the builder's compile, and no other in the fleet
    assert results[0]["source"] == "compiled"
    assert {r["source"] for r in results[1:]} <= {"remote", "local", "local-after-wait"}
    remote = _remote_store(shared_remote)
    prefix = remote.published(KEY)
    assert prefix is not None
    assert decode_signature(remote.read(f"{prefix}/{SIGNATURE_FILE}")).key_id == key_id
    stats = _node_stats(tmp_path, 3)
    assert sum(s.fetches for s in stats) == 3 and sum(s.promotions for s in stats) == 0
    assert sum(s.compiles for s in stats) == 0 and sum(s.untrusted for s in stats) == 0
    # Only the builder ever held the key's lease: every lease record names its pid.
    owners = {LEASE_RECORDS.decode(remote.read(f".locks/{KEY}/{gen}") or b"").owner
              for gen in remote.list_dir(f".locks/{KEY}") if gen.isdigit()}
    assert owners and {o.split(":")[1] for o in owners} == {str(builder.pid)}, owners
    for n in range(3):  # each node's copy records the key that verified it
        local = open_store(str(tmp_path / f"node{n}"), create=False)
        record = json.loads(local.read(f"{local.published(KEY)}/{ENTRY_RECORD}") or b"{}")
        assert record["fetched"]["verified_by"] == key_id
