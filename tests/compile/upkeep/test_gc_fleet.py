"""`cache gc` is safe while other processes compile, promote and fetch: real processes.

Three "nodes" (tests/compile/helpers/gc_workers.py, each a process with a local tier of its own)
share a remote - a folder opened with the NFS profile (leases), and S3 on moto's server -
and compile, promote and fetch keys round after round. Before the work starts, a fourth
node's compile is SIGKILLed half-way (the ``hold_dir`` handshake), leaving its staging
and its remote lease behind, and the remote is seeded with debris built through the
store's own API. Meanwhile `vllm-neuron cache gc` runs again and again: on the remote in
a process of its own, with leases collected as soon as they are free (``--lease-grace
0s``), and on every node's local tier. Round ``r`` of each node starts only once gc pass
``r`` is done, so passes interleave with the work by handshake.

Then: every node got every key with the right bytes, every published entry verifies,
and a last gc with no age bound leaves nothing behind on any tier.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from cache_workers import (
    HELD,
    SAFETY,
    finish_workers,
    release_barrier,
    wait_for,
    worker_command,
    worker_env,
)

from vllm_neuron.backends import LeaseLock, join, open_store
from vllm_neuron.backends.records import encode
from vllm_neuron.backends.testing.handshakes import HANG, lease_record
from vllm_neuron.cli import main
from vllm_neuron.compile.entry.failure_notes import FailureNote
from vllm_neuron.compile.tiers.inventory import verify_entries

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")
ROUNDS = 4
NODES = 3


def key_for(i: int) -> str:
    return f"9cf1ee7{i:025x}"


VICTIM_KEY = key_for(99)
DEAD_LEASE_KEY = key_for(98)


@pytest.fixture(params=["nfs-folder", "s3"])
def shared(request: pytest.FixtureRequest, tmp_path: Any) -> dict[str, Any]:
    if request.param == "nfs-folder":
        return {"remote": str(tmp_path / "remote"), "remote_options": {"profile": "nfs"}}
    request.getfixturevalue("s3_env")  # AWS_ENDPOINT_URL for the workers and gc
    return {"remote": request.getfixturevalue("s3_store_url"), "remote_options": {}}


def rounds_for(node: int) -> list[list[str]]:
    """Round r names keys r and r+1 (each key twice: compiled or fetched, then fetched
    again), the victim's key in round 0, in an order that differs per node."""
    out = []
    for r in range(ROUNDS):
        keys = [key_for(r), key_for(r + 1)] + ([VICTIM_KEY] if r == 0 else [])
        shift = node % len(keys)
        out.append(keys[shift:] + keys[:shift])
    return out


def seed_debris(remote: Any) -> None:
    """Debris that gc must remove while the fleet works: a lease whose holder stopped
    beating, a failure note past the cool-down, and (on a folder, where a test can set a
    file's time back) a staging area seven hours old; on S3 a version never committed,
    removed by the last pass."""
    lease = LeaseLock(remote, join(".locks", DEAD_LEASE_KEY), lease_duration=0.3)
    lease.acquire()
    lease._stop.set()
    assert lease._heartbeat is not None
    lease._heartbeat.join()
    deadline = time.monotonic() + HANG
    while lease_record(lease)["expires"] >= time.time():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    note = FailureNote(at=time.time() - 3600, error="ValueError: old", pid=1, host="h")
    remote.write(join(".failures", f"{DEAD_LEASE_KEY}.json"), encode(note))
    staging = remote.stage(key_for(97))
    staging.write("graph.bin", b"a promoter that died")
    if remote.capabilities.local_paths:
        past = time.time() - 7 * 3600
        top = remote.local_path(staging.prefix)
        for dirpath, _dirs, files in os.walk(top):
            for path in [dirpath] + [os.path.join(dirpath, n) for n in files]:
                os.utime(path, (past, past))


def gc_remote(url: str, *extra: str) -> dict[str, Any]:
    """`vllm-neuron cache gc URL --json` in a process of its own."""
    done = subprocess.run(
        [sys.executable, "-m", "vllm_neuron.cli", "cache", "gc", url, "--json", *extra],
        env=worker_env(), capture_output=True, text=True, timeout=SAFETY)
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(json.loads(done.stdout))


