"""A writer of the shared remote without a trusted key: its failure notes and leases can make
nodes compile, never stop, stall or crash them (docs/trust.md, issue 39).

Nodes are real processes (cache_workers.run_get), on a folder remote (leases, as on NFS)
and on S3 (moto's real HTTP API). The adversary is this test process writing the remote's
``.failures/`` and ``.locks/`` directly. Every "meanwhile" is a handshake on files; the
lease and cool-down periods are short (1-2 s) and the bounds asserted on are far from them.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
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
from vllm_neuron.backends.locks import LEASE_MAX_NAMES
from vllm_neuron.backends.records import LeaseRecord, encode
from vllm_neuron.compile.entry.events import read_stats
from vllm_neuron.compile.entry.failure_notes import FailureNote, note_payload
from vllm_neuron.compile.entry.notes import FAILURES, STOPPED, STOPPED_NOTES
from vllm_neuron.compile.trust.signing import generate_key_pair, load_signer, sign_note

KEY = "b057b057b057b057b057b057b057b0aa"
OTHER = "b057b057b057b057b057b057b057b0bb"
YEAR_2100 = 4102444800.0
WAIT = 60.0  # NEURON_LIBTORCH_COMPILATION_TIMEOUT of the nodes: far past every period here


def _remote(fleet: dict[str, Any]) -> Any:
    return open_store(fleet["remote"])  # S3: AWS_ENDPOINT_URL names moto's server


def _start(tmp_path: Any, fleet: dict[str, Any], node: str, env: dict[str, str] | None = None,
           **args: Any) -> subprocess.Popen[str]:  # fmt: skip
    worker_args = {"key": KEY, "cache_dir": str(tmp_path / node),
                   "marker_dir": str(tmp_path / "markers"),
                   "fleet_wait_dir": str(tmp_path / "fleet-waits"), "timeout": WAIT,
                   **fleet, **args}  # fmt: skip
    return subprocess.Popen(worker_command("get", worker_args), env=worker_env(**(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _started(tmp_path: Any) -> int:
    path = tmp_path / "markers"
    return len([n for n in os.listdir(path) if n.startswith("started-")]) if path.exists() else 0


def _note(at: float, error: str = "ValueError: the compiler crashed", **fields: Any) -> bytes:
    return encode(FailureNote(at=at, error=error, pid=4242, host="mallory", **fields))


def _signed_note(key_path: str, at: float) -> bytes:
    signer = load_signer(key_path)
    note = FailureNote(at=at, error="ValueError: the compiler crashed", pid=4242,
                       host="builder", signer=signer.key_id)  # fmt: skip
    signature = sign_note(signer, note_payload(KEY, note))
    return encode(FailureNote(**{**{f: getattr(note, f) for f in note.__struct_fields__},
                                 "signature": signature}))  # fmt: skip


@pytest.fixture
def keys(tmp_path: Any) -> dict[str, str]:
    """A builder's key pair; `builder` and `serving` are their nodes' environments."""
    private, public, _ = generate_key_pair(str(tmp_path / "keys"), "builder")
    stranger, _, _ = generate_key_pair(str(tmp_path / "stranger-keys"), "stranger")
    return {"private": private, "public": public, "stranger": stranger}


def _builder(keys: dict[str, str]) -> dict[str, str]:
    return {"VLLM_NEURON_CACHE_SIGNING_KEY": keys["private"],
            "VLLM_NEURON_CACHE_TRUSTED_KEYS": keys["public"]}


def _serving(keys: dict[str, str]) -> dict[str, str]:
    return {"VLLM_NEURON_CACHE_TRUSTED_KEYS": keys["public"]}


# ------------------------------------------------------------------------- failure notes


@pytest.mark.timeout(2 * SAFETY)
def test_a_note_from_the_year_2100_stops_no_node(tmp_path, shared_remote, keys):
    """On the remote and in each node's local tier: a builder and a serving node with no
    key both compile the graph and serve it (one warning each, naming the note)."""
    remote = _remote(shared_remote)
    remote.write(FAILURES.path(KEY), _note(YEAR_2100))
    for node in ("builder", "serving"):
        open_store(str(tmp_path / node)).write(FAILURES.path(KEY), _note(YEAR_2100))
    builder = _start(tmp_path, shared_remote, "builder", _builder(keys))
    (built,) = finish_workers([builder])
    serving = _start(tmp_path, shared_remote, "serving", _serving(keys), key=OTHER)
    open_store(str(tmp_path / "serving")).write(FAILURES.path(OTHER), _note(YEAR_2100))
    remote.write(FAILURES.path(OTHER), _note(YEAR_2100))
    (served,) = finish_workers([serving])

    assert built["ok"] and built["source"] == "compiled" and built["wrong"] is None, built
    assert served["ok"] and served["source"] == "compiled" and served["wrong"] is None, served
    assert "ahead of this node's clock" in built["stderr"], built["stderr"]
    assert remote.published(KEY) is not None  # the builder promoted it past the note


@pytest.mark.timeout(2 * SAFETY)
def test_a_note_rewritten_at_every_look_delays_a_node_one_retry_period_at_most(
    tmp_path, shared_remote
):
    """The adversary rewrites ``.failures/<key>.json`` (dated now) in a loop; a node asked
    for the graph again after each failure compiles it itself one cool-down (2 s) after
    the note first stopped it."""
    remote = _remote(shared_remote)
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            remote.write(FAILURES.path(KEY), _note(time.time()))

    remote.write(FAILURES.path(KEY), _note(time.time()))
    adversary = threading.Thread(target=rewrite, daemon=True)
    adversary.start()
    try:
        node = _start(tmp_path, shared_remote, "node", compile_retry_after=2, retry_for=WAIT)
        (result,) = finish_workers([node])
    finally:
        stop.set()
        adversary.join(timeout=SAFETY)

    assert result["ok"] and result["source"] == "compiled" and result["wrong"] is None, result
    assert result["refused"] >= 1  # the note did stop it ...
    assert result["refused_for"] < 2 + 20, result  # ... for about one cool-down, not for ever
    assert "compiling it here" in result["stderr"], result["stderr"]


@pytest.mark.timeout(2 * SAFETY)
def test_the_retry_bound_holds_across_restarts_of_a_crash_looping_node(tmp_path):
    """The adversary rewrites the note at every look; process 1 is stopped by it and exits
    (vLLM's warm-up failed); process 2 on the same node, started once the retry period has
    passed since the note first stopped the node (``.stopped/<key>.json`` in its local
    tier), compiles at once: the bound is the node's, not each process's."""
    fleet = {"remote": str(tmp_path / "remote"), "remote_options": {"lock": "lease"}}
    remote = _remote(fleet)
    retry = 2.0
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            remote.write(FAILURES.path(KEY), _note(time.time()))

    remote.write(FAILURES.path(KEY), _note(time.time()))
    adversary = threading.Thread(target=rewrite, daemon=True)
    adversary.start()
    try:
        (first,) = finish_workers([_start(tmp_path, fleet, "node", compile_retry_after=retry)])
        assert not first["ok"] and first["error_type"] == "FleetCompileError", first
        stopped = STOPPED_NOTES.read(open_store(str(tmp_path / "node")), STOPPED.path(KEY))
        assert stopped is not None and stopped.pid == first["pid"], stopped
        wait_for(lambda: time.time() > stopped.at + retry, "the retry period to pass")
        (second,) = finish_workers([_start(tmp_path, fleet, "node", compile_retry_after=retry)])
    finally:
        stop.set()
        adversary.join(timeout=SAFETY)
    assert second["ok"] and second["source"] == "compiled" and second["refused"] == 0, second
    assert second["wrong"] is None and "compiling it here" in second["stderr"], second


@pytest.mark.timeout(2 * SAFETY)
@pytest.mark.parametrize("signed_by", ["nobody", "stranger", "builder"])
def test_under_require_only_a_note_signed_by_a_trusted_key_stops_a_compile(
    tmp_path, shared_remote, keys, signed_by
):
    remote = _remote(shared_remote)
    if signed_by == "nobody":
        note = _note(time.time())
    else:
        note = _signed_note(keys["private" if signed_by == "builder" else "stranger"],
                            time.time())  # fmt: skip
    remote.write(FAILURES.path(KEY), note)
    procs = [_start(tmp_path, shared_remote, "builder", _builder(keys)),
             _start(tmp_path, shared_remote, "serving", _serving(keys))]
    results = finish_workers(procs)

    if signed_by == "builder":
        assert [r["error_type"] for r in results] == ["FleetCompileError"] * 2, results
        assert all("the compiler crashed" in r["error"] for r in results)
        assert _started(tmp_path) == 0
    else:
        assert all(r["ok"] and r["wrong"] is None for r in results), results
        assert "ignoring the failure note" in results[0]["stderr"], results[0]["stderr"]


@pytest.mark.timeout(2 * SAFETY)
def test_a_builders_failed_compile_is_signed_and_stops_the_serving_nodes_waiting(
    tmp_path, shared_remote, keys
):
    hold = tmp_path / "hold"
    builder = _start(tmp_path, shared_remote, "builder", _builder(keys), hold_dir=str(hold),
                     fail="the compiler crashed")  # fmt: skip
    wait_for(lambda: (hold / HELD).exists(), "the builder to hold the lease", [builder])
    serving = [_start(tmp_path, shared_remote, f"node{n}", _serving(keys)) for n in range(2)]
    waits = tmp_path / "fleet-waits"
    wait_for(lambda: waits.exists() and len([n for n in os.listdir(waits)
                                             if n.startswith(FLEET_WAITING)]) >= 2,
             "the serving nodes to wait", [builder, *serving])  # fmt: skip
    (hold / RESUME).touch()
    results = finish_workers([builder, *serving])

    assert results[0]["error_type"] in ("ValueError", "CompileError"), results[0]
    assert [r["error_type"] for r in results[1:]] == ["FleetCompileError"] * 2, results
    note = json.loads(_remote(shared_remote).read(FAILURES.path(KEY)))
    assert note["signer"] and note["signature"]
    assert _started(tmp_path) == 1


@pytest.mark.timeout(2 * SAFETY)
def test_a_secret_in_a_compile_error_never_reaches_the_shared_remote(tmp_path, shared_remote):
    secret = "hf_" + "S3cr3tT0k3nValue" * 2
    node = _start(tmp_path, shared_remote, "node", {"HF_TOKEN": secret},
                  fail=f"could not download the model with token {secret}")
    (result,) = finish_workers([node])
    assert not result["ok"]
    data = _remote(shared_remote).read(FAILURES.path(KEY))
    assert data is not None and b"could not download" in data
    assert secret.encode() not in data
    local = open_store(str(tmp_path / "node")).read(FAILURES.path(KEY))
    assert local is not None and secret.encode() not in local


# -------------------------------------------------------------------------------- leases


@pytest.mark.timeout(2 * SAFETY)
def test_a_forged_lease_claiming_a_billion_seconds_is_taken_over_after_the_waiters_period(
    tmp_path, shared_remote
):
    remote = _remote(shared_remote)
    remote.write(f".locks/{KEY}/000000000007", encode(LeaseRecord(
        owner="mallory:1:forged", generation=7, expires=YEAR_2100, renewal=1, duration=1e9)))
    procs = [_start(tmp_path, shared_remote, f"node{n}", remote_lease_seconds=1)
             for n in range(2)]
    results = finish_workers(procs)

    assert all(r["ok"] and r["wrong"] is None for r in results), results
    assert _started(tmp_path) == 1
    stats = [read_stats(str(tmp_path / f"node{n}")) for n in range(2)]
    assert sum(s.lease_takeovers for s in stats) == 1
    assert sum(s.remote_outages for s in stats) == 0


@pytest.mark.timeout(2 * SAFETY)
def test_junk_in_a_keys_lease_folder_makes_that_key_busy_one_period_and_no_other(
    tmp_path, shared_remote
):
    remote = _remote(shared_remote)
    for name in ("\u00b2", "\u0661\u0662", "1e9", "9" * 200, "notes.txt"):
        remote.write(f".locks/{KEY}/{name}", b"junk")
    remote.write(f".locks/{KEY}/000000000003", b"\xff\x00 not a record")
    procs = [_start(tmp_path, shared_remote, "node0", remote_lease_seconds=2),
             _start(tmp_path, shared_remote, "node1", key=OTHER, remote_lease_seconds=2)]
    results = finish_workers(procs)

    assert all(r["ok"] and r["source"] == "compiled" and r["wrong"] is None for r in results)
    assert remote.published(KEY) is not None and remote.published(OTHER) is not None
    stats = [read_stats(str(tmp_path / f"node{n}")) for n in range(2)]
    assert [s.remote_outages for s in stats] == [0, 0]  # never the whole remote set aside
    assert [s.lease_takeovers for s in stats] == [1, 0]  # KEY waited out one period
    assert not any("unavailable" in r["stderr"] for r in results), results


def _compiled_alone_and_no_other_key_touched(tmp_path: Any, fleet: dict[str, Any]) -> None:
    """What an unusable lease folder of KEY costs: node0 waits one period, then compiles
    KEY for itself (one warning, nothing published, the remote never set aside); node1's
    OTHER is leased and published as ever, and node0 then fetches OTHER from the remote."""
    remote = _remote(fleet)
    procs = [_start(tmp_path, fleet, "node0", remote_lease_seconds=1),
             _start(tmp_path, fleet, "node1", key=OTHER, remote_lease_seconds=1)]
    results = finish_workers(procs)

    assert all(r["ok"] and r["source"] == "compiled" and r["wrong"] is None for r in results)
    assert results[0]["stderr"].count("cannot be used") == 1, results[0]["stderr"]
    assert "cannot be used" not in results[1]["stderr"]
    assert remote.published(KEY) is None  # compiled for node0 only: no lease, no promotion
    assert remote.published(OTHER) is not None
    (again,) = finish_workers([_start(tmp_path, fleet, "node0", key=OTHER)])
    assert again["ok"] and again["source"] == "remote" and again["wrong"] is None, again
    stats = [read_stats(str(tmp_path / f"node{n}")) for n in range(2)]
    assert [s.remote_outages for s in stats] == [0, 0]  # never the whole remote set aside
    assert not any("unavailable" in r["stderr"] for r in [*results, again])


@pytest.mark.timeout(2 * SAFETY)
def test_an_over_full_lease_folder_makes_that_key_compile_alone_and_no_other(
    tmp_path, shared_remote
):
    """More than `LEASE_MAX_NAMES` names in ``.locks/<key>/`` (millions, for a hostile
    writer): never listed whole, the key is compiled on the node alone after one period."""
    remote = _remote(shared_remote)
    for i in range(LEASE_MAX_NAMES + 1):
        remote.write(f".locks/{KEY}/junk-{i}", b"junk")
    _compiled_alone_and_no_other_key_touched(tmp_path, shared_remote)


@pytest.mark.timeout(2 * SAFETY)
def test_a_lease_folder_linked_out_of_the_remote_makes_that_key_compile_alone(tmp_path):
    """``.locks/<key>`` a symbolic link to a folder outside a folder remote: no lease record
    is written or deleted there, the key is compiled on the node alone after one period."""
    fleet = {"remote": str(tmp_path / "remote"), "remote_options": {"lock": "lease"}}
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "000000000001").write_bytes(b"node-local, not a lease")
    os.makedirs(tmp_path / "remote" / ".locks")
    os.symlink(outside, tmp_path / "remote" / ".locks" / KEY)
    _compiled_alone_and_no_other_key_touched(tmp_path, fleet)
    assert sorted(os.listdir(outside)) == ["000000000001"]
    assert (outside / "000000000001").read_bytes() == b"node-local, not a lease"
