"""The store contract for publication: staged files appear together, at the commit, once.

Why its own module: publication is the protocol a compile-cache entry or a bundle relies on
to never be seen half-written, and each backend implements it differently (rename or commit
record, per its `Capabilities`); these tests hold every one of them to the same promise.
"""

from __future__ import annotations

from typing import Any

import pytest

from ..errors import StoreError
from ..keys import join
from ..store import Store
from ..testing_ops import published_files
from .samples import BINARY, all_files


class PublicationContractTests:
    """Stage, commit, abort and unpublish. Subclasses supply a ``store`` fixture."""

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
