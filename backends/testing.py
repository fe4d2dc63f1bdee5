"""The store contract suite, shipped with the package (as zarr ships `StoreTests`).

Every backend runs the same tests. A backend's test module subclasses
`StoreContractTests` and supplies one fixture, ``store``, that returns a fresh, empty
store::

    from vllm_neuron.backends import open_store
    from vllm_neuron.backends.testing import StoreContractTests

    class TestMemoryStore(StoreContractTests):
        @pytest.fixture
        def store(self):
            return open_store("memory://")

The tests ask the store's `Capabilities` which protocol applies (kernel lock or lease,
rename or commit record) instead of checking its type. Lease tests run on every store:
where `store.lock()` gives a kernel lock they drive a `LeaseLock` over the same store,
since the lease protocol only needs the store's create-if-absent.

Nothing here is decided by how long something took: "meanwhile" is a handshake (a thread
seen blocked inside a lock's ``acquire``), lease expiry is read from the lease's own record
on the store's clock, and the only upper bounds (`HANG`) catch hangs. A loaded machine
makes the suite slower, never red.

Needs pytest (the ``test`` extra); nothing else in the package imports this module.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from .errors import InvalidKey, LeaseLost, LockTimeout, StoreError
from .keys import join
from .locks import KernelLock, LeaseLock, Lock
from .records import Record, RecordCodec, encode_line
from .router import open_store
from .store import Store
from .testing_ops import StoreOperationTests, published_files
from .transfer import copy_tree

__all__ = [
    "BAD_KEYS",
    "BAD_PREFIXES",
    "HANG",
    "ContractEvent",
    "OtherEvent",
    "StoreContractTests",
    "all_files",
    "lease_record",
    "published_files",
    "wait_until_blocked",
]

HANG = 300.0
"""Seconds. A safety limit only: what takes this long is hung, not slow."""


class ContractEvent(Record, tag="contract-event", frozen=True):
    """A small event record, shaped like the ones the domain code logs."""

    key: str
    rank: int
    shape: tuple[int, ...] = ()


class OtherEvent(Record, tag="contract-other", frozen=True):
    """A second record kind, so streams mix tags as real ones do."""

    note: str


BAD_KEYS = (
    "../escape",
    "a/../../escape",
    "a/./b",
    ".",
    "/etc/passwd",
    "a//b",
    "",
    "a\x00b",
    "a/",
    "a\\b",
    "s3://bucket/key",
)
"""Keys every key-taking operation must refuse with `InvalidKey`."""

BAD_PREFIXES = ("../escape", "/abs", "a//", "a//b", "a\x00b", "a/../b")
"""Prefixes (where "" and one trailing '/' are fine) that must be refused."""

BINARY = bytes(range(256)) * 4 + b"\x00\xff\n\r\n"


def all_files(store: Store) -> dict[str, bytes]:
    """Every file in the store with its content."""
    return {k: store.read(k) or b"" for k in store.list("")}


def _lock_classes(cls: type[Lock] = Lock) -> list[type[Lock]]:
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _lock_classes(direct))]


def wait_until_blocked(thread: threading.Thread, timeout: float = HANG) -> None:
    """Poll until `thread` is inside a lock's ``acquire`` (seen in its stack).

    The observable fact that a thread waits for a lock, where a test would otherwise sleep
    and hope it got there. Fails if the thread ends first, or after `timeout` (a hang).
    """
    codes = {cls.__dict__["acquire"].__code__ for cls in _lock_classes()
             if "acquire" in cls.__dict__ and hasattr(cls.__dict__["acquire"], "__code__")}
    deadline = time.monotonic() + timeout
    while True:
        frame = sys._current_frames().get(thread.ident or -1)
        while frame is not None:
            if frame.f_code in codes:
                return
            frame = frame.f_back
        if not thread.is_alive():
            raise AssertionError(f"{thread.name} ended without blocking on a lock")
        if time.monotonic() > deadline:
            raise AssertionError(f"{thread.name} did not block on a lock within {timeout} s")
        time.sleep(0.005)


def lease_record(lease: LeaseLock) -> dict[str, Any]:
    """The lease's current generation record in its store (owner, generation, expires)."""
    generation, record = lease._latest()
    assert record is not None, f"lease {lease.name!r} has no record"
    return {**msgspec.structs.asdict(record), "generation": generation}


