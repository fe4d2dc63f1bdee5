"""The two-tier cache's decision flow in one process: hits, misses, corruption and modes.

Compiles here are fake (cache_workers.fake_compile: bytes derived from the key), so every
test checks that what the cache hands back is the right artifact for the key.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable

import msgspec
import pytest
from blake3 import blake3
from cache_workers import FILE_NAMES, content_for, entry_is_right

from vllm_neuron.backends import _kernel_copy, digests, open_store, verified_copy
from vllm_neuron.backends.testing import HANG, wait_until_blocked
from vllm_neuron.compile import save_cache
from vllm_neuron.compile.entry.check import verify_entry
from vllm_neuron.compile.entry.events import read_stats
from vllm_neuron.compile.entry.failure_notes import write_failure_note
from vllm_neuron.compile.entry.record import (
    ENTRY_RECORD,
    EntryProblem,
    FileDigest,
    decode_record,
    encode_record,
)
from vllm_neuron.compile.flow.cache import CompileError, PrecompiledOnlyMiss, TwoTierCache
from vllm_neuron.compile.tiers.quarantine import QUARANTINE_DIR
from vllm_neuron.compile.upkeep.collect import STAGING_MAX_AGE

KEY = "0123456789abcdef0123456789abcdef"
KEY2 = "fedcba9876543210fedcba9876543210"


def key_n(n: int) -> str:
    return hashlib.md5(str(n).encode()).hexdigest()


def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def alter(path: str) -> None:
    """Same size, different bytes: only a checksum can tell."""
    with open(path, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))


class Counter:
    def __init__(self, compile_fn: Callable[..., object], key: str) -> None:
        self.calls = 0
        self._fn = compile_fn(key)

    def __call__(self, out: str) -> object:
        self.calls += 1
        return self._fn(out)


# ----------------------------------------------------------------------- basic flow


def test_miss_compiles_publishes_and_later_processes_hit(tmp_path, compile_fn):
    local = str(tmp_path / "local")
    first = TwoTierCache(local)
    fn = Counter(compile_fn, KEY)
    result = first.get_or_compile(KEY, fn, components={"graph": "g1", "inputs": "i1"})
    assert result.source == "compiled"
    assert fn.calls == 1
    assert result.path == os.path.join(local, KEY)
    assert entry_is_right(result.path, KEY) is None
    record = first.local_tier.read_entry(KEY)
    assert set(record.files) == set(FILE_NAMES)
    assert record.components == {"graph": "g1", "inputs": "i1"}
    assert all(d.size == 4096 for d in record.files.values())

    # Same process: served from memory. A new process (new cache object): local hit.
    assert first.get_or_compile(KEY, fn).source == "memory"
    second = TwoTierCache(local)
    hit = second.get_or_compile(KEY, fn)
    assert hit.source == "local"
    assert fn.calls == 1
    assert entry_is_right(hit.path, KEY) is None

    stats = read_stats(local)
    assert (stats.compiles, stats.misses, stats.hits) == (1, 1, 2)
    assert stats.time_saved_seconds >= 0
    assert first.local_tier.entries() == [KEY]


def test_different_keys_are_different_entries(tmp_path, compile_fn):
    cache = TwoTierCache(str(tmp_path))
    a = cache.get_or_compile(KEY, compile_fn(KEY))
    b = cache.get_or_compile(KEY2, compile_fn(KEY2))
    assert a.path != b.path
    assert entry_is_right(a.path, KEY) is None
    assert entry_is_right(b.path, KEY2) is None
    assert sorted(cache.local_tier.entries()) == sorted([KEY, KEY2])


def test_invalid_key_is_refused_before_any_io(tmp_path, compile_fn):
    cache = TwoTierCache(str(tmp_path / "c"))
    for bad in ("../" + KEY[3:], KEY.upper(), KEY[:31], ""):
        with pytest.raises(ValueError):
            cache.get_or_compile(bad, compile_fn(KEY))
    assert cache.local_tier.entries() == []


def test_a_failed_compile_publishes_nothing_and_leaves_no_staging(tmp_path, compile_fn):
    local = str(tmp_path)
    cache = TwoTierCache(local)
    with pytest.raises(ValueError, match="boom"):
        cache.get_or_compile(KEY, compile_fn(KEY, fail="boom"))
    assert not os.path.exists(os.path.join(local, KEY))
    assert os.listdir(os.path.join(local, ".staging")) == []
    assert read_stats(local).compile_failures == 1
    # The failure is not sticky for a later attempt that starts after it.
    assert cache.get_or_compile(KEY, compile_fn(KEY)).source == "compiled"


def test_a_waiter_that_started_before_a_failure_gets_compile_error(tmp_path, compile_fn):
    """The failure record is what turns "the holder failed" into an immediate error."""
    local = str(tmp_path)
    holder = TwoTierCache(local)
    waiter = TwoTierCache(local)
    lock = holder.local.lock(KEY)
    lock.acquire()
    import threading

    outcome: dict[str, BaseException | str] = {}

    def wait() -> None:
        try:
            waiter.get_or_compile(KEY, compile_fn(KEY))
            outcome["result"] = "returned"
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome["result"] = exc

    t = threading.Thread(target=wait)
    t.start()
    try:
        wait_until_blocked(t)  # the waiter is queued on the key's lock: its wait has begun
        assert outcome == {}
        write_failure_note(holder.local, KEY, "ValueError: the compiler crashed")  # a holder's
    finally:
        lock.release()
    t.join(HANG)
    assert not t.is_alive()
    assert isinstance(outcome["result"], CompileError)
    assert "the compiler crashed" in str(outcome["result"])


def test_lock_wait_beyond_the_timeout_names_the_variable(tmp_path, compile_fn):
    cache = TwoTierCache(str(tmp_path), timeout=0.3)
    other = open_store(str(tmp_path)).lock(KEY)
    other.acquire()
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="NEURON_LIBTORCH_COMPILATION_TIMEOUT=0.3"):
            cache.get_or_compile(KEY, compile_fn(KEY))
        assert time.monotonic() - start >= 0.25  # it waited (on a busy machine: longer)
    finally:
        other.release()


def test_stale_staging_is_collected_and_fresh_staging_is_kept(tmp_path):
    staging = tmp_path / ".staging"
    old, fresh, trash = staging / "old", staging / "fresh", tmp_path / ".trash" / "gone"
    for d in (old, fresh, trash):
        d.mkdir(parents=True)
        (d / "graph.bin").write_bytes(b"half")
    past = time.time() - STAGING_MAX_AGE - 60
    for path in (old, old / "graph.bin", trash, trash / "graph.bin"):
        os.utime(path, (past, past))
    os.utime(fresh, (past, past))  # an old directory with a fresh file: still being written
    assert TwoTierCache(str(tmp_path)).wait_for_upkeep(HANG)  # collected in the background
    assert not old.exists() and not trash.exists()
    assert fresh.exists()


def test_stale_uncommitted_versions_are_collected_on_a_memory_tier(compile_fn):
    local = open_store("memory://")
    TwoTierCache(local).get_or_compile(KEY, compile_fn(KEY))
    crashed = local.stage(KEY)  # a compile killed after writing half a file
    crashed.write("graph.bin", b"half")
    for key in local.list(crashed.prefix):
        local.set_mtime(key, time.time() - STAGING_MAX_AGE - 60)  # type: ignore[attr-defined]
    cache = TwoTierCache(local)
    assert cache.wait_for_upkeep(HANG)
    assert local.list(crashed.prefix) == []
    assert cache.get_or_compile(KEY, compile_fn(KEY, fail="no recompile")).source == "local"


# ------------------------------------------------------------------- corruption


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_local_entry_failing_the_size_check_is_quarantined_and_recompiled(
    tmp_path, compile_fn, cache_warnings, damage
):
    local = str(tmp_path)
    TwoTierCache(local).get_or_compile(KEY, compile_fn(KEY))
    victim = os.path.join(local, KEY, "weights", "w0.bin")
    truncate(victim) if damage == "truncate" else os.unlink(victim)

    fn = Counter(compile_fn, KEY)
    result = TwoTierCache(local).get_or_compile(KEY, fn)
    assert result.source == "compiled"
    assert fn.calls == 1
    assert entry_is_right(result.path, KEY) is None
    warnings = cache_warnings()
    assert len(warnings) == 1, warnings
    assert KEY in warnings[0] and "quarantined" in warnings[0]
    assert "weights/w0.bin" in warnings[0]
    note = open_store(local).read_json(f"{QUARANTINE_DIR}/{KEY}.json")
    assert note["key"] == KEY
    stats = read_stats(local)
    assert (stats.verification_failures, stats.compiles) == (1, 2)


@pytest.mark.parametrize("damage", ["deleted", "a directory", "empty"])
def test_local_entry_without_a_readable_record_is_quarantined_and_recompiled(
    tmp_path, compile_fn, cache_warnings, damage
):
    # Not a miss: the defective entry's directory would block publishing the recompile.
    local = str(tmp_path)
    TwoTierCache(local).get_or_compile(KEY, compile_fn(KEY))
    record = os.path.join(local, KEY, "entry.json")
    os.unlink(record)
    if damage == "a directory":
        os.mkdir(record)
    elif damage == "empty":
        open(record, "wb").close()

    fn = Counter(compile_fn, KEY)
    result = TwoTierCache(local).get_or_compile(KEY, fn)
    assert (result.source, fn.calls) == ("compiled", 1)
    assert entry_is_right(result.path, KEY) is None
    warnings = cache_warnings()
    assert len(warnings) == 1 and KEY in warnings[0] and "quarantined" in warnings[0], warnings
    assert TwoTierCache(local).get_or_compile(KEY, compile_fn(KEY)).source == "local"


def test_altered_bytes_pass_the_size_check_but_verify_catches_them(
    tmp_path, compile_fn, cache_warnings
):
    local = str(tmp_path)
    TwoTierCache(local).get_or_compile(KEY, compile_fn(KEY))
    alter(os.path.join(local, KEY, "graph.bin"))

    cache = TwoTierCache(local)
    # A local hit only checks sizes (cheap): the altered file is not noticed here...
    assert cache.get_or_compile(KEY, compile_fn(KEY)).source == "local"
    assert cache_warnings() == []
    # ...but a full verification is, and it withdraws the entry.
    problem = cache.local_tier.verify(KEY)
    assert problem is not None and "graph.bin" in problem and "SHA-256" in problem
    warnings = cache_warnings()
    assert len(warnings) == 1 and KEY in warnings[0]
    assert not os.path.exists(os.path.join(local, KEY))
    # The same cache object forgets its loaded copy, so the next call recompiles.
    fn = Counter(compile_fn, KEY)
    result = cache.get_or_compile(KEY, fn)
    assert (result.source, fn.calls) == ("compiled", 1)
    assert entry_is_right(result.path, KEY) is None
    assert cache.local_tier.verify(KEY) is None


@pytest.mark.parametrize("damage", [truncate, alter], ids=["truncated", "altered"])
def test_corrupt_local_entry_is_refetched_from_the_remote(
    tmp_path, compile_fn, cache_warnings, damage
):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    TwoTierCache(local).get_or_compile(KEY, compile_fn(KEY))
    assert save_cache(local, remote, KEY) is True
    damage(os.path.join(local, KEY, "weights", "w1.bin"))

    cache = TwoTierCache(local, remote=remote)
    if damage is alter:  # found by verification, not by the size-checked hit
        assert cache.local_tier.verify(KEY) is not None
    fn = Counter(compile_fn, KEY)
    result = cache.get_or_compile(KEY, fn)
    assert result.source == "remote"
    assert fn.calls == 0
    assert entry_is_right(result.path, KEY) is None
    warnings = cache_warnings()
    assert len(warnings) == 1 and KEY in warnings[0] and "w1.bin" in warnings[0]


@pytest.mark.parametrize("damage", [truncate, alter], ids=["truncated", "altered"])
@pytest.mark.parametrize("remote_write", ["auto", "off"])
def test_corrupt_remote_entry_is_quarantined_and_compiled_locally(
    tmp_path, compile_fn, cache_warnings, damage, remote_write
):
    node_a, node_b, remote = (str(tmp_path / n) for n in ("a", "b", "remote"))
    TwoTierCache(node_a).get_or_compile(KEY, compile_fn(KEY))
    save_cache(node_a, remote, KEY)
    damage(os.path.join(remote, KEY, "graph.bin"))

    fn = Counter(compile_fn, KEY)
    node = TwoTierCache(node_b, remote=remote, remote_write=remote_write)
    result = node.get_or_compile(KEY, fn)
    assert (result.source, fn.calls) == ("compiled", 1)
    assert entry_is_right(result.path, KEY) is None
    warnings = cache_warnings()
    assert len(warnings) == 1, warnings
    assert remote in warnings[0] and KEY in warnings[0] and "graph.bin" in warnings[0]
    if damage is alter:  # a 4 KiB file: the streaming path, checking BLAKE3
        assert "fails its BLAKE3 check" in warnings[0]
    assert not os.listdir(os.path.join(node_b, ".staging"))  # the bad copy was not kept
    assert read_stats(node_b).verification_failures == 1
    if remote_write == "auto":
        # The compile that replaced the corrupt entry was promoted: the remote is repaired.
        assert read_stats(node_b).promotions == 1
        assert entry_is_right(os.path.join(remote, KEY), KEY) is None
        assert verify_entry(open_store(remote), KEY) is None
        return
    assert open_store(remote).published(KEY) is None  # withdrawn from the remote too
    # Re-promoting the good local entry repairs the remote tier.
    assert save_cache(node_b, remote, KEY) is True


def test_remote_record_naming_another_key_is_not_served(tmp_path, compile_fn, cache_warnings):
    node_a, remote = str(tmp_path / "a"), str(tmp_path / "remote")
    TwoTierCache(node_a).get_or_compile(KEY, compile_fn(KEY))
    save_cache(node_a, remote, KEY)
    os.rename(os.path.join(remote, KEY), os.path.join(remote, KEY2))  # mislabelled entry

    fn = Counter(compile_fn, KEY2)
    result = TwoTierCache(str(tmp_path / "b"), remote=remote).get_or_compile(KEY2, fn)
    assert (result.source, fn.calls) == ("compiled", 1)
    assert entry_is_right(result.path, KEY2) is None
    assert len(cache_warnings()) == 1


def test_local_record_naming_another_key_is_a_miss(tmp_path, compile_fn, cache_warnings):
    local = str(tmp_path)
    TwoTierCache(local).get_or_compile(KEY, compile_fn(KEY))
    os.rename(os.path.join(local, KEY), os.path.join(local, KEY2))
    result = TwoTierCache(local).get_or_compile(KEY2, compile_fn(KEY2))
    assert result.source == "compiled"
    assert entry_is_right(result.path, KEY2) is None
    assert len(cache_warnings()) == 1


def test_unreadable_local_record_is_a_miss(tmp_path, compile_fn, cache_warnings):
    local = str(tmp_path)
    TwoTierCache(local).get_or_compile(KEY, compile_fn(KEY))
    with open(os.path.join(local, KEY, ENTRY_RECORD), "wb") as f:
        f.write(b'{"key": 12')
    result = TwoTierCache(local).get_or_compile(KEY, compile_fn(KEY))
    assert result.source == "compiled"
    assert len(cache_warnings()) == 1


def test_read_entry_of_an_absent_key_is_an_entry_problem(tmp_path):
    with pytest.raises(EntryProblem, match=KEY):
        TwoTierCache(str(tmp_path)).local_tier.read_entry(KEY)


# --------------------------------------------------------------------- promotion


def test_save_cache_refuses_missing_and_corrupt_local_entries(tmp_path, compile_fn):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    with pytest.raises(RuntimeError, match="does not exist"):
        save_cache(str(tmp_path / "nowhere"), remote, KEY)
    TwoTierCache(local).get_or_compile(KEY, compile_fn(KEY))
    with pytest.raises(RuntimeError, match="does not exist"):
        save_cache(local, remote, KEY2)
    alter(os.path.join(local, KEY, "meta.txt"))
    with pytest.raises(RuntimeError, match="incomplete or corrupt"):
        save_cache(local, remote, KEY)
    assert open_store(remote).published(KEY) is None
    with pytest.raises(ValueError):
        save_cache(local, remote, "not-a-key")


def test_save_cache_publishes_once_then_is_a_no_op(tmp_path, compile_fn):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    TwoTierCache(local).get_or_compile(KEY, compile_fn(KEY))
    seen: list[tuple[int, int]] = []
    assert save_cache(local, remote, KEY, progress=lambda d, t: seen.append((d, t))) is True
    assert save_cache(local, remote, KEY) is False
    assert seen[-1][0] == seen[-1][1] > 4 * 4096  # every byte, entry record included
    assert entry_is_right(os.path.join(remote, KEY), KEY) is None
    assert os.listdir(os.path.join(remote, ".staging")) == []
    assert read_stats(local).promotions == 1


# -------------------------------------------------------------------------- modes


def test_disabled_cache_compiles_every_time_and_publishes_nothing(tmp_path, compile_fn):
    local = str(tmp_path)
    cache = TwoTierCache(local, disabled=True)
    fn = Counter(compile_fn, KEY)
    paths = {cache.get_or_compile(KEY, fn).path for _ in range(2)}
    paths.add(TwoTierCache(local, disabled=True).get_or_compile(KEY, fn).path)
    assert fn.calls == 3
    assert len(paths) == 3
    for p in paths:
        assert p is not None and entry_is_right(p, KEY) is None
    assert cache.local_tier.entries() == []
    assert not os.path.exists(os.path.join(local, KEY))
    assert read_stats(local).compiles == 3


UNCACHED_PROCESS = """
import os, sys, tempfile
from vllm_neuron.compile.flow.cache import TwoTierCache

