"""The two-tier cache with trust as a dimension: a stateful model (hypothesis) of one builder
and two serving nodes under ``VLLM_NEURON_CACHE_TRUST=require`` (docs/trust.md).

Node 0 holds the signing key; nodes 1 and 2 hold only the public key. Rules forge a remote
entry (a file replaced and every digest recomputed, the signature kept), strip its
signature, rotate the key (the builder signs with a new one; every node trusts only the
new one, so everything the old key signed is revoked), and have the builder promote again
what its tier holds (`cache promote`: its own compiles are signed with the current key and
replace a revoked or forged remote entry; what it fetched under a revoked key is never
re-signed). The model says where each get is served from; the invariants say that no node's
tier ever holds a forged artifact, that only the builder ever changes the remote, and what
the remote's signature verifies against.

Two rules force the paths a reviewer's mutations need reached: `rotation_then_fetch` (a
serving node's fetched entry, then a rotation, then a get: its copy and the remote's, both
signed by the revoked key, are refused) and `resign_then_repromote` (the builder re-signs an
entry it fetched after its remote signature was stripped, and a second promotion finds it).
Coverage shows in hypothesis' statistics (``pytest --hypothesis-show-statistics``) as
`event` lines. The examples are derandomized (a fixed seed): CI runs the same ones, and the
test asserts that each of `REQUIRED` was reached in them, so a broken revocation (policy.py's
key-id check of a fetched entry, or signing.py trusting an unknown key) fails every run.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from hypothesis_profiles import CI, current_profile, examples  # tests/hypothesis_profiles.py
from tier_model import FILES, KEYS, Tiers, expected  # tests/compile/helpers/

from vllm_neuron.backends import join, open_store
from vllm_neuron.backends.digests import digest_bytes
from vllm_neuron.backends.records import encode
from vllm_neuron.compile.entry.record import ENTRY_RECORD, decode_record
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.promote import CannotSign, promote_entry
from vllm_neuron.compile.trust.policy import TrustPolicy, load_trust_policy
from vllm_neuron.compile.trust.signing import SIGNATURE_FILE, generate_key_pair, load_public_keys
from vllm_neuron.envs import load_trust_settings

REACHED: Counter[str] = Counter()
"""How often each `event` was reached, over all examples of a run: the test asserts that the
transitions it exists for were reached at all."""

FETCH_AFTER_ROTATION = "fetched an entry signed after a key rotation"
REVOKED_RECOMPILED = "a get of an entry fetched under a key revoked since"
REMOTE_REVOKED = "a get refused a remote entry signed by a key revoked since"
REPLACED = "re-promotion replaced a revoked, forged or absent remote entry"
RESIGNED = "the builder re-signed an entry it fetched, replacing an unsigned remote one"
REPROMOTED = "an entry re-promoted after a re-sign: the remote already held it"
RESIGN_REFUSED = "re-signing an entry fetched under a revoked key refused"
REQUIRED = (FETCH_AFTER_ROTATION, REVOKED_RECOMPILED, REMOTE_REVOKED, REPLACED, RESIGNED,
            REPROMOTED, RESIGN_REFUSED)
"""What the model exists for: each is reached in its fixed examples under the ci profile (the
test asserts it), so a mutation of the check it exercises fails every run, not some."""


def _reached(what: str) -> None:
    event(what)
    REACHED[what] += 1


NODES = 3
BUILDER = 0
ABSENT, OWN, FORGED = "absent", "own", "forged"
KEY_GENERATIONS = 4  # rotations an example can make


@pytest.fixture(scope="module")
def key_pairs() -> Iterator[list[tuple[str, str, str]]]:
    with tempfile.TemporaryDirectory(prefix="vllm-neuron-trust-keys-") as directory:
        yield [generate_key_pair(directory, f"gen{g}") for g in range(KEY_GENERATIONS)]


class TrustModel(RuleBasedStateMachine):
    pairs: list[tuple[str, str, str]] = []

    def __init__(self) -> None:
        super().__init__()
        self.tiers = Tiers()
        self.remote_url = self.tiers.remote_url
        self.remote = open_store(self.remote_url)
        self.locals = [self.tiers.local(n) for n in range(NODES)]
        self.gen = 0
        self.caches = [self._boot(n) for n in range(NODES)]
        # The model: OWN (compiled there), ("fetched", gen) or ABSENT per node and key; the
        # remote: ("good", gen signed), FORGED, or ABSENT.
        self.local: dict[tuple[int, str], Any] = {(n, k): ABSENT for n in range(NODES)
                                                  for k in KEYS}
        self.remote_state: dict[str, Any] = dict.fromkeys(KEYS, ABSENT)
        self.loaded: list[set[str]] = [set() for _ in range(NODES)]

    def teardown(self) -> None:
        self.tiers.close()

    def _policy(self, node: int) -> TrustPolicy:
        private, public, _ = self.pairs[self.gen]
        env = {"VLLM_NEURON_CACHE_TRUSTED_KEYS": public}
        if node == BUILDER:
            env["VLLM_NEURON_CACHE_SIGNING_KEY"] = private
        return load_trust_policy(load_trust_settings(env))

    def _boot(self, node: int) -> TwoTierCache:
        return TwoTierCache(self.locals[node], remote=self.remote_url, lease_duration=5.0,
                            remote_lease_seconds=5.0, trust=self._policy(node))  # fmt: skip

    def _compile_fn(self, key: str):  # noqa: ANN202 - a CompileFn
        def compile_into(out_dir: str) -> dict[str, str]:

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
        here, there = self.local[(node, key)], self.remote_state[key]
        trusted_here = here == OWN or here == ("fetched", self.gen)
        if key in self.loaded[node]:
            want = "memory"
        elif trusted_here:
            want = "local"
        elif there == ("good", self.gen):
            want = "remote"
        else:
            want = "compiled"
        result = self.caches[node].get_or_compile(key, self._compile_fn(key))
        assert result.source == want, (node, key, result.source, want, here, there, self.gen)
        _reached(f"get served from {want}")
        if want == "remote" and self.gen > 0:
            _reached(FETCH_AFTER_ROTATION)
        if isinstance(here, tuple) and here[1] < self.gen and want != "memory":
            _reached(REVOKED_RECOMPILED)  # compiled, or fetched as the current key signed it
        if isinstance(there, tuple) and there[1] < self.gen and want == "compiled":
            _reached(REMOTE_REVOKED)
        if want == "remote":
            self.local[(node, key)] = ("fetched", self.gen)
        elif want == "compiled":
            self.local[(node, key)] = OWN
            if node == BUILDER:  # promoted, signed, replacing an untrusted remote entry
                self.remote_state[key] = ("good", self.gen)
        self.loaded[node].add(key)

    @precondition(lambda self: any(isinstance(s, tuple) for s in self.remote_state.values()))
    @rule(data=st.data(), strip=st.booleans())
    def forge_remote(self, data: st.DataObject, strip: bool) -> None:
        """A writer without the key replaces a file and recomputes every digest (or just
        removes the signature)."""
        key = data.draw(st.sampled_from(sorted(
            k for k, s in self.remote_state.items() if isinstance(s, tuple))))
        self._forge(key, data, strip)

    def _forge(self, key: str, data: st.DataObject | None, strip: bool) -> None:
        prefix = self.remote.published(key)
        assert prefix is not None
        if strip or data is None:
            self.remote.delete(join(prefix, SIGNATURE_FILE))
        else:
            name = data.draw(st.sampled_from(FILES))
            evil = b"stranger's code " + data.draw(st.binary(max_size=32))
            self.remote.write(join(prefix, name), evil)
            record = decode_record(self.remote.read(join(prefix, ENTRY_RECORD)) or b"")
            forged = msgspec.structs.replace(
                record, files={**record.files, name: digest_bytes(evil)})
            self.remote.write(join(prefix, ENTRY_RECORD), encode(forged))
        self.remote_state[key] = FORGED

    @precondition(lambda self: self.gen + 1 < KEY_GENERATIONS)
    @rule()
    def rotate(self) -> None:
        """A new key: the builder signs with it, every node trusts only it (the old one is
        revoked), and every process restarts."""
        self.gen += 1
        self.caches = [self._boot(n) for n in range(NODES)]
        self.loaded = [set() for _ in range(NODES)]

    @precondition(lambda self: any(isinstance(s, tuple) and s[1] < self.gen
                                   for s in self.local.values()))
    @rule(data=st.data())
    def get_revoked(self, data: st.DataObject) -> None:
        """A get of an entry a node fetched under a key revoked since: never a local hit."""
        node, key = data.draw(st.sampled_from(sorted(
            place for place, s in self.local.items() if isinstance(s, tuple) and s[1] < self.gen)))
        self.get(node, key)

    @precondition(lambda self: any(self.local[(BUILDER, k)] != ABSENT for k in KEYS))
    @rule(data=st.data())
    def promote_again(self, data: st.DataObject) -> None:
        """The builder promotes an entry of its tier again (`cache promote`): its own
        compile is signed with the current key and replaces a remote entry that key did not
        sign; one it fetched is re-signed only while the key that verified it is trusted."""
        key = data.draw(st.sampled_from(sorted(k for k in KEYS
                                               if self.local[(BUILDER, k)] != ABSENT)))
        self._promote(key)

    def _promote(self, key: str) -> bool:
        """`cache promote` of `key` on the builder, checked against the model; whether it
        published."""
        here, there = self.local[(BUILDER, key)], self.remote_state[key]
        cache = self.caches[BUILDER]
        try:
            published = promote_entry(cache.local, self.remote, key, policy=cache.trust)
        except CannotSign:
            assert isinstance(here, tuple) and here[1] < self.gen, (key, here, self.gen)
            _reached(RESIGN_REFUSED)
            return False
        assert here == OWN or here == ("fetched", self.gen), (key, here, self.gen)
        assert published == (there != ("good", self.gen)), (key, here, there, published)
        if published:
            _reached(REPLACED if there != ABSENT else "re-promotion published")
            if isinstance(here, tuple):
                _reached(RESIGNED)
            self.remote_state[key] = ("good", self.gen)
        return published

    @precondition(lambda self: any(self.local[(BUILDER, k)] != ABSENT for k in KEYS))
    @rule(data=st.data())
    def builder_evicts(self, data: st.DataObject) -> None:
        """The builder's tier drops an entry (``cache gc``) and its process restarts: its
        next get of that key fetches what the remote holds, as any node's."""
        key = data.draw(st.sampled_from(sorted(k for k in KEYS
                                               if self.local[(BUILDER, k)] != ABSENT)))
        self._evict_on_builder(key)

    def _evict_on_builder(self, key: str) -> None:
        assert self.locals[BUILDER].unpublish(key)
        self.local[(BUILDER, key)] = ABSENT
        self.restart(BUILDER)

    def _current(self) -> list[str]:
        return sorted(k for k, s in self.remote_state.items() if s == ("good", self.gen))

    @precondition(lambda self: self.gen + 1 < KEY_GENERATIONS and any(
        self.remote_state[k] == ("good", self.gen) and self.local[(n, k)] != OWN
        for k in KEYS for n in range(1, NODES)))
    @rule(data=st.data())
    def rotation_then_fetch(self, data: st.DataObject) -> None:
        """Forced, so every run reaches it: a serving node holds an entry fetched under the
        current key, the key is rotated (revoked), and the node asks for the entry again -
        neither its copy nor the remote's, both signed by the revoked key, is used."""
        node, key = data.draw(st.sampled_from(sorted(
            (n, k) for k in self._current() for n in range(1, NODES)
            if self.local[(n, k)] != OWN)))
        self.get(node, key)
        assert self.local[(node, key)] == ("fetched", self.gen)
        self.rotate()
        self.get(node, key)
        assert self.local[(node, key)] == OWN

    @precondition(lambda self: any(s == ("good", self.gen) for s in self.remote_state.values()))
    @rule(data=st.data())
    def resign_then_repromote(self, data: st.DataObject) -> None:
        """Forced, so every run reaches it: the builder fetches an entry its key signed (its
        own copy evicted), a writer without the key strips the remote's signature, the
        builder re-signs what it fetched and publishes it again, a second promotion finds it
        there, and a serving node fetches the re-signed entry."""
        key = data.draw(st.sampled_from(self._current()))
        if self.local[(BUILDER, key)] != ABSENT:
            self._evict_on_builder(key)
        self.get(BUILDER, key)
        assert self.local[(BUILDER, key)] == ("fetched", self.gen)
        self._forge(key, None, strip=True)
        assert self._promote(key)
        assert not self._promote(key)
        _reached(REPROMOTED)
        node = data.draw(st.integers(1, NODES - 1))
        self.restart(node)
        self.get(node, key)

    @rule(node=st.integers(0, NODES - 1))
    def restart(self, node: int) -> None:
        self.caches[node] = self._boot(node)
        self.loaded[node] = set()

    # -------------------------------------------------------------- invariants
    @invariant()
    def no_tier_holds_a_forged_artifact(self) -> None:
        for (node, key), state in self.local.items():
            prefix = self.locals[node].published(key)
            if state == ABSENT:
                continue  # a refused entry may still be there until its next get
            assert prefix is not None, (node, key, state)
            for name in FILES:
                assert self.locals[node].read(join(prefix, name)) == expected(key, name)

    @invariant()
    def the_remote_is_what_the_builder_published(self) -> None:
        for key, state in self.remote_state.items():
            prefix = self.remote.published(key)
            assert (prefix is None) == (state == ABSENT), (key, state)
            if not isinstance(state, tuple):
                continue
            data = self.remote.read(join(prefix, ENTRY_RECORD)) or b""
            record = decode_record(data)
            keys = load_public_keys([self.pairs[state[1]][1]])
            assert keys.judge(record, self.remote.read(join(prefix, SIGNATURE_FILE))).trusted
            for name in FILES:
                assert self.remote.read(join(prefix, name)) == expected(key, name)


def test_trust_model_in_memory(key_pairs: list[tuple[str, str, str]]) -> None:
    TrustModel.pairs = key_pairs
    REACHED.clear()
    start = time.monotonic()
    run_state_machine_as_test(
        TrustModel,
        settings=settings(max_examples=examples(ci=150), stateful_step_count=30, deadline=None,
                          derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )
    print(f"trust model: {time.monotonic() - start:.1f} s; reached: {dict(REACHED)}")
    if current_profile() == CI:  # what the model exists for, reached in the fixed examples
        for what in REQUIRED:
            assert REACHED[what] > 0, (what, dict(REACHED))