class _Tripwire:
    """Stands in for `store.fs`: any use of it is I/O that should not have happened."""

    def __getattr__(self, name: str) -> Any:
        def io(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"store.fs.{name}{args} was called before the key was checked")

        return io


class StoreContractTests(StoreOperationTests):
    """The behaviour every `Store` promises. Subclasses supply a ``store`` fixture.

    The operations domain code needs beyond the primitives (`StoreOperationTests`,
    ``testing_ops.py``) are part of it.
    """

    lease_duration = 0.6
    """Seconds; short so lease tests are quick, long enough for a slow S3 peer to beat."""

    @pytest.fixture
    def store(self) -> Store:  # pragma: no cover - always overridden
        raise NotImplementedError("subclasses of StoreContractTests supply a `store` fixture")

    # ------------------------------------------------------------ helpers
    def lease(self, store: Store, name: str, **kw: Any) -> LeaseLock:
        """A lease on `store` (through `store.lock` where the store chooses leases)."""
        kw.setdefault("lease_duration", self.lease_duration)
        if store.capabilities.kernel_locks:
            return LeaseLock(store, join(".leases", name), **kw)
        lock = store.lock(name, **kw)
        assert isinstance(lock, LeaseLock)
        return lock

    @staticmethod
    def freeze(lease: LeaseLock) -> None:
        """Stop a holder's heartbeat, as if its process hung: its lease will expire."""
        lease._stop.set()
        if lease._heartbeat is not None:
            lease._heartbeat.join(timeout=HANG)
            assert not lease._heartbeat.is_alive()

    # ----------------------------------------------------------- read/write
    def test_read_missing_is_none(self, store: Store) -> None:
        assert store.read("missing") is None
        assert store.read("no/such/deep/key") is None
        assert store.info("missing") is None
        assert store.exists("missing") is False

    @pytest.mark.parametrize(
        "data",
        [b"", b"hello", BINARY, os.urandom(300_000)],
        ids=["empty", "small", "binary", "300k"],
    )
    def test_write_read_roundtrip(self, store: Store, data: bytes) -> None:
        store.write("dir/sub/key.bin", data)
        assert store.read("dir/sub/key.bin") == data
        assert store.exists("dir/sub/key.bin")

    def test_overwrite_replaces_whole_value(self, store: Store) -> None:
        store.write("k", b"a much longer first value")
        store.write("k", b"short")
        assert store.read("k") == b"short"
        store.write("k", b"")
        assert store.read("k") == b""

    def test_a_directory_is_not_a_file(self, store: Store) -> None:
        store.write("d/child", b"x")
        assert store.read("d") is None
        assert store.info("d") is None
        assert store.delete("d") is False
        assert store.read("d/child") == b"x"

    # ---------------------------------------------------------- create
    @pytest.mark.parametrize("first", [b"", b"first", BINARY], ids=["empty", "small", "binary"])
    def test_create_if_absent_first_writer_wins(self, store: Store, first: bytes) -> None:
        assert store.create("c/key", first) is True
        assert store.create("c/key", b"second") is False
        assert store.create("c/key", b"") is False
        assert store.read("c/key") == first

    def test_create_does_not_clobber_a_write(self, store: Store) -> None:
        store.write("k", b"written")
        assert store.create("k", b"created") is False
        assert store.read("k") == b"written"

    def test_create_after_delete(self, store: Store) -> None:
        assert store.create("k", b"1") is True
        assert store.delete("k") is True
        assert store.create("k", b"2") is True
        assert store.read("k") == b"2"

    def test_create_race_between_threads_has_one_winner(self, store: Store) -> None:
        barrier = threading.Barrier(8)
        wins: list[int] = []

        def racer(i: int) -> None:
            barrier.wait()
            if store.create("raced", b"%d" % i):
                wins.append(i)

        threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1
        assert store.read("raced") == b"%d" % wins[0]

    # ------------------------------------------------------------ listing
    def _tree(self, store: Store) -> None:
        for key in ("b", "a/2", "a/1", "a/sub/x", "ab/c"):
            store.write(key, key.encode())

    def test_list_is_recursive_sorted_and_relative(self, store: Store) -> None:
        self._tree(store)
        assert store.list("") == ["a/1", "a/2", "a/sub/x", "ab/c", "b"]
        assert store.list() == store.list("")
        assert store.list("a") == ["a/1", "a/2", "a/sub/x"]  # not "ab/c"
        assert store.list("a/") == ["a/1", "a/2", "a/sub/x"]
        assert store.list("a/sub") == ["a/sub/x"]

    def test_list_of_missing_or_file_prefix_is_empty(self, store: Store) -> None:
        self._tree(store)
        assert store.list("missing") == []
        assert store.list("b") == []
        assert store.list("a/1") == []

    def test_list_dir(self, store: Store) -> None:
        self._tree(store)
        assert store.list_dir("") == ["a", "ab", "b"]
        assert store.list_dir("a") == ["1", "2", "sub"]
        assert store.list_dir("a/") == ["1", "2", "sub"]
        assert store.list_dir("missing") == []

    def test_empty_store_lists_nothing(self, store: Store) -> None:
        assert store.list("") == []
        assert store.list_dir("") == []

    # ------------------------------------------------------------ delete
    def test_delete_returns_whether_it_existed(self, store: Store) -> None:
        store.write("k", b"v")
        assert store.delete("k") is True
        assert store.read("k") is None
        assert store.delete("k") is False
        assert store.delete("never/was") is False

    def test_delete_under_a_file_is_a_miss(self, store: Store) -> None:
        store.write("f", b"v")
        assert store.delete("f/child") is False
        assert store.read("f/child") is None
        assert store.read("f") == b"v"

    def test_delete_tree(self, store: Store) -> None:
        self._tree(store)
        assert store.delete_tree("a") == 3
        assert store.list("") == ["ab/c", "b"]
        assert store.delete_tree("a") == 0
        assert store.delete_tree("missing") == 0

    # -------------------------------------------------------------- info
    def test_info_size_and_mtime(self, store: Store) -> None:
        before = time.time()
        store.write("dir/k", b"12345")
        after = time.time()
        info = store.info("dir/k")
        assert info is not None
        assert info.key == "dir/k"
        assert info.size == 5
        # S3 reports whole seconds; allow for that and a little clock skew.
        assert before - 2 <= info.mtime <= after + 2
        assert [i.key for i in store.iter_files("dir")] == ["dir/k"]

    # ------------------------------------------------------- local files
    def test_put_file_get_file(self, store: Store, tmp_path: Any) -> None:
        src = tmp_path / "src.bin"
        src.write_bytes(BINARY)
        store.put_file("files/a.bin", str(src))
        assert store.read("files/a.bin") == BINARY
        dst = tmp_path / "out" / "dst.bin"
        dst.parent.mkdir()
        assert store.get_file("files/a.bin", str(dst)) is True
        assert dst.read_bytes() == BINARY
        assert store.get_file("files/missing", str(tmp_path / "out" / "missing")) is False
        assert sorted(p.name for p in dst.parent.iterdir()) == ["dst.bin"]  # no .partial left

    def test_get_file_replaces_an_existing_file(self, store: Store, tmp_path: Any) -> None:
        store.write("k", b"new")
        dst = tmp_path / "dst"
        dst.write_bytes(b"old and longer")
        assert store.get_file("k", str(dst)) is True
        assert dst.read_bytes() == b"new"

    def test_open_read(self, store: Store) -> None:
        store.write("k", BINARY)
        with store.open_read("k") as f:
            assert f.read(10) == BINARY[:10]
            assert f.read() == BINARY[10:]
        with pytest.raises(FileNotFoundError):
            store.open_read("missing")

    # ------------------------------------------------------- publication
    def test_stage_commit_publishes(self, store: Store) -> None:
        staging = store.stage("entries/e1")
        staging.write("a", b"A")
        staging.write("d/b", BINARY)
        assert store.published("entries/e1") is None
        assert store.published_children("entries") == []
        assert staging.commit() is True
        assert published_files(store, "entries/e1") == {"a": b"A", "d/b": BINARY}
        assert store.published_children("entries") == ["e1"]

    def test_staged_files_are_invisible_until_commit(self, store: Store) -> None:
        with store.stage("entries/e1") as staging:
            staging.write("a", b"A")
            assert store.published("entries/e1") is None
            assert published_files(store, "entries/e1") == {}
            assert store.read("entries/e1/a") is None
            assert staging.commit() is True

    def test_second_commit_loses_and_keeps_first_content(self, store: Store) -> None:
        with store.stage("entries/e1") as first:
            first.write("a", b"first")
            first.write("only-first", b"1")
            assert first.commit() is True
        with store.stage("entries/e1") as second:
            second.write("a", b"second")
            second.write("only-second", b"2")
            assert second.commit() is False
        assert published_files(store, "entries/e1") == {"a": b"first", "only-first": b"1"}
        # The loser's files are gone, not just hidden.
        assert b"second" not in all_files(store).values()

    def test_interleaved_stagings_first_commit_wins(self, store: Store) -> None:
        s1, s2 = store.stage("e"), store.stage("e")
        s1.write("x", b"one")
        s2.write("x", b"two")
        assert s2.commit() is True
        assert s1.commit() is False
        assert published_files(store, "e") == {"x": b"two"}

    def test_empty_publication_is_first_writer_wins(self, store: Store) -> None:
        with store.stage("e") as empty:
            assert empty.commit() is True
        assert store.published("e") is not None
        with store.stage("e") as later:
            later.write("x", b"late")
            assert later.commit() is False
        assert "x" not in published_files(store, "e")
        assert store.published_children("") == ["e"]

    def test_abort_leaves_nothing_visible(self, store: Store) -> None:
        staging = store.stage("entries/e1")
        staging.write("a", b"A")
        staging.abort()
        with store.stage("entries/e2") as staging2:
            staging2.write("b", b"B")
        assert store.published("entries/e1") is None
        assert store.published("entries/e2") is None
        assert store.published_children("entries") == []
        assert store.list("") == []

    def test_exception_in_staging_context_aborts(self, store: Store) -> None:
        with pytest.raises(RuntimeError), store.stage("e") as staging:
            staging.write("a", b"A")
            raise RuntimeError("boom")
        assert store.published("e") is None
        assert store.list("") == []

    def test_staging_is_single_use(self, store: Store) -> None:
        staging = store.stage("e")
        assert staging.commit() is True
        with pytest.raises(StoreError):
            staging.commit()

    def test_stage_put_file(self, store: Store, tmp_path: Any) -> None:
        src = tmp_path / "f"
        src.write_bytes(BINARY)
        with store.stage("e") as staging:
            staging.put_file("sub/f", str(src))
            assert staging.commit() is True
        assert published_files(store, "e") == {"sub/f": BINARY}

    def test_unpublish(self, store: Store) -> None:
        with store.stage("entries/e1") as staging:
            staging.write("a", b"old")
            assert staging.commit() is True
        assert store.unpublish("entries/e1") is True
        assert store.published("entries/e1") is None
        assert store.published_children("entries") == []
        assert store.list("") == []
        assert store.unpublish("entries/e1") is False
        with store.stage("entries/e1") as again:
            again.write("a", b"new")
            assert again.commit() is True
        assert published_files(store, "entries/e1") == {"a": b"new"}

    def test_published_children_lists_only_published(self, store: Store) -> None:
        for name in ("x", "y"):
            with store.stage(join("p", name)) as staging:
                staging.write("f", name.encode())
                assert staging.commit() is True
        with store.stage("p/z") as pending:
            pending.write("f", b"z")
            assert store.published_children("p") == ["x", "y"]
        assert store.published_children("missing") == []

    # --------------------------------------------------------------- sub
    def test_sub_view(self, store: Store) -> None:
        view = store.sub("p/q")
        view.write("k", b"v")
        store.write("p/qq/z", b"sibling")
        assert store.read("p/q/k") == b"v"
        assert view.list("") == ["k"]
        assert view.read("qq/z") is None  # the sibling "p/qq" is outside the view
        assert view.capabilities == store.capabilities
        assert view.sub("r").list("") == []
        view.sub("r").write("deep", b"d")
        assert store.read("p/q/r/deep") == b"d"
        assert view.url.endswith("p/q")
        with pytest.raises(InvalidKey):
            store.sub("../up")
        with pytest.raises(InvalidKey):
            view.read("../qq/z")

    def test_sub_view_publishes_and_locks(self, store: Store) -> None:
        view = store.sub("tier")
        with view.stage("e") as staging:
            staging.write("f", b"F")
            assert staging.commit() is True
        assert published_files(view, "e") == {"f": b"F"}
        assert store.published_children("tier") == ["e"]
        with view.lock("n", timeout=5) as lock:
            assert lock.held

    # ------------------------------------------------------------- locks
    def test_lock_kind_follows_capabilities(self, store: Store) -> None:
        lock = store.lock("n")
        if store.capabilities.kernel_locks:
            assert isinstance(lock, KernelLock)
            assert lock.generation == 0
        else:
            assert isinstance(lock, LeaseLock)

    def test_lock_acquire_release(self, store: Store) -> None:
        first = store.lock("n", timeout=5)
        with first:
            assert first.held
            first.check()
        assert not first.held
        second = store.lock("n")
        second.acquire(timeout=0)
        assert second.held
        second.release()

    def test_lock_timeout(self, store: Store) -> None:
        holder = store.lock("n")
        holder.acquire(timeout=5)
        try:
            waiter = store.lock("n")
            start = time.monotonic()
            with pytest.raises(LockTimeout, match="'n'"):
                waiter.acquire(timeout=0.3)
            assert time.monotonic() - start >= 0.25  # it did wait (a busy machine: longer)
            assert not waiter.held
            with pytest.raises(LockTimeout), store.lock("n", timeout=0.1):
                pass  # pragma: no cover
        finally:
            holder.release()
        store.lock("n").acquire(timeout=0)  # free again after release

    def test_lock_release_wakes_a_waiter(self, store: Store) -> None:
        holder = store.lock("n")
        holder.acquire(timeout=5)
        first_try: list[str] = []
        tried = threading.Event()
        acquired: list[float] = []

        def wait() -> None:
            lock = store.lock("n")
            try:
                lock.acquire(timeout=0)
            except LockTimeout:
                first_try.append("refused")
            else:  # pragma: no cover - a failure, reported below
                first_try.append("granted")
                lock.release()
                return
            finally:
                tried.set()
            lock.acquire(timeout=HANG)  # blocks until the holder lets go
            acquired.append(time.monotonic())
            lock.release()

        thread = threading.Thread(target=wait)
        thread.start()
        try:
            assert tried.wait(HANG)
            assert first_try == ["refused"]  # really held: the waiter has to wait
            wait_until_blocked(thread)  # ...and now it does, inside acquire
            assert acquired == []
            released = time.monotonic()
        finally:
            holder.release()
        thread.join(timeout=HANG)
        assert not thread.is_alive()
        assert len(acquired) == 1 and acquired[0] >= released

    def test_locks_with_different_names_are_independent(self, store: Store) -> None:
        with store.lock("a", timeout=5), store.lock("b", timeout=5) as b:
            assert b.held

    def test_lock_kind_follows_the_capabilities_and_lives_in_the_store(
        self, store: Store
    ) -> None:
        lock = store.lock("dir/n", timeout=5)
        if store.capabilities.kernel_locks:
            assert isinstance(lock, KernelLock)
            assert lock.path == store.local_path(join(".locks", "dir/n.lock"))
            with lock:
                assert os.path.exists(lock.path)
        else:
            assert isinstance(lock, LeaseLock)
            with lock:
                # the lease is a generation record inside the store itself
                assert store.list_dir(join(".locks", "dir/n")) == [f"{lock.generation:012d}"]

    # ------------------------------------------------------------- leases
    def test_lease_generation_increases(self, store: Store) -> None:
        generations = []
        for _ in range(3):
            lease = self.lease(store, "gen")
            lease.acquire(timeout=5)
            lease.check()
            generations.append(lease.generation)
            lease.release()
        assert generations[0] >= 1
        assert generations == sorted(set(generations))

    def test_lease_heartbeat_keeps_it(self, store: Store) -> None:
        # At least 2 s, so a heartbeat delayed by a loaded machine does not look like a
        # crash. Taking over is refused until after the lease's first expiry, read from its
        # own record on the store's clock: only a heartbeat can have kept it.
        duration = max(self.lease_duration, 2.0)
        holder = self.lease(store, "hb", lease_duration=duration)
        holder.acquire(timeout=5)
        try:
            first = lease_record(holder)
            other = self.lease(store, "hb", lease_duration=duration)
            while True:
                now = time.time()
                with pytest.raises(LockTimeout):
                    other.acquire(timeout=0)
                if now > first["expires"]:
                    break
                time.sleep(duration / 20)
            renewed = lease_record(holder)
            assert renewed["generation"] == first["generation"] == holder.generation
            assert renewed["expires"] > first["expires"]
            holder.check()
            assert holder.held
        finally:
            holder.release()

    def test_expired_lease_is_taken_over(self, store: Store) -> None:
        first = self.lease(store, "exp")
        first.acquire(timeout=5)
        self.freeze(first)  # the holder hangs: no more heartbeats
        last = lease_record(first)  # its final renewal
        second = self.lease(store, "exp")
        second.acquire(timeout=HANG)
        try:
            # Taken over once the frozen lease ran out on the store's clock, not before.
            assert time.time() >= last["expires"]
            assert second.generation == first.generation + 1
            with pytest.raises(LeaseLost):
                first.check()
            assert not first.held
            second.check()
        finally:
            second.release()
            first.release()
        # The stale holder's release must not free the new holder's lease; after both
        # released, a third taker gets the next generation at once.
        third = self.lease(store, "exp")
        third.acquire(timeout=0)
        assert third.generation == second.generation + 1
        third.release()

    def test_stale_release_does_not_free_a_new_holder(self, store: Store) -> None:
        first = self.lease(store, "stale")
        first.acquire(timeout=5)
        self.freeze(first)
        # The new holder's own lease outlasts the test: only the stale release could free it.
        second = self.lease(store, "stale", lease_duration=HANG)
        second.acquire(timeout=HANG)
        try:
            first.release()
            with pytest.raises(LockTimeout):
                self.lease(store, "stale").acquire(timeout=0)
            second.check()
        finally:
            second.release()

    def test_lease_acquire_timeout(self, store: Store) -> None:
        holder = self.lease(store, "to")
        holder.acquire(timeout=5)
        try:
            start = time.monotonic()
            with pytest.raises(LockTimeout):
                self.lease(store, "to").acquire(timeout=0.2)
            assert time.monotonic() - start >= 0.2  # it did wait (a busy machine: longer)
        finally:
            holder.release()

    # ---------------------------------------------------------- event logs
    def test_eventlog_append_read_fold(self, store: Store) -> None:
        log = store.log("events/compile", writer="w1")
        records = [ContractEvent(key=f"k{i}", rank=i, shape=(i, 2)) for i in range(3)]
        for record in records:
            log.append(record)
        other = store.log("events/compile", writer="w2")
        other.append(OtherEvent(note="hi"))
        decoded = log.read([ContractEvent, OtherEvent])
        assert decoded.records == [*records, OtherEvent(note="hi")]
        assert decoded.skipped == 0
        assert len(log.segments()) == 2

        def count(state: dict[str, int], record: Record) -> dict[str, int]:
            name = type(record).__name__
            return {**state, name: state.get(name, 0) + 1}

        empty: dict[str, int] = {}
        state, skipped = log.fold([ContractEvent, OtherEvent], count, empty)
        assert state == {"ContractEvent": 3, "OtherEvent": 1}
        assert skipped == 0
        log.close()
        other.close()

    def test_eventlog_append_many_and_reopen(self, store: Store) -> None:
        log = store.log("s", writer="w")
        log.append_many([ContractEvent(key="a", rank=0), ContractEvent(key="b", rank=1)])
        log.close()
        again = store.log("s", writer="w")
        again.append(ContractEvent(key="c", rank=2))
        again.close()
        keys = [r.key for r in again.read([ContractEvent]).records]
        assert keys == ["a", "b", "c"]

    def test_eventlog_truncate_first(self, store: Store) -> None:
        log = store.log("s", writer="w")
        log.append(ContractEvent(key="old", rank=0))
        log.close()
        fresh = store.log("s", writer="w", truncate_first=True)
        fresh.append(ContractEvent(key="new", rank=0))
        fresh.close()
        assert [r.key for r in fresh.read([ContractEvent]).records] == ["new"]

    def test_eventlog_default_writer_is_the_process(self, store: Store) -> None:
        log = store.log("s")
        log.append(ContractEvent(key="a", rank=0))
        log.close()
        assert log.segments() == [f"s/{os.getpid()}.jsonl"]

    def test_eventlog_skips_and_counts_undecodable_lines(self, store: Store) -> None:
        good = ContractEvent(key="ok", rank=1, shape=(2,))
        log = store.log("s", writer="good")
        log.append(good)
        log.close()
        store.write(
            "s/foreign.jsonl",
            b'{"type":"contract-event","v":1,"key":"torn","ra'  # torn JSON
            b"\n\xff\xfe\x00garbage\n"  # not UTF-8, not JSON
            b'{"type":"contract-event","v":1,"key":"k","rank":"not-an-int"}\n'  # wrong field
            b'{"type":"from-the-future","v":9}\n'  # unknown tag
            b"[1, 2, 3]\n"  # not an object
            b"\n"  # blank lines are not records and not errors
            b'{"type":"contract-event","v":1,"key":"ok2","rank":2}\n'
            b'{"type":"contract-event","v":1,"key":"tail","rank":3',  # torn tail, no newline
        )
        store.write("s/not-a-segment.txt", b"ignored entirely\n")
        decoded = log.read([ContractEvent])
        assert decoded.records == [ContractEvent(key="ok2", rank=2), good]
        assert decoded.skipped == 6
        assert len(decoded.errors) == 6
        _, skipped = log.fold([ContractEvent], lambda n, _r: n + 1, 0)
        assert skipped == 6
        codec = RecordCodec([ContractEvent])
        assert log.read(codec).skipped == 6

    def test_eventlog_descriptor_appends_exactly_like_append(self, store: Store) -> None:
        log = store.log("s", writer="w")
        assert log.descriptor() == -1  # nothing opened yet in this process
        log.append(ContractEvent(key="a", rank=0))
        fd = log.descriptor()
        # One os.write per record where the store appends natively (local disk), else none.
        assert (fd >= 0) == (store.capabilities.native_append and store.capabilities.local_paths)
        if fd >= 0:
            os.write(fd, encode_line(ContractEvent(key="b", rank=1)))
        else:
            log.append(ContractEvent(key="b", rank=1))
        log.close()
        assert log.descriptor() == -1
        assert [r.key for r in log.read([ContractEvent]).records] == ["a", "b"]
        assert [key for key, _ in log.segment_data()] == ["s/w.jsonl"]

    def test_eventlog_delete(self, store: Store) -> None:
        log = store.log("s", writer="w")
        log.append(ContractEvent(key="a", rank=0))
        assert log.delete() == 1
        assert log.read([ContractEvent]).records == []

    # -------------------------------------------------------- key checks
    @staticmethod
    def _key_operations(store: Store, tmp: str) -> dict[str, Callable[[str], object]]:
        return {
            "read": store.read,
            "write": lambda k: store.write(k, b"x"),
            "create": lambda k: store.create(k, b"x"),
            "delete": store.delete,
            "delete_tree": store.delete_tree,
            "info": store.info,
            "exists": store.exists,
            "open_read": store.open_read,
            "put_file": lambda k: store.put_file(k, tmp),
            "get_file": lambda k: store.get_file(k, tmp + ".out"),
            "stage": store.stage,
            "published": store.published,
            "unpublish": store.unpublish,
            "lock": store.lock,
            "log": store.log,
            "sub": store.sub,
            "write_record": lambda k: store.write_record(k, OtherEvent(note="x")),
            "stage.write": lambda k: store.stage("ok").write(k, b"x"),
            "log writer": lambda k: store.log("ok", writer=k),
        }

    def test_invalid_keys_are_refused_before_io(
        self, store: Store, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        src = tmp_path / "src"
        src.write_bytes(b"x")
        operations = self._key_operations(store, str(src))
        before = sorted(str(p) for p in tmp_path.rglob("*"))
        monkeypatch.setattr(store, "fs", _Tripwire())
        accepted: dict[str, list[str]] = {}
        for bad in BAD_KEYS:
            for name, operation in operations.items():
                try:
                    operation(bad)
                except InvalidKey:
                    continue
                accepted.setdefault(repr(bad), []).append(name)
        assert accepted == {}, f"bad keys accepted (key: operations): {accepted}"
        monkeypatch.undo()
        assert store.list("") == []
        assert sorted(str(p) for p in tmp_path.rglob("*")) == before

    def test_invalid_prefixes_are_refused(self, store: Store) -> None:
        operations: dict[str, Callable[[str], object]] = {
            "list": store.list,
            "list_dir": store.list_dir,
            "published_children": store.published_children,
            "iter_files": lambda p: list(store.iter_files(p)),
            "copy_tree from": lambda p: copy_tree(store, p, open_store("memory://")),
            "copy_tree to": lambda p: copy_tree(open_store("memory://"), "", store, p),
        }
        accepted: dict[str, list[str]] = {}
        for bad in BAD_PREFIXES:
            for name, operation in operations.items():
                try:
                    operation(bad)
                except InvalidKey:
                    continue
                accepted.setdefault(repr(bad), []).append(name)
        assert accepted == {}, f"bad prefixes accepted (prefix: operations): {accepted}"

    # -------------------------------------------------------------- copy
    @pytest.fixture(params=["local", "memory"])
    def other_store(self, request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store]:
        if request.param == "local":
            yield open_store(tmp_path / "other")
        else:
            yield open_store("memory://")

    def test_copy_tree_both_ways(self, store: Store, other_store: Store) -> None:
        files = {"a": b"", "b/c": b"c" * 1000, "b/d/e.bin": BINARY * 50}
        for rel, data in files.items():
            store.write(join("src", rel), data)
        store.write("srcx/not-me", b"sibling")
        total = sum(len(d) for d in files.values())
        calls: list[tuple[int, int]] = []
        lock = threading.Lock()

        def progress(done: int, all_bytes: int) -> None:
            with lock:
                calls.append((done, all_bytes))

        result = copy_tree(store, "src", other_store, "dst", workers=4, progress=progress)
        assert (result.files, result.bytes) == (3, total)
        assert calls[-1] == (total, total)
        assert [c[0] for c in calls] == sorted(c[0] for c in calls)
        assert {k: other_store.read(k) for k in other_store.list("")} == {
            join("dst", rel): data for rel, data in files.items()
        }
        back = copy_tree(other_store, "dst", store, "back/")
        assert (back.files, back.bytes) == (3, total)
        for rel, data in files.items():
            assert store.read(join("back", rel)) == data

    def test_copy_tree_into_staging_then_publish(self, store: Store, other_store: Store) -> None:
        other_store.write("entry/x", b"X")
        other_store.write("entry/y/z", BINARY)
        with store.stage("pub") as staging:
            result = copy_tree(other_store, "entry", staging)
            assert result.files == 2
            assert store.published("pub") is None
            assert staging.commit() is True
        assert published_files(store, "pub") == {"x": b"X", "y/z": BINARY}

    def test_copy_tree_of_nothing(self, store: Store, other_store: Store) -> None:
        calls: list[tuple[int, int]] = []
        result = copy_tree(
            store, "missing", other_store, "", progress=lambda d, t: calls.append((d, t))
        )
        assert (result.files, result.bytes) == (0, 0)
        assert calls == []
        assert other_store.list("") == []

