"""What a writer of the shared remote leaves at one key stays that key's (docs/trust.md, issue
39): a file where a key's lease folder should be, a lease renewed for ever by someone who
never publishes, one key's object refused - each makes that key compile here, never sets
the whole remote aside, never ends a wait in an error.

Nodes are real processes (cache_workers.run_get) on a folder remote (leases, as on NFS) and
on S3 (moto's server); the refused object is one key's read refused at the storage layer's
door of an in-process cache, as S3 refuses it (`StoreAccessDenied`), while the remote
answers its probe - or not.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from cache_workers import SAFETY, finish_workers, worker_command, worker_env

from vllm_neuron.backends import PublicationStuck, StoreAccessDenied, open_store
from vllm_neuron.backends.errors import ListingTooLarge
from vllm_neuron.backends.records import LeaseRecord, encode
from vllm_neuron.compile.entry.events import read_stats
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.trust.signing import generate_key_pair

KEY = "b057b057b057b057b057b057b057b0cc"
OTHER = "b057b057b057b057b057b057b057b0dd"
WAIT = 60.0  # NEURON_LIBTORCH_COMPILATION_TIMEOUT of the nodes: far past every bound here


def _start(tmp_path: Any, fleet: dict[str, Any], node: str, env: dict[str, str] | None = None,
           **args: Any) -> subprocess.Popen[str]:  # fmt: skip
    worker_args = {"key": KEY, "cache_dir": str(tmp_path / node),
                   "marker_dir": str(tmp_path / "markers"), "timeout": WAIT,
                   **fleet, **args}  # fmt: skip
    return subprocess.Popen(worker_command("get", worker_args), env=worker_env(**(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(2 * SAFETY)
def test_a_file_in_place_of_a_keys_lease_folder_costs_that_key_one_period(
    tmp_path, shared_remote
):
    """``.locks/<key>`` planted as a regular file: on a folder remote no lease record can
    be created under it (ENOTDIR). That key is busy for one lease period, then compiled
    alone; another key is leased, compiled and promoted; nothing is an outage."""
    remote = open_store(shared_remote["remote"])
    remote.write(f".locks/{KEY}", b"not a folder")
    procs = [_start(tmp_path, shared_remote, "node0", remote_lease_seconds=1),
             _start(tmp_path, shared_remote, "node1", key=OTHER, remote_lease_seconds=1)]
    results = finish_workers(procs)

    assert all(r["ok"] and r["source"] == "compiled" and r["wrong"] is None for r in results)
    stats = [read_stats(str(tmp_path / f"node{n}")) for n in range(2)]
    assert [s.remote_outages for s in stats] == [0, 0], results
    assert remote.published(OTHER) is not None
    assert not any("unavailable" in r["stderr"] or "failed:" in r["stderr"] for r in results)


@pytest.mark.timeout(2 * SAFETY)
@pytest.mark.parametrize("node", ["builder", "serving"])
def test_a_lease_renewed_for_ever_by_a_writer_who_never_publishes_delays_one_cool_down(
    tmp_path, shared_remote, node
):
    """The adversary rewrites a forged lease record (its renewal counter up) in a loop, so
    it never looks expired. A node that leases (no key) and one that cannot sign (a serving
    node) each compile the key themselves after one cool-down (2 s), long before their
    timeout (60 s), instead of raising `TimeoutError` then."""
    env: dict[str, str] = {}
    if node == "serving":
        _, public, _ = generate_key_pair(str(tmp_path / "keys"), "builder")
        env = {"VLLM_NEURON_CACHE_TRUSTED_KEYS": public}
    remote = open_store(shared_remote["remote"])
    stop = threading.Event()
    renewals = [0]

    def renew() -> None:
        while not stop.is_set():
            renewals[0] += 1
            remote.write(f".locks/{KEY}/000000000007", encode(LeaseRecord(
                owner="mallory:1:forged", generation=7, expires=time.time() + 1,
                renewal=renewals[0], duration=1.0)))

    renew_once = threading.Thread(target=renew, daemon=True)
    renew_once.start()
    try:
        proc = _start(tmp_path, shared_remote, node, env, remote_lease_seconds=1,
                      compile_retry_after=2)  # fmt: skip
        (result,) = finish_workers([proc])
    finally:
        stop.set()
        renew_once.join(timeout=SAFETY)

    assert result["ok"] and result["source"] == "compiled" and result["wrong"] is None, result
    assert result["finished"] - result["started"] < WAIT / 2, result
    assert "compiling it here, without the lease" in result["stderr"], result["stderr"]
    assert read_stats(str(tmp_path / node)).remote_outages == 0


# ------------------------------------------------------------------ one key's object refused


def _refusing(cache: TwoTierCache, key: str,
              error: Callable[[str, str], Exception] | None = None) -> None:  # fmt: skip
    """Make the cache's remote refuse every read of `key`'s objects, as S3 answers a
    per-object ``AccessDenied`` (the storage layer's `StoreAccessDenied`), or with
    `error(url, path)`."""
    remote = cache.remote
    assert remote is not None
    read, publication = remote.read, remote.publication

    def refuse(path: str) -> None:
        if path.startswith(key):
            if error is not None:
                raise error(remote.url, path)
            raise StoreAccessDenied(f"S3 store {remote.url} refused GetObject (AccessDenied: "
                                    f"{path})")  # fmt: skip

    def guarded_read(path: str, *args: Any, **kwargs: Any) -> Any:
        refuse(path)
        return read(path, *args, **kwargs)

    def guarded_publication(final: str) -> Any:
        refuse(final)
        return publication(final)

    remote.read = guarded_read  # type: ignore[method-assign]
    remote.publication = guarded_publication  # type: ignore[method-assign]


@pytest.mark.parametrize("probe", ["answers", "refused"])
def test_one_keys_refused_object_is_that_keys_defect_while_the_remote_answers(
    tmp_path, compile_fn, cache_warnings, monkeypatch, probe
):
    remote = str(tmp_path / "remote")
    options = {"lock": "lease"}
    builder = TwoTierCache(str(tmp_path / "a"), remote=remote, remote_options=options)
    for key in (KEY, OTHER):
        assert builder.get_or_compile(key, compile_fn(key)).source == "compiled"
    node = TwoTierCache(str(tmp_path / "b"), remote=remote, remote_options=options)
    _refusing(node, KEY)
    if probe == "refused":  # the whole remote refuses: an outage, as before
        def refused(store: Any) -> None:
            raise StoreAccessDenied(f"S3 store {store.url} refused ListObjectsV2")
        monkeypatch.setattr("vllm_neuron.compile.tiers.remote.probe_store", refused)

    assert node.get_or_compile(KEY, compile_fn(KEY)).source == "compiled"
    other = node.get_or_compile(OTHER, compile_fn(OTHER)).source
    outages = read_stats(str(tmp_path / "b")).remote_outages
    if probe == "answers":
        assert (other, outages) == ("remote", 0)
        assert [w for w in cache_warnings() if "refused" in w and KEY in w], cache_warnings()
    else:
        assert (other, outages) == ("compiled", 1)


THIRD = "b057b057b057b057b057b057b057b0ee"

KEY_DEFECTS: dict[str, Callable[[str, str], Exception]] = {
    # a folder remote's `<key>` made mode 000 by another user (EACCES)
    "refused": lambda url, path: PermissionError(13, "Permission denied", f"{url}/{path}"),
    # a broken commit record whose tombstone a writer keeps rewriting
    "stuck": lambda url, path: PublicationStuck(f"{url}/{path} has a broken commit record "
                                                "that cannot be replaced"),  # fmt: skip
    # a version folder stuffed with names
    "over-full": lambda url, path: ListingTooLarge(f"{url}/{path}", "holds more than the "
                                                   "1 names its reader lists"),  # fmt: skip
}


@pytest.mark.parametrize("defect", sorted(KEY_DEFECTS))
def test_one_keys_defect_met_by_its_promotion_leaves_the_remote_to_every_other_key(
    tmp_path, compile_fn, cache_warnings, defect
):
    """The node wins `KEY`'s lease, compiles it, and its promotion meets that key's defect
    (refused, stuck, over-full): one warning for that key; the remote is neither set aside
    nor taken for read-only, so the next key the node compiles is promoted for the fleet
    (issue 39: one key's defect is never the whole remote's)."""
    remote = str(tmp_path / "remote")
    node = TwoTierCache(str(tmp_path / "node"), remote=remote, remote_options={"lock": "lease"})
    _refusing(node, KEY, KEY_DEFECTS[defect])

    assert node.get_or_compile(KEY, compile_fn(KEY)).source == "compiled"
    assert node.get_or_compile(THIRD, compile_fn(THIRD)).source == "compiled"

    assert open_store(remote).published(THIRD) is not None
    assert read_stats(str(tmp_path / "node")).remote_outages == 0
    assert [w for w in cache_warnings() if KEY in w], cache_warnings()
    assert not [w for w in cache_warnings() if "VLLM_NEURON_REMOTE_WRITE=off" in w]
