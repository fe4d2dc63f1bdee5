"""`StoreContractTests`: the whole store contract as the one class a backend subclasses.

Each concern is a mixin of its own module; this class puts them together with the
operations domain code needs (`StoreOperationTests`, ``testing_ops.py``), declares the
fixtures they share, and holds the tests that cross concerns (a sub view is the whole
store seen through a prefix).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ..errors import InvalidKey
from ..router import open_store
from ..store import Store
from ..testing_ops import StoreOperationTests, published_files
from .contract_copies import CopyContractTests
from .contract_eventlogs import EventLogContractTests
from .contract_files import FileContractTests
from .contract_keys import KeyContractTests
from .contract_locks import LockContractTests
from .contract_publication import PublicationContractTests
from .contract_untrusted import UntrustedReadContractTests
from .contract_withdrawal import WithdrawalContractTests


class StoreContractTests(
    FileContractTests,
    PublicationContractTests,
    WithdrawalContractTests,
    LockContractTests,
    EventLogContractTests,
    KeyContractTests,
    CopyContractTests,
    UntrustedReadContractTests,
    StoreOperationTests,
):
    """The behaviour every `Store` promises. Subclasses supply a ``store`` fixture.

    The operations domain code needs beyond the primitives (`StoreOperationTests`,
    ``testing_ops.py``) are part of it.
    """

    @pytest.fixture
    def store(self) -> Store:  # pragma: no cover - always overridden
        raise NotImplementedError("subclasses of StoreContractTests supply a `store` fixture")

    @pytest.fixture(params=["local", "memory"])
    def other_store(self, request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store]:
        """The far side of the copy tests (here and in `StoreOperationTests`): local disk
        and memory, so both the kernel-copy and the streaming path are crossed."""
        if request.param == "local":
            yield open_store(tmp_path / "other")
        else:
            yield open_store("memory://")

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
