"""Store operations beyond the contract suite: which path they take, and age bounds.

The contract (backends/testing_ops.py, run by every backend) says what the operations
do; these tests check *how* where it matters: the verified copy takes the kernel path
exactly when both stores have local paths (and still catches a source that shrinks under
it), S3 checks an entry's sizes with one listing, durable stores fsync what they write,
and debris is judged by its age.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from vllm_neuron.backends import (
    IntegrityError,
    Store,
    _kernel_copy,
    copy_tree,
    join,
    open_store,
    verified_copy,
)
from vllm_neuron.backends.digests import digest_bytes
from vllm_neuron.backends.testing_ops import BIG, publish

FILES = {"big.neff": BIG, "small.bin": b"s" * 100}
EXPECTED = {rel: digest_bytes(data) for rel, data in FILES.items()}


@pytest.fixture
def spy_kernel_copy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the files `copy_verified` copied on the kernel path."""
    calls: list[int] = []
    real = verified_copy.copy_and_hash

    def spy(src_fd: int, dst_fd: int, size: int, *, pipelined: bool) -> str:
        calls.append(size)
        return real(src_fd, dst_fd, size, pipelined=pipelined)

    monkeypatch.setattr(verified_copy, "copy_and_hash", spy)
    return calls


@pytest.mark.parametrize("pair", ["local-local", "local-memory", "memory-local"])
def test_the_kernel_path_is_taken_exactly_between_two_local_stores(
    tmp_path: Path, spy_kernel_copy: list[int], pair: str
) -> None:
    def make(kind: str, name: str) -> Store:
        return open_store(tmp_path / name) if kind == "local" else open_store("memory://")

    src_kind, dst_kind = pair.split("-")
    src, dst = make(src_kind, "src"), make(dst_kind, "dst")
    prefix = publish(src, "e", FILES)
    with dst.stage("e") as staging:
        verified_copy.copy_verified(src, prefix, staging, EXPECTED)
        assert staging.commit() is True
    assert dst.read(join(dst.published("e") or "", "big.neff")) == BIG
    # Only the file big enough for it, and only between two stores with local paths.
    assert spy_kernel_copy == ([len(BIG)] if pair == "local-local" else [])


def test_a_source_that_shrinks_under_the_kernel_copy_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spy_kernel_copy: list[int]
) -> None:
    src, dst = open_store(tmp_path / "src"), open_store(tmp_path / "dst")
    prefix = publish(src, "e", FILES)
    real = _kernel_copy.KernelCopy._once
    copied = {"n": 0}

    def shrinking(self: _kernel_copy.KernelCopy, offset: int, count: int) -> int:
        if copied["n"]:
            return 0  # end of file: someone truncated the source after the size check
        copied["n"] += 1
        return real(self, offset, min(count, 4096))

    monkeypatch.setattr(_kernel_copy.KernelCopy, "_once", shrinking)
    with dst.stage("e") as staging, pytest.raises(IntegrityError) as raised:
        verified_copy.copy_verified(src, prefix, staging, EXPECTED, workers=1)
    assert raised.value.rel == "big.neff"
    assert "shrank while it was being copied" in str(raised.value)
    assert dst.published("e") is None and dst.survey(older_than=-1.0).debris == []


def test_s3_checks_an_entry_s_sizes_with_one_listing(
    s3_server: str, s3_store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(s3_store_url, endpoint_url=s3_server)
    files = {f"f{i}": b"x" * i for i in range(1, 6)}
    prefix = publish(store, "e", files)
    calls: dict[str, int] = {"find": 0, "info": 0}
    for name in calls:
        real = getattr(store.fs, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(store.fs, name, counted)
    store.check_sizes(prefix, {rel: digest_bytes(data) for rel, data in files.items()})
    assert calls == {"find": 1, "info": 0}
    with pytest.raises(IntegrityError, match="f3 has 3 bytes, expected 4"):
        store.check_sizes(prefix, {"f3": digest_bytes(b"1234"), "f1": digest_bytes(b"x")})


@pytest.mark.parametrize("profile", ["local", "nfs"])
def test_durable_stores_fsync_what_they_write_and_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, profile: str
) -> None:
    """`Capabilities.durable` decides, for every write path, including tree copies (which
    used to sniff a private attribute of the destination)."""
    store = open_store(tmp_path / "store", profile=profile)
    assert store.capabilities.durable is (profile == "nfs")
    fsyncs: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real(fd))[1])
    source = open_store("memory://")
    source.write("t/a", b"A")
    (tmp_path / "local-file").write_bytes(b"L")
    def write_stream() -> None:
        with store.open_write("w") as f:
            f.write(b"W")

    operations = {
        "write": lambda: store.write("k", b"v"),
        "open_write": write_stream,
        "put_file": lambda: store.put_file("p", str(tmp_path / "local-file")),
        "copy_tree": lambda: copy_tree(source, "t", store, "copied"),
    }
    for name, operation in operations.items():
        fsyncs.clear()
        operation()
        assert bool(fsyncs) is (profile == "nfs"), name
    assert store.read("copied/a") == b"A" and store.read("w") == b"W"
    assert sorted(os.listdir(tmp_path / "store")) == ["copied", "k", "p", "w"]  # no temps


def _debris(store: Any, older_than: float) -> list[str]:
    return [d.prefix for d in store.survey(older_than=older_than).debris]


def test_debris_is_judged_by_its_age(tmp_path: Path) -> None:
    local = open_store(tmp_path / "local")
    staging = local.stage("e")
    staging.write("sub/a", b"A")
    old = time.time() - 7200
    directory = local.local_path(staging.prefix)
    assert directory is not None
    for dirpath, _dirs, names in os.walk(directory):
        for name in [*names, ""]:
            os.utime(os.path.join(dirpath, name) if name else dirpath, (old, old))
    [found] = local.survey(older_than=3600.0).debris
    assert found.prefix == staging.prefix and 7100 < found.age_seconds < 7300
    # A file written now makes the whole staging area young again.
    staging.write("sub/b", b"B")
    assert _debris(local, 3600.0) == []

    memory = open_store("memory://")
    publish(memory, "e", {"a": b"A"})
    abandoned = memory.stage("e")
    abandoned.write("a", b"A2")
    assert _debris(memory, 3600.0) == []
    memory.set_mtime(abandoned.key("a"), time.time() - 7200)  # type: ignore[attr-defined]
    assert _debris(memory, 3600.0) == [abandoned.prefix]


def test_a_dropped_event_log_gives_its_descriptor_back(tmp_path: Path) -> None:
    import gc

    from vllm_neuron.backends import Record

    class Tick(Record, frozen=True, tag="tick"):
        n: int

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    for n in range(50):  # a process that opens many caches (tests, a CLI, `cache warm`)
        log = open_store(str(tmp_path / f"s{n}")).log("events")
        log.append(Tick(n=n))
        assert log.descriptor() >= 0  # each record one os.write on an open descriptor
        del log
    gc.collect()
    assert open_fds() - before < 5  # not one descriptor left per log
