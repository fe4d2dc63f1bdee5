"""The store contract for `copy_tree`: both ways between this store and another, into a
staging, and of nothing.

The other side is local disk and memory (the ``other_store`` fixture of
`StoreContractTests`), so a backend is copied against both a path-backed and an in-memory
store.
"""

from __future__ import annotations

import threading

from ..keys import join
from ..store import Store
from ..testing_ops import published_files
from ..transfer import copy_tree
from .samples import BINARY


class CopyContractTests:
    """`copy_tree` to and from this store. Subclasses supply ``store`` and ``other_store``."""

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
