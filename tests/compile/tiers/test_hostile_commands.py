"""The operators' commands over a hostile tier (issue 39, docs/trust.md): ``cache verify`` /
``ls`` (`judge_tier`, `trust_summary`), ``cache sign`` (`sign_tier`), ``cache compat``
(`check_compat`), ``cache gc`` (`plan_gc`), ``cache warm`` (`warm_keys`) and the report's
notes (`NoteKind.read_all`) read every record and note of the tier bounded
(`RECORD_MAX_BYTES`, regular files only): a FIFO ``entry.json``, a 3 MiB ``entry.sig`` (a
sparse file: no 3 MiB written) or note is a defect of that key, never an exception out of
the command, never read whole."""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest

from vllm_neuron.backends import open_store
from vllm_neuron.backends._local import LocalStore
from vllm_neuron.compile import save_cache
from vllm_neuron.compile.commands.compat import Environment, check_compat
from vllm_neuron.compile.commands.warm import warm_keys
from vllm_neuron.compile.entry import notes
from vllm_neuron.compile.entry.notes import FAILURES, QUARANTINE
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.trust.policy import TrustPolicy, judge_tier, sign_tier, trust_summary
from vllm_neuron.compile.trust.signing import TrustedKeys, generate_key_pair, load_signer
from vllm_neuron.compile.upkeep.collect import plan_gc

RECORDS = (".json", ".sig", ".commit")


def _keys(n: int) -> list[str]:
    return [uuid.uuid5(uuid.NAMESPACE_URL, f"hostile-cmd-{i}").hex for i in range(n)]


def _sparse(path: str, size: int = 3 << 20) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    with open(path, "wb") as f:
        f.truncate(size)


@pytest.fixture
def hostile(tmp_path: Any, compile_fn: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A folder tier of two published entries: ``fifo``'s ``entry.json`` a FIFO,
    ``big``'s ``entry.sig`` 3 MiB; a 3 MiB failure note and a FIFO quarantine note. Every
    read of a record file from then on is recorded (key, max_size)."""
    remote = str(tmp_path / "remote")
    fifo, big = _keys(2)
    for key in (fifo, big):
        TwoTierCache(str(tmp_path / "builder")).get_or_compile(key, compile_fn(key))
        assert save_cache(str(tmp_path / "builder"), remote, key) is True
    os.unlink(os.path.join(remote, fifo, "entry.json"))
    os.mkfifo(os.path.join(remote, fifo, "entry.json"))
    _sparse(os.path.join(remote, big, "entry.sig"))
    _sparse(os.path.join(remote, FAILURES.path(fifo)))
    os.makedirs(os.path.join(remote, ".quarantine"), exist_ok=True)
    os.mkfifo(os.path.join(remote, QUARANTINE.path(big)))
    reads: list[tuple[str, int | None]] = []
    real = LocalStore.read

    def spy(self: Any, key: str, *, max_size: int | None = None) -> bytes | None:
        reads.append((key, max_size))
        return real(self, key, max_size=max_size)

    monkeypatch.setattr(LocalStore, "read", spy)
    return open_store(remote), fifo, big, reads, tmp_path


def _unbounded(reads: list[tuple[str, int | None]]) -> list[str]:
    return [k for k, m in reads if m is None and k.endswith(RECORDS)]


def test_verify_ls_and_sign_take_a_hostile_record_for_that_entrys_defect(hostile) -> None:
    store, fifo, big, reads, tmp_path = hostile
    judged = dict(judge_tier(store, TrustedKeys({})))
    assert fifo not in judged  # `cache verify` reports it as corrupt
    assert judged[big].status == "bad-signature" and "does not read" in judged[big].reason
    assert sum(trust_summary(store, None).values()) == 2
    private, _public, _ = generate_key_pair(str(tmp_path / "keys"))
    signed = dict(sign_tier(store, load_signer(private)))
    assert signed[fifo].startswith("not signed") and signed[big].startswith("not signed")
    assert _unbounded(reads) == []


def test_compat_gc_and_warm_read_a_hostile_tier_bounded(hostile) -> None:
    store, fifo, big, reads, tmp_path = hostile
    env = Environment(toolchain="t", target="t", versions={}, compiler_args=[])
    problems = {c.key: c.problem for c in check_compat(store, env)}
    assert problems[fifo] is not None
    plan = plan_gc(store, older_than=-1, failure_max_age=-1)
    assert FAILURES.path(fifo) in [i.where for i in plan.items]
    local = open_store(str(tmp_path / "node"))
    result = warm_keys(local, store, [fifo, big], policy=TrustPolicy(mode="off"),
                       on_total=lambda total: None)  # the sizes read first
    assert fifo in result.defective
    assert _unbounded(reads) == []


def test_notes_are_read_bounded_in_size_and_number(
        hostile, cache_warnings, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    store, fifo, big, reads, tmp_path = hostile
    assert QUARANTINE.read_all(store) == {}  # a FIFO note: one warning, nothing read
    assert any("did not read" in w for w in cache_warnings())
    assert FAILURES.read_all(store) == {}  # 3 MiB: refused unread
    monkeypatch.setattr(notes, "NOTES_READ_MAX", 3)
    for key in _keys(6)[2:]:
        _sparse(os.path.join(store.root, FAILURES.path(key)), 10)
    reads.clear()
    assert FAILURES.read_all(store) == {}
    assert reads == [] and any("more than the 3 names" in w for w in cache_warnings())
    assert _unbounded(reads) == []
