"""A stateful model of the two-tier cache: several nodes, one shared remote.

Hypothesis interleaves lookups, compiles, promotions, corruptions, crashes and restarts
across nodes (each node: its own local tier and its own `TwoTierCache`; all nodes share
one remote). The model predicts where each artifact comes from, and checks after every
step:

* never a partial entry: what a store publishes is exactly what the model says (a
  complete, record-matching entry, or a corruption the model itself injected);
* never a wrong artifact: every artifact handed out has the key's own bytes;
* at most one compile per key per node, plus one per corruption that could force a
  recompile on that node;
* with VLLM_NEURON_REMOTE_WRITE=auto (compiles promote, coordinated by remote leases), at
  most one compile per key in the whole fleet, plus one per corruption; a crash leaves an
  expired remote lease behind, which the next compile of the key takes over;
* a local tier that fills up or turns read-only while a compile writes into it never fails
  the get: the graph compiles again in the process's scratch area and is adopted into the
  tier when it has room (a tier on disk), else served from scratch and not cached (a tier
  without local paths), one more compile on that node and in the fleet.

It runs on three pairs of tiers, with examples under the ``ci`` profile
(tests/hypothesis_profiles.py) in proportion to what an example costs:

* memory local tiers, a memory remote (S3's semantics: commit records, no rename): 400,
  and 200 more with a read-only remote (VLLM_NEURON_REMOTE_WRITE=off);
* local-disk local tiers (the production fast path of `lookup_local`: an entry is the
  directory ``<root>/<key>``, published by rename), a memory remote: 300;
* local-disk local tiers and a remote on S3 (moto's S3 HTTP API on loopback): 25, of up
  to 20 steps (the others: 30).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from hypothesis_profiles import examples  # tests/hypothesis_profiles.py
from tier_model import FILES, KEYS, Tiers, expected  # tests/compile/helpers/

from vllm_neuron.backends import Store, join, open_store
from vllm_neuron.compile.entry.record import ENTRY_RECORD, decode_record
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.promote import promote_entry

NODES = 3
ABSENT, GOOD, CORRUPT = "absent", "good", "corrupt"


class TwoTierModel(RuleBasedStateMachine):
    def __init__(self, tiers: Tiers | None = None, remote_write: str = "auto") -> None:
        super().__init__()
        self.tiers = tiers or Tiers()
        self.remote_write = remote_write
        self.remote_url = self.tiers.remote_url
        self.remote = open_store(self.remote_url)
        self.locals: list[Store] = [self.tiers.local(n) for n in range(NODES)]
        self.caches = [self._boot(n) for n in range(NODES)]
        # The model.
        self.local_state = {(n, k): ABSENT for n in range(NODES) for k in KEYS}
        self.remote_state = dict.fromkeys(KEYS, ABSENT)
        self.loaded: list[set[str]] = [set() for _ in range(NODES)]
        self.compiles = {(n, k): 0 for n in range(NODES) for k in KEYS}
        self.budget = {(n, k): 1 for n in range(NODES) for k in KEYS}
        # Fleet-wide: one compile per key, plus one per event that can force another (a
        # corruption, a holder that died); only when compiles promote (remote_write=auto).
        self.fleet_budget = dict.fromkeys(KEYS, 1)
        # A node whose next compile into its tier meets a full or read-only disk.
        self.disk_fault: dict[int, int] = {}

    def teardown(self) -> None:
        self.tiers.close()

    def _boot(self, node: int) -> TwoTierCache:
        cache = TwoTierCache(self.locals[node], remote=self.remote_url, lease_duration=5.0,
                             remote_write=self.remote_write, remote_lease_seconds=5.0)
        # Each variant really runs on its backends.
        if self.tiers.disk_dir is not None:
            # lookup_local's fast path: entries are directories under this root.
            root = os.path.join(self.tiers.disk_dir, f"node-{node}")
            assert cache.local.local_dir_of(KEYS[0]) == os.path.join(root, KEYS[0])
            assert cache.local.capabilities.local_paths
        else:
            assert cache.local.url.startswith("memory://")
            assert cache.local.local_dir_of(KEYS[0]) is None
        remote = cache.remote
        assert remote is not None and remote.url == self.remote.url
        scheme = self.remote_url.split("://")[0]
        assert remote.url.startswith(f"{scheme}://") and scheme in ("memory", "s3")
        if scheme == "s3":
            assert remote.capabilities.profile == "s3"
        return cache

    def _compile_fn(self, node: int, key: str):  # noqa: ANN202 - a CompileFn
        def compile_into(out_dir: str) -> dict[str, str]:
            fault = self.disk_fault.pop(node, None)
            if fault is not None and "vllm_neuron_uncached_" not in out_dir:
                # The tier's disk (not the scratch area) is full or read-only right now.
                raise OSError(fault, os.strerror(fault), os.path.join(out_dir, FILES[0]))
            self.compiles[(node, key)] += 1
            for name in FILES:
                path = os.path.join(out_dir, name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(expected(key, name))
            return {"key": key}

        return compile_into

    # ------------------------------------------------------------------- rules
    @rule(node=st.integers(0, NODES - 1), key=st.sampled_from(KEYS))
    def get(self, node: int, key: str) -> None:
        state, remote = self.local_state[(node, key)], self.remote_state[key]
        if key in self.loaded[node]:
            want = "memory"
        elif state == GOOD:
            want = "local"
        elif remote == GOOD:
            want = "remote"
        else:
            want = "compiled"
        faulted = want == "compiled" and node in self.disk_fault
        served_from_scratch = faulted and self.tiers.disk_dir is None  # nowhere to adopt it
        if served_from_scratch:
            want = "uncached"
        result = self.caches[node].get_or_compile(key, self._compile_fn(node, key))
        self.disk_fault.pop(node, None)  # the fault was for this get only
        assert result.source == want, (result.source, want, state, remote)
        if served_from_scratch:  # not cached: later starts, and other nodes, compile again
            if remote == CORRUPT:
                self.remote_state[key] = ABSENT  # quarantined by the failed fetch
            self.local_state[(node, key)] = ABSENT  # a corrupt one was quarantined
            self.loaded[node].add(key)
            self.budget[(node, key)] += 1
            self.fleet_budget[key] += 1
            for name in FILES:
                assert Path(result.path or "", name).read_bytes() == expected(key, name)
            return
        if self.tiers.disk_dir is not None:  # the entry's own directory on local disk
            assert result.path == os.path.join(self.tiers.disk_dir, f"node-{node}", key)
        if want != "memory":
            local = self.locals[node]
            for name in FILES:
                assert local.read(join(result.prefix, name)) == expected(key, name)
                if result.path is not None:
                    assert Path(result.path, name).read_bytes() == expected(key, name)
            self.local_state[(node, key)] = GOOD
            if want == "compiled" and remote == CORRUPT:
                self.remote_state[key] = ABSENT  # quarantined by the failed fetch
            if want == "compiled" and self.remote_write == "auto":
                self.remote_state[key] = GOOD  # promoted by the compiling node
        self.loaded[node].add(key)

    @rule(node=st.integers(0, NODES - 1), key=st.sampled_from(KEYS))
    def promote(self, node: int, key: str) -> None:
        state = self.local_state[(node, key)]
        if state != GOOD:
            with pytest.raises(RuntimeError):
                promote_entry(self.locals[node], self.remote, key)
            return
        published = promote_entry(self.locals[node], self.remote, key)
        assert published == (self.remote_state[key] == ABSENT)
        if published:
            self.remote_state[key] = GOOD

    @precondition(lambda self: any(s != ABSENT for s in self.local_state.values()))
    @rule(data=st.data())
    def corrupt_local(self, data: st.DataObject) -> None:
        """Overwrite a file of a local entry with wrong bytes of another length."""
        node, key = data.draw(st.sampled_from(
            sorted(nk for nk, s in self.local_state.items() if s != ABSENT)))
        name = data.draw(st.sampled_from(FILES))
        junk = data.draw(st.binary(min_size=0, max_size=64))
        prefix = self.locals[node].published(key)
        assert prefix is not None
        good = expected(key, name)
        if len(junk) == len(good):
            junk += b"!"
        self.locals[node].write(join(prefix, name), junk)
        self.local_state[(node, key)] = CORRUPT
        self.budget[(node, key)] += 1
        self.fleet_budget[key] += 1

    @precondition(lambda self: any(s != ABSENT for s in self.local_state.values()))
    @rule(data=st.data())
    def bitrot_then_verify(self, data: st.DataObject) -> None:
        """Same-size damage passes the hit's size check; a verification finds it."""
        node, key = data.draw(st.sampled_from(
            sorted(nk for nk, s in self.local_state.items() if s != ABSENT)))
        name = data.draw(st.sampled_from(FILES))
        local = self.locals[node]
        prefix = local.published(key)
        assert prefix is not None
        data_now = local.read(join(prefix, name)) or b""
        flipped = bytes([data_now[0] ^ 0x01]) + data_now[1:] if data_now else b"x"
        local.write(join(prefix, name), flipped)
        problem = self.caches[node].local_tier.verify(key)
        assert problem is not None and key in problem
        assert local.published(key) is None
        self.local_state[(node, key)] = ABSENT
        self.loaded[node].discard(key)
        self.budget[(node, key)] += 1
        self.fleet_budget[key] += 1

    @precondition(lambda self: any(s != ABSENT for s in self.remote_state.values()))
    @rule(data=st.data())
    def corrupt_remote(self, data: st.DataObject) -> None:
        """Overwrite a file of a remote entry with any wrong bytes (same size allowed)."""
        key = data.draw(st.sampled_from(
            sorted(k for k, s in self.remote_state.items() if s != ABSENT)))
        name = data.draw(st.sampled_from(FILES))
        good = expected(key, name)
        junk = data.draw(st.one_of(
            st.binary(min_size=len(good), max_size=len(good)), st.binary(max_size=64)))
        if junk == good:
            junk = bytes([good[0] ^ 0xFF]) + good[1:]
        prefix = self.remote.published(key)
        assert prefix is not None
        self.remote.write(join(prefix, name), junk)
        self.remote_state[key] = CORRUPT
        for n in range(NODES):
            self.budget[(n, key)] += 1
        self.fleet_budget[key] += 1

    @rule(node=st.integers(0, NODES - 1), key=st.sampled_from(KEYS),
          where=st.sampled_from(["local", "remote"]))
    def crash(self, node: int, key: str, where: str) -> None:
        """A process died mid-compile (or mid-promotion): half a staging, an expired lease."""
        store = self.locals[node] if where == "local" else self.remote
        staging = store.stage(key)
        staging.write(FILES[0], expected(key, FILES[0])[:7])  # never committed
        # A dead holder's kernel lock is gone with it; an expired lease stays behind (on
        # the remote: the key's fleet lease, which the next compile of the key takes over).
        if not store.capabilities.kernel_locks:
            locks = join(".locks", key)
            gens = [int(g) for g in store.list_dir(locks) if g.isdigit()]
            gen = max(gens, default=0) + 1
            # A waiter watches a lease for one period (the holder's `duration`) from its
            # first look, whatever `expires` says: this dead holder's period is short, so
            # a step that meets its lease waits a moment, not the cache's 5 s lease.
            record = {"owner": "dead-host:1:0", "generation": gen,
                      "expires": time.time() - 1, "released": False, "duration": 0.01}
            assert store.create(join(locks, f"{gen:012d}"), json.dumps(record).encode())

    @rule(node=st.integers(0, NODES - 1), data=st.data())
    def disk_fails(self, node: int, data: st.DataObject) -> None:
        """The node's local disk fills up (or turns read-only, or refuses this user) under
        its next compile. A refused permission is the tier's only for a path in the tier,
        so only a tier on disk has that fault (elsewhere it is the compile's own failure)."""
        faults = [errno.ENOSPC, errno.EROFS]
        if self.tiers.disk_dir is not None:
            faults.append(errno.EACCES)
        self.disk_fault[node] = data.draw(st.sampled_from(faults))

    @rule(node=st.integers(0, NODES - 1))
    def restart(self, node: int) -> None:
        self.caches[node] = self._boot(node)
        self.loaded[node] = set()

    @rule(node=st.integers(0, NODES - 1))
    def verify_all(self, node: int) -> None:
        cache = self.caches[node]
        for key in KEYS:
            state = self.local_state[(node, key)]
            if state == ABSENT:
                continue
            problem = cache.local_tier.verify(key)
            assert (problem is not None) == (state == CORRUPT), problem
            if state == CORRUPT:
                self.local_state[(node, key)] = ABSENT
                self.loaded[node].discard(key)

    # -------------------------------------------------------------- invariants
    def _check_store(self, store: Store, states: dict[str, str]) -> None:
        for key in KEYS:
            prefix = store.published(key)
            assert (prefix is None) == (states[key] == ABSENT), (store, key, states[key])
            if prefix is None:
                continue
            record = decode_record(store.read(join(prefix, ENTRY_RECORD)) or b"")
            assert record.key == key
            assert sorted(record.files) == sorted(FILES)
            if states[key] == GOOD:
                for name, digest in record.files.items():
                    data = store.read(join(prefix, name))
                    assert data == expected(key, name)  # never a wrong artifact
                    assert len(data) == digest.size
                    assert hashlib.sha256(data).hexdigest() == digest.sha256

    @invariant()
    def stores_publish_exactly_what_the_model_says(self) -> None:
        for n in range(NODES):
            self._check_store(self.locals[n], {k: self.local_state[(n, k)] for k in KEYS})
        self._check_store(self.remote, self.remote_state)

    @invariant()
    def at_most_one_compile_per_key_per_node(self) -> None:
        for nk, count in self.compiles.items():
            assert count <= self.budget[nk], (nk, count, self.budget[nk])

    @invariant()
    def at_most_one_compile_per_key_in_the_fleet(self) -> None:
        if self.remote_write != "auto":
            return  # each node compiles on its own: the per-node budget is the bound
        for key in KEYS:
            count = sum(self.compiles[(n, key)] for n in range(NODES))
            assert count <= self.fleet_budget[key], (key, count, self.fleet_budget[key])


def _run(tiers: Callable[[], Tiers], examples_in_ci: int, steps: int = 30,
         remote_write: str = "auto") -> None:
    run_state_machine_as_test(
        lambda: TwoTierModel(tiers(), remote_write),
        settings=settings(
            max_examples=examples(ci=examples_in_ci),
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_two_tier_model_in_memory() -> None:
    _run(Tiers, 400)


def test_two_tier_model_in_memory_with_a_read_only_remote() -> None:
    """VLLM_NEURON_REMOTE_WRITE=off: only explicit promotions fill the remote."""
    _run(Tiers, 200, remote_write="off")


def test_two_tier_model_on_local_disk(tmp_path: Path) -> None:
    _run(lambda: Tiers(disk_root=str(tmp_path)), 300)


def test_two_tier_model_on_local_disk_with_an_s3_remote(
    tmp_path: Path, s3_env: str, s3_store_url: str
) -> None:
    _run(lambda: Tiers(disk_root=str(tmp_path), remote_root=s3_store_url), 25, steps=20)
