"""The store contract for single files: read, write, create-if-absent, listing, delete,
info, and the doors to local files.

These are the primitives every other part of the contract (publication, leases, logs)
is built on, so a backend that fails here fails for a reason this module names.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from ..store import Store
from .samples import BINARY


class FileContractTests:
    """Single-file behaviour of a `Store`. Subclasses supply a ``store`` fixture."""

    # ----------------------------------------------------------------- rename
    def test_rename_moves_a_file_and_replaces_the_destination(self, store: Store) -> None:
        store.write("a/log.txt", b"first launch")
        store.write("b/kept.txt", b"old")
        assert store.rename("a/log.txt", "b/kept.txt") is True
        assert store.read("b/kept.txt") == b"first launch"
        assert store.read("a/log.txt") is None and not store.exists("a/log.txt")
        assert store.rename("a/log.txt", "b/again.txt") is False  # nothing there any more
        assert store.read("b/again.txt") is None

    def test_rename_moves_a_directory_with_everything_under_it(self, store: Store) -> None:
        files = {"w/trace.json": b"{}", "w/deep/ntff/0.ntff": BINARY, "w/empty": b""}
        for key, data in files.items():
            store.write(key, data)
        store.write("other/untouched", b"x")
        assert store.rename("w", "set-aside/w1") is True
        assert sorted(store.list("set-aside")) == sorted(f"set-aside/w1/{k[2:]}" for k in files)
        for key, data in files.items():
            assert store.read(f"set-aside/w1/{key[2:]}") == data
        assert store.list("w") == []
        assert store.read("other/untouched") == b"x"

    def test_rename_of_nothing_is_false_and_creates_nothing(self, store: Store) -> None:
        assert store.rename("missing", "elsewhere") is False
        assert store.rename("no/such/dir", "x/y") is False
        assert store.list("") == []

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