def gc_local(cache_dir: str, *extra: str) -> dict[str, Any]:
    """`vllm-neuron cache --cache-dir DIR gc --json` in this process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["cache", "--cache-dir", cache_dir, "gc", "--json", *extra])
    assert code == 0, out.getvalue()
    return dict(json.loads(out.getvalue()))


def kill_a_compile_half_way(tmp_path: Any, fleet: dict[str, Any]) -> str:
    """A fourth node starts compiling the victim's key, stops half-way (holding its node's
    lock and the key's remote lease) and is SIGKILLed there. Its node directory."""
    hold = tmp_path / "hold"
    node = str(tmp_path / "victim-node")
    args = {"key": VICTIM_KEY, "cache_dir": node, "hold_dir": str(hold), "timeout": SAFETY,
            "remote_lease_seconds": 2, **fleet}
    victim = subprocess.Popen(worker_command("get", args), env=worker_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = int(wait_for(lambda: (hold / HELD).exists() and (hold / HELD).read_text(),
                       "the victim's compile to stop half-way", [victim]))
    assert pid == victim.pid
    os.kill(pid, signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    victim.communicate()
    return node


@pytest.mark.timeout(3 * SAFETY)
def test_gc_while_the_fleet_compiles_promotes_and_fetches(tmp_path, shared):
    remote = open_store(shared["remote"], **shared["remote_options"])
    seed_debris(remote)
    victim_node = kill_a_compile_half_way(tmp_path, shared)
    gc_dir = tmp_path / "gc"
    gc_dir.mkdir()
    nodes = [str(tmp_path / f"node{n}") for n in range(NODES)]
    procs = []
    for n, node in enumerate(nodes):
        args = {"cache_dir": node, "rounds": rounds_for(n), "gc_dir": str(gc_dir),
                "barrier_dir": str(tmp_path / "barrier"), "remote_lease_seconds": 2, **shared}
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "gc_workers.py"), json.dumps(args)],
            env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    release_barrier(str(tmp_path / "barrier"), NODES, procs)

    passes: list[dict[str, Any]] = []
    removed_locally: list[dict[str, Any]] = []
    while len(passes) < ROUNDS or any(p.poll() is None for p in procs):
        passes.append(gc_remote(shared["remote"], "--older-than", "30s", "--lease-grace", "0s"))
        for node in [*nodes, victim_node]:
            if os.path.isdir(node):
                removed_locally += gc_local(node, "--older-than", "30s")["removed"]
        (gc_dir / f"pass-{len(passes) - 1}").touch()
        dead = [p for p in procs if p.poll() not in (None, 0)]
        if dead:
            out, err = dead[0].communicate()
            raise AssertionError(f"a node exited {dead[0].returncode}:\n{out}\n{err}")

    results = finish_workers(procs)
    for result in results:
        assert result["ok"], result
        assert all(g["wrong"] is None for g in result["got"]), result["got"]
        assert len(result["got"]) == 2 * ROUNDS + 1
    sources = [g["source"] for r in results for g in r["got"]]
    assert "compiled" in sources and "remote" in sources, sources

    removed = [(i["kind"], i["where"]) for p in passes for i in p["removed"]]
    first = [(i["kind"], i["where"]) for i in passes[0]["removed"]]
    assert ("lease", f".locks/{DEAD_LEASE_KEY}") in first
    assert ("failure-note", f".failures/{DEAD_LEASE_KEY}.json") in first
    if remote.capabilities.local_paths:  # the seeded staging area, seven hours old
        assert [k for k, _ in first].count("staging") == 1
    assert not [i for p in passes for i in p["failed"]]
    fleet_leases = [w for k, w in removed if k == "lease" and w != f".locks/{DEAD_LEASE_KEY}"]
    print(f"{len(passes)} gc passes while the fleet ran; removed {removed}; "
          f"{len(fleet_leases)} of the fleet's leases; locally {removed_locally}")

    # The last pass, with no age bound: nothing is left behind anywhere.
    last = gc_remote(shared["remote"], "--older-than", "0s", "--lease-grace", "0s")
    assert not last["failed"]
    after = remote.survey(older_than=0.0, lease_grace=0.0)
    assert after.debris == [] and after.kept == [], (after.debris, after.kept)
    keys = sorted({key_for(i) for i in range(ROUNDS + 1)} | {VICTIM_KEY})
    assert sorted(after.published) == keys
    assert sorted((v.key, v.ok) for v in verify_entries(remote)) == [(k, True) for k in keys]
    for node in [*nodes, victim_node]:
        done = gc_local(node, "--older-than", "0s")
        assert not done["failed"]
        if node == victim_node:  # the killed compile's half-written staging area, and the
            # note of the promotion it owed, for an entry it never published
            assert sorted(i["kind"] for i in done["removed"]) == ["owed-note", "staging"], done
        store = open_store(node)
        assert store.survey(older_than=0.0, lease_grace=0.0).debris == []
        assert all(v.ok for v in verify_entries(store))
