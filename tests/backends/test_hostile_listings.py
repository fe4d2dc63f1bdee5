"""Folders of a shared tier that a writer without a key may fill with millions of names are
never listed whole (issue 39, docs/trust.md): `list_dir(max_names=)` stops one name past
its bound on every store, and the listing of a published entry's version folder (a commit
record store: S3, memory) asks for one name at most. The lease folder's bound is in
test_lease_forgery.py."""

from __future__ import annotations

import os
from typing import Any

import pytest

from vllm_neuron.backends import open_store
from vllm_neuron.backends.errors import ListingTooLarge


@pytest.fixture(params=["memory", "folder", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    if request.param == "memory":
        return open_store("memory://")
    if request.param == "folder":
        return open_store(str(tmp_path / "store"))
    url = request.getfixturevalue("s3_store_url")
    return open_store(url, endpoint_url=request.getfixturevalue("s3_server"))


def test_a_listing_stops_past_its_bound(store: Any) -> None:
    for i in range(4):
        store.write(f"d/f{i}", b"x")
    store.write("d/sub/g", b"x")  # a folder counts as a name
    assert store.list_dir("d", max_names=5) == ["f0", "f1", "f2", "f3", "sub"]
    with pytest.raises(ListingTooLarge, match="more than the 4 names"):
        store.list_dir("d", max_names=4)
    assert store.list_dir("missing", max_names=0) == []
    assert store.list_dir("d") == ["f0", "f1", "f2", "f3", "sub"]  # unbounded as before


def test_temp_looking_names_count_against_the_bound(tmp_path: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On a folder store a writer can name every file like an in-flight temp file (never
    listed as a key): each one read still counts, so the scan stops one past the bound
    instead of reading all 500 and answering "empty"."""
    store = open_store(str(tmp_path / "store"))
    folder = tmp_path / "store" / "d"
    folder.mkdir()
    for i in range(500):
        (folder / f"x{i}.0123456789abcdef-1.partial").write_bytes(b"")
    scanned = [0]
    real_scandir = os.scandir

    class Counting:
        def __init__(self, path: str) -> None:
            self.inner = real_scandir(path)

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: Any) -> None:
            self.inner.close()

        def __iter__(self) -> Any:
            for entry in self.inner:
                scanned[0] += 1
                yield entry

    monkeypatch.setattr(os, "scandir", Counting)
    with pytest.raises(ListingTooLarge, match="more than the 100 names"):
        store.list_dir("d", max_names=100)
    assert scanned[0] <= 101
    assert store.list_dir("d", max_names=1000) == []  # within the bound: none is a key


def test_a_version_folder_is_never_listed_whole(store: Any, monkeypatch: pytest.MonkeyPatch
                                                ) -> None:  # fmt: skip
    """`publication` (every fetch asks it) tells an empty version folder from a full one by
    one name: a version folder a hostile writer filled is not listed."""
    with store.stage("e") as staging:
        for i in range(3):
            staging.write(f"f{i}", b"x")
        staging.commit()
    real = store.list_dir
    asked: list[int | None] = []

    def spy(prefix: str = "", *, max_names: int | None = None) -> list[str]:
        asked.append(max_names)
        return real(prefix, max_names=max_names)

    monkeypatch.setattr(store, "list_dir", spy)
    assert store.publication("e").state == "published"
    assert store.published("e") is not None
    assert None not in asked and all(n <= 1 for n in asked if n is not None)


def test_gc_never_lists_an_over_full_lease_folder_whole(tmp_path: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease gc would remove (expired long ago) whose folder was then filled with names:
    its removal re-lists it bounded (`LEASE_MAX_NAMES`) and leaves it ("changed")."""
    import time

    from vllm_neuron.backends import debris_removal, open_store
    from vllm_neuron.backends.records import LeaseRecord, encode

    store = open_store(str(tmp_path / "store"), lock="lease")
    store.write(".locks/k/000000000001", encode(LeaseRecord(
        owner="gone:1:x", generation=1, expires=1.0, renewal=1, duration=1.0)))
    later = time.time() + 86400
    (lease,) = [d for d in store.survey(older_than=0.0, lease_grace=0.0, now=later).debris
                if d.kind == "lease"]
    monkeypatch.setattr(debris_removal, "LEASE_MAX_NAMES", 3)
    for i in range(3):
        store.write(f".locks/k/junk-{i}", b"junk")
    assert store.remove_debris(lease) == "changed"
    assert store.read(".locks/k/000000000001") is not None