def compile_fn(out_dir):
    with open(os.path.join(out_dir, "graph.bin"), "wb") as f:
        f.write(b"x" * 64)
    return {}

tempfile.tempdir = sys.argv[2]
cache = TwoTierCache(sys.argv[1], disabled=True)
paths = [cache.get_or_compile(k * 32, compile_fn).path for k in "ab"]
assert all(os.path.isfile(os.path.join(p, "graph.bin")) for p in paths)
child = os.fork()
if child == 0:
    sys.exit(0)  # a forked child exits normally: its exit hooks run, the directory is not its
os.waitpid(child, 0)
assert all(os.path.isfile(os.path.join(p, "graph.bin")) for p in paths), "removed by the child"
print("\\n".join(paths))
"""


def test_disabled_cache_compiles_leave_nothing_behind_once_the_process_exits(tmp_path):
    import subprocess
    import sys

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = subprocess.run([sys.executable, "-c", UNCACHED_PROCESS, str(tmp_path / "cache"),
                           str(scratch)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    paths = done.stdout.split()
    assert len(paths) == 2 and all(p.startswith(str(scratch)) for p in paths)
    assert list(scratch.iterdir()) == []  # both directories, and the process's scratch


def test_precompiled_only_miss_raises_naming_the_variable(tmp_path, compile_fn):
    fn = Counter(compile_fn, KEY)
    cache = TwoTierCache(str(tmp_path / "local"), remote=str(tmp_path / "remote"),
                         precompiled_only=True)
    with pytest.raises(RuntimeError, match="VLLM_NEURON_DISABLE_WARMUP_COMPILE") as info:
        cache.get_or_compile(KEY, fn)
    assert isinstance(info.value, PrecompiledOnlyMiss)
    assert KEY in str(info.value) and str(tmp_path / "remote") in str(info.value)
    assert fn.calls == 0
    assert cache.local_tier.entries() == []


def test_precompiled_only_serves_local_and_remote_hits(tmp_path, compile_fn):
    builder, remote = str(tmp_path / "builder"), str(tmp_path / "remote")
    TwoTierCache(builder).get_or_compile(KEY, compile_fn(KEY))
    save_cache(builder, remote, KEY)

    consumer = str(tmp_path / "consumer")
    fn = Counter(compile_fn, KEY)
    fetched = TwoTierCache(consumer, remote=remote, precompiled_only=True).get_or_compile(KEY, fn)
    assert fetched.source == "remote"
    assert entry_is_right(fetched.path, KEY) is None
    again = TwoTierCache(consumer, precompiled_only=True).get_or_compile(KEY, fn)
    assert again.source == "local"
    assert fn.calls == 0


def test_precompiled_only_with_the_cache_disabled_is_a_startup_error(tmp_path):
    with pytest.raises(ValueError, match="NEURON_LIBTORCH_DISABLE_COMPILE_CACHE"):
        TwoTierCache(str(tmp_path), disabled=True, precompiled_only=True)


def test_precompiled_only_from_the_environment(tmp_path, monkeypatch, compile_fn):
    from vllm_neuron import envs
    from vllm_neuron.assembly import build_runtime

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_NEURON_TOOLCHAIN", "host")
    monkeypatch.setenv("VLLM_NEURON_DISABLE_WARMUP_COMPILE", "1")
    monkeypatch.delenv("NEURON_LIBTORCH_REMOTE_CACHE", raising=False)
    monkeypatch.delenv("NEURON_LIBTORCH_DISABLE_COMPILE_CACHE", raising=False)
    envs.reset_for_tests()
    try:
        runtime = build_runtime()
        assert runtime.cache.precompiled_only
        assert runtime.cache.local_dir == os.path.join(str(tmp_path), "neuron", "compile_cache")
        with pytest.raises(RuntimeError, match="VLLM_NEURON_DISABLE_WARMUP_COMPILE=1"):
            runtime.cache.get_or_compile(KEY, compile_fn(KEY))

        monkeypatch.setenv("NEURON_LIBTORCH_DISABLE_COMPILE_CACHE", "1")
        envs.reset_for_tests()
        with pytest.raises(ValueError) as info:
            build_runtime()
        assert "VLLM_NEURON_DISABLE_WARMUP_COMPILE" in str(info.value)
        assert "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE" in str(info.value)
    finally:
        envs.reset_for_tests()


def test_disabled_cache_from_the_environment(tmp_path, monkeypatch):
    from vllm_neuron import envs
    from vllm_neuron.assembly import build_runtime

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_NEURON_TOOLCHAIN", "host")
    monkeypatch.setenv("NEURON_LIBTORCH_DISABLE_COMPILE_CACHE", "1")
    monkeypatch.setenv("NEURON_LIBTORCH_COMPILATION_TIMEOUT", "42")
    monkeypatch.setenv("NEURON_LIBTORCH_REMOTE_CACHE", str(tmp_path / "remote"))
    monkeypatch.delenv("VLLM_NEURON_DISABLE_WARMUP_COMPILE", raising=False)
    envs.reset_for_tests()
    try:
        cache = build_runtime().cache
    finally:
        envs.reset_for_tests()
    assert cache.disabled and not cache.precompiled_only
    assert cache.timeout == 42.0
    assert cache.remote_url == str(tmp_path / "remote")


# ------------------------------------------------------------ memory local tier


def test_a_memory_local_tier_runs_the_same_flow(compile_fn):
    import uuid

    local = open_store("memory://")
    remote_url = f"memory://remote-{uuid.uuid4().hex}"
    cache = TwoTierCache(local, remote=remote_url)
    result = cache.get_or_compile(KEY, compile_fn(KEY))
    assert result.source == "compiled" and result.path is None
    assert result.prefix.startswith(f"{KEY}/")
    for name in FILE_NAMES:
        assert local.read(f"{result.prefix}/{name}") == content_for(KEY, name)
    assert TwoTierCache(local).get_or_compile(KEY, compile_fn(KEY)).source == "local"
    assert cache.local_tier.verify(KEY) is None
    assert cache.local_tier.read_entry(KEY).key == KEY


# ------------------------------------------------------------ large-file fetches

BIG = 20 << 20  # several copy chunks: damage past the first chunk must be caught too


def _big_entry(tmp_path) -> tuple[str, str]:
    """A remote entry with one large file (and a small one), promoted from a builder."""
    builder, remote = str(tmp_path / "builder"), str(tmp_path / "remote")

    def compile_into(out: str) -> dict[str, str]:
        block = hashlib.sha256(b"big").digest() * (1 << 15)  # 1 MiB
        with open(os.path.join(out, "model.neff"), "wb") as f:
            for i in range(BIG // len(block)):
                f.write(block[i:] + block[:i])
        with open(os.path.join(out, "small.txt"), "wb") as f:
            f.write(b"small")
        return {}

    TwoTierCache(builder).get_or_compile(KEY, compile_into)
    assert save_cache(builder, remote, KEY)
    return builder, os.path.join(remote, KEY, "model.neff")


def test_a_large_file_is_fetched_intact(tmp_path):
    builder, _ = _big_entry(tmp_path)
    cache = TwoTierCache(str(tmp_path / "node"), remote=str(tmp_path / "remote"))
    result = cache.fetch_remote(KEY)
    assert result is not None and result.source == "remote"
    with open(os.path.join(result.path, "model.neff"), "rb") as a, \
            open(os.path.join(builder, KEY, "model.neff"), "rb") as b:
        assert a.read() == b.read()
    assert cache.local_tier.verify(KEY) is None


@pytest.mark.parametrize("damage", ["middle-byte", "truncated", "extended"])
def test_damage_anywhere_in_a_large_remote_file_is_caught(tmp_path, cache_warnings, damage):
    _, big = _big_entry(tmp_path)
    with open(big, "r+b") as f:
        if damage == "middle-byte":
            f.seek(BIG // 2 + 12345)
            byte = f.read(1)
            f.seek(BIG // 2 + 12345)
            f.write(bytes([byte[0] ^ 0x10]))
        elif damage == "truncated":
            f.truncate(BIG - 1)
        else:
            f.seek(0, os.SEEK_END)
            f.write(b"\0" * 4096)
    node = str(tmp_path / "node")
    cache = TwoTierCache(node, remote=str(tmp_path / "remote"))
    assert cache.fetch_remote(KEY) is None
    warnings = cache_warnings()
    assert len(warnings) == 1 and "model.neff" in warnings[0]
    if damage == "middle-byte":  # caught by the kernel-copy path's BLAKE3 of the copy
        assert "fails its BLAKE3 check" in warnings[0]
    assert not os.path.exists(os.path.join(node, KEY))
    assert os.listdir(os.path.join(node, ".staging")) == []
    assert open_store(str(tmp_path / "remote")).published(KEY) is None


def test_a_remote_file_missing_from_a_published_entry_quarantines_it(
    tmp_path, compile_fn, cache_warnings
):
    builder, remote = str(tmp_path / "builder"), str(tmp_path / "remote")
    TwoTierCache(builder).get_or_compile(KEY, compile_fn(KEY))
    save_cache(builder, remote, KEY)
    os.unlink(os.path.join(remote, KEY, "weights", "w0.bin"))
    result = TwoTierCache(str(tmp_path / "node"), remote=remote).get_or_compile(
        KEY, compile_fn(KEY))
    assert result.source == "compiled"
    warnings = cache_warnings()
    assert len(warnings) == 1 and "w0.bin is missing" in warnings[0]
    # Withdrawn, then replaced by the promotion of the node's compile: repaired.
    assert verify_entry(open_store(remote), KEY) is None


# ------------------------------------------------------- BLAKE3 and older records


def rewrite_record(entry_dir: str, change: Callable[[str, FileDigest], FileDigest]) -> None:
    """Rewrite the entry's commit record, passing every file's digest through `change`."""
    path = os.path.join(entry_dir, ENTRY_RECORD)
    with open(path, "rb") as f:
        record = decode_record(f.read())
    files = {rel: change(rel, digest) for rel, digest in record.files.items()}
    with open(path, "wb") as f:
        f.write(encode_record(msgspec.structs.replace(record, files=files)))


def without_blake3(_rel: str, digest: FileDigest) -> FileDigest:
    """The digest as a record written before BLAKE3 was added has it."""
    return FileDigest(size=digest.size, sha256=digest.sha256)


def test_records_carry_sha256_and_blake3_of_every_file(tmp_path, compile_fn):
    cache = TwoTierCache(str(tmp_path))
    result = cache.get_or_compile(KEY, compile_fn(KEY))
    for name in FILE_NAMES:
        digest = result.record.files[name]
        data = content_for(KEY, name)
        assert digest.sha256 == hashlib.sha256(data).hexdigest()
        assert digest.blake3 == blake3(data).hexdigest()


def test_a_large_file_gets_both_digests_from_one_read(tmp_path):
    data = os.urandom(3 * digests.DIGEST_CHUNK + 12345)  # several chunks, the last partial
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    assert digests.file_digest(str(path)) == FileDigest(
        size=len(data), sha256=hashlib.sha256(data).hexdigest(),
        blake3=blake3(data).hexdigest())


def test_a_record_without_blake3_encodes_and_decodes_as_before():
    old = (b'{"schema":1,"key":"%s","toolchain":"host","target":"cpu","created":1.0,'
           b'"compile_seconds":2.0,"files":{"a.bin":{"size":3,"sha256":"%s"}}}'
           % (KEY.encode(), b"ab" * 32))
    record = decode_record(old)
    assert record.files["a.bin"] == FileDigest(size=3, sha256="ab" * 32)
    assert record.files["a.bin"].blake3 is None
    assert b"blake3" not in encode_record(record)


@pytest.mark.parametrize("damage", [None, "altered"])
@pytest.mark.parametrize("big", [True, False], ids=["large-file", "small-files"])
def test_an_old_record_without_blake3_fetches_and_verifies_with_sha256(
    tmp_path, compile_fn, cache_warnings, damage, big
):
    remote = str(tmp_path / "remote")
    if big:
        _, path = _big_entry(tmp_path)
    else:
        TwoTierCache(str(tmp_path / "builder")).get_or_compile(KEY, compile_fn(KEY))
        save_cache(str(tmp_path / "builder"), remote, KEY)
        path = os.path.join(remote, KEY, "graph.bin")
    rewrite_record(os.path.join(remote, KEY), without_blake3)
    if damage:
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 1)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))

    cache = TwoTierCache(str(tmp_path / "node"), remote=remote)
    result = cache.fetch_remote(KEY)
    if damage:
        assert result is None
        warnings = cache_warnings()
        assert len(warnings) == 1 and os.path.basename(path) in warnings[0]
        assert "fails its SHA-256 check" in warnings[0]
        assert open_store(remote).published(KEY) is None
        return
    assert result is not None and result.source == "remote"
    assert all(d.blake3 is None for d in result.record.files.values())
    with open(path, "rb") as a, open(os.path.join(result.path, os.path.relpath(
            path, os.path.join(remote, KEY))), "rb") as b:
        assert a.read() == b.read()
    assert cache.local_tier.verify(KEY) is None  # SHA-256 only, as the record has
    assert cache_warnings() == []


def test_a_wrong_sha256_with_a_right_blake3_is_fetched_but_verify_catches_it(
    tmp_path, cache_warnings
):
    """A fetch checks BLAKE3 only; `verify` checks SHA-256 (and BLAKE3) and finds it."""
    _big_entry(tmp_path)
    remote = str(tmp_path / "remote")
    rewrite_record(os.path.join(remote, KEY), lambda rel, d: msgspec.structs.replace(
        d, sha256="0" * 64) if rel == "model.neff" else d)
    cache = TwoTierCache(str(tmp_path / "node"), remote=remote)
    assert cache.fetch_remote(KEY) is not None
    problem = cache.local_tier.verify(KEY)
    assert problem is not None and "model.neff fails its SHA-256 check" in problem
    assert cache.local_tier.lookup(KEY) is None  # quarantined


def test_a_wrong_blake3_with_a_right_sha256_is_caught_by_fetch_and_by_verify(
    tmp_path, compile_fn, cache_warnings
):
    _big_entry(tmp_path)
    remote = str(tmp_path / "remote")
    rewrite_record(os.path.join(remote, KEY), lambda rel, d: msgspec.structs.replace(
        d, blake3="0" * 64) if rel == "model.neff" else d)
    assert TwoTierCache(str(tmp_path / "node"), remote=remote).fetch_remote(KEY) is None
    warnings = cache_warnings()
    assert len(warnings) == 1 and "model.neff fails its BLAKE3 check" in warnings[0]

    local = str(tmp_path / "local")
    TwoTierCache(local).get_or_compile(KEY, compile_fn(KEY))
    rewrite_record(os.path.join(local, KEY), lambda rel, d: msgspec.structs.replace(
        d, blake3="0" * 64) if rel == "meta.txt" else d)
    problem = TwoTierCache(local).local_tier.verify(KEY)
    assert problem is not None and "meta.txt fails its BLAKE3 check" in problem


def _entry_with_one_file(tmp_path, size: int) -> tuple[bytes, str]:
    """A remote entry holding one file of `size` bytes; returns its bytes and remote path."""
    data = (hashlib.sha256(str(size).encode()).digest() * (size // 32 + 1))[:size]
    data = data[:size // 3] + os.urandom(64) + data[size // 3 + 64:]
    builder, remote = str(tmp_path / "builder"), str(tmp_path / "remote")

    def compile_into(out: str) -> dict[str, str]:
        with open(os.path.join(out, "model.neff"), "wb") as f:
            f.write(data)
        return {}

    TwoTierCache(builder).get_or_compile(KEY, compile_into)
    assert save_cache(builder, remote, KEY)
    return data, os.path.join(remote, KEY, "model.neff")


SIZES = {
    "below-kernel-copy": verified_copy.KERNEL_COPY_MIN - 1,
    "kernel-copy": verified_copy.KERNEL_COPY_MIN,
    "below-pipeline": verified_copy.PIPELINE_MIN - 1,
    "pipeline": verified_copy.PIPELINE_MIN,
    "pipeline-partial-step": verified_copy.PIPELINE_MIN + verified_copy.KERNEL_COPY_STEP + 4097,
}


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("where", ["first", "last"])
def test_every_copy_path_copies_intact_and_catches_a_flipped_byte(
    tmp_path, cache_warnings, size, where
):
    data, path = _entry_with_one_file(tmp_path, size)
    node = TwoTierCache(str(tmp_path / "node"), remote=str(tmp_path / "remote"))
    result = node.fetch_remote(KEY)
    assert result is not None
    with open(os.path.join(result.path, "model.neff"), "rb") as f:
        assert f.read() == data

    with open(path, "r+b") as f:
        f.seek(0 if where == "first" else size - 1)
        f.write(bytes([data[0 if where == "first" else -1] ^ 0x80]))
    other = TwoTierCache(str(tmp_path / "other"), remote=str(tmp_path / "remote"))
    assert other.fetch_remote(KEY) is None
    warnings = cache_warnings()
    assert len(warnings) == 1 and "model.neff fails its BLAKE3 check" in warnings[0]
    assert os.listdir(os.path.join(str(tmp_path / "other"), ".staging")) == []


@pytest.mark.parametrize("refuse", [["copy_file_range"], ["copy_file_range", "sendfile"]])
def test_the_kernel_copy_falls_back_when_refused(tmp_path, monkeypatch, refuse):
    """EXDEV (e.g. NFS -> ext4) from copy_file_range: sendfile; refused too: pread/pwrite."""
    import errno

    builder, _ = _big_entry(tmp_path)
    calls = {"pwrite": 0}
    real_pwrite = os.pwrite

    def refused(*_args: object) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    def counting_pwrite(*args: object) -> int:
        calls["pwrite"] += 1
        return real_pwrite(*args)  # type: ignore[arg-type]

    for name in refuse:
        monkeypatch.setattr(os, name, refused)
    monkeypatch.setattr(os, "pwrite", counting_pwrite)
    cache = TwoTierCache(str(tmp_path / "node"), remote=str(tmp_path / "remote"))
    result = cache.fetch_remote(KEY)
    assert result is not None
    with open(os.path.join(result.path, "model.neff"), "rb") as a, \
            open(os.path.join(builder, KEY, "model.neff"), "rb") as b:
        assert a.read() == b.read()
    assert (calls["pwrite"] > 0) == ("sendfile" in refuse)


def test_a_copy_error_mid_file_stops_the_copier_and_keeps_nothing(
    tmp_path, monkeypatch, cache_warnings
):
    import errno
    import threading

    _big_entry(tmp_path)
    real = os.copy_file_range
    calls = {"n": 0}

    def failing(*args: int) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", failing)
    node = str(tmp_path / "node")
    cache = TwoTierCache(node, remote=str(tmp_path / "remote"))
    assert cache.fetch_remote(KEY) is None  # a remote failure, not a corrupt entry
    assert open_store(str(tmp_path / "remote")).published(KEY) == KEY  # not quarantined
    assert os.listdir(os.path.join(node, ".staging")) == []
    assert not any(t.name == "vllm-neuron-fetch-copy" for t in threading.enumerate())
    assert "Input/output error" in cache_warnings()[0]


def test_a_source_shorter_than_its_copy_range_is_reported(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(b"x" * 1000)
    src_fd = os.open(src, os.O_RDONLY)
    dst_fd = os.open(dst, os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(_kernel_copy.SourceShrank):
            _kernel_copy.KernelCopy(src_fd, dst_fd).copy(0, 2000)
    finally:
        os.close(src_fd)
        os.close(dst_fd)
    assert dst.read_bytes() == b"x" * 1000


@pytest.mark.parametrize("size", [0, 1, 5 << 20])  # empty, tiny, more than one read
def test_check_verified_checks_in_place_as_a_copy_does(tmp_path, size):
    """`check_verified`: what a load from an unpacked copy checks (compile/tiers/unpacked.py)."""
    from vllm_neuron.backends import IntegrityError, digests
    from vllm_neuron.backends.verified_copy import check_verified

    store = open_store(str(tmp_path))
    data = os.urandom(size)
    store.write("copy/member.bin", data)
    recorded = digests.digest_bytes(data)
    check_verified(store, "copy", {"member.bin": recorded})
    sha_only = msgspec.structs.replace(recorded, blake3=None)  # a record without BLAKE3
    check_verified(store, "copy", {"member.bin": sha_only})

    def fails(files, match):
        with pytest.raises(IntegrityError, match=match):
            check_verified(store, "copy", files)

    fails({"absent.bin": recorded}, "absent.bin is missing")
    store.write("copy/member.bin", data + b"x")
    fails({"member.bin": recorded}, f"member.bin has {size + 1} bytes, expected {size}")
    if size:
        store.write("copy/member.bin", bytes([data[0] ^ 1]) + data[1:])  # same size
        fails({"member.bin": recorded}, "member.bin fails its BLAKE3 check")
        fails({"member.bin": sha_only}, "member.bin fails its SHA-256 check")
