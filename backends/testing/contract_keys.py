"""The store contract for keys: every key- or prefix-taking operation refuses a bad one.

A key that escapes the store's root or aliases another key is refused with `InvalidKey`
before any I/O: the store's filesystem is replaced by a tripwire while bad keys are tried.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ..errors import InvalidKey
from ..router import open_store
from ..store import Store
from ..transfer import copy_tree
from .samples import BAD_KEYS, BAD_PREFIXES, OtherEvent


class _Tripwire:
    """Stands in for `store.fs`: any use of it is I/O that should not have happened."""

    def __getattr__(self, name: str) -> Any:
        def io(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"store.fs.{name}{args} was called before the key was checked")

        return io


class KeyContractTests:
    """Bad keys and prefixes refused by every operation. Subclasses supply ``store``."""

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
            "publication": store.publication,
            "unpublish version": lambda k: store.unpublish("ok", version=k),
            "lock": store.lock,
            "log": store.log,
            "sub": store.sub,
            "write_record": lambda k: store.write_record(k, OtherEvent(note="x")),
            "rename from": lambda k: store.rename(k, "ok"),
            "rename to": lambda k: store.rename("ok", k),
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
