"""The contract of the store operations domain code needs, run by every backend.

`StoreContractTests` (the ``testing`` package) inherits these, so each backend's test class runs
them too: the hot-path reads and checks, digests, streamed writes, the survey of debris, the two
doors to real directories, and the verified copy between this store and another one
(local disk or memory, so both the kernel-copy and the streaming path are crossed).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

import pytest
from blake3 import blake3

from .debris import Debris
from .digests import DIGEST_CHUNK, FileDigest, digest_bytes
from .errors import IntegrityError, InvalidKey
from .keys import join
from .store import Store
from .verified_copy import KERNEL_COPY_MIN, copy_verified

BIG = (hashlib.sha256(b"big").digest() * (KERNEL_COPY_MIN // 16))[: KERNEL_COPY_MIN + 4099]
"""A file large enough for the kernel copy (between two local stores)."""


def published_files(store: Store, final: str) -> dict[str, bytes]:
    """The published content of `final` as {relative key: bytes} ({} if unpublished)."""
    prefix = store.published(final)
    if prefix is None:
        return {}
    out = {}
    for key in store.list(prefix):
        data = store.read(key)
        assert data is not None, f"{key} listed under published {final!r} but unreadable"
        out[key[len(prefix) + 1 :]] = data
    return out


def publish(store: Store, final: str, files: dict[str, bytes]) -> str:
    """Publish `files` as `final`; returns the published prefix."""
    with store.stage(final) as staging:
        for rel, data in files.items():
            staging.write(rel, data)
        assert staging.commit() is True
    prefix = store.published(final)
    assert prefix is not None
    return prefix


def flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x01])


class StoreOperationTests:
    """Operations beyond the primitives. Subclasses supply ``store`` and ``other_store``."""

    # ------------------------------------------------------- hot-path reads
    def test_read_published(self, store: Store) -> None:
        assert store.read_published("e", "entry.json") is None
        prefix = publish(store, "e", {"entry.json": b"{}", "a": b"A"})
        assert store.read_published("e", "entry.json") == (prefix, b"{}")
        assert store.read_published("e", "missing") == (prefix, None)  # defective, not absent
        with pytest.raises(InvalidKey):
            store.read_published("e", "../escape")

    def test_check_sizes(self, store: Store) -> None:
        files = {"a": b"A", "sub/b": b"BB", "c": b""}
        prefix = publish(store, "e", files)
        expected = {rel: digest_bytes(data) for rel, data in files.items()}
        store.check_sizes(prefix, expected)
        store.check_sizes(prefix, {"a": expected["a"]})  # one file (no listing on S3)
        store.check_sizes(prefix, {})
        store.check_sizes("", {join(prefix, rel): d for rel, d in expected.items()})  # the root
        wrong = {**expected, "sub/b": FileDigest(size=3, sha256="0" * 64)}
        with pytest.raises(IntegrityError) as raised:
            store.check_sizes(prefix, wrong)
        assert raised.value.rel == "sub/b" and "has 2 bytes, expected 3" in str(raised.value)
        for missing in ({**expected, "gone": expected["a"]}, {"gone": expected["a"]}):
            with pytest.raises(IntegrityError, match="gone is missing"):
                store.check_sizes(prefix, missing)
        with pytest.raises(InvalidKey):
            store.check_sizes(prefix, {"../a": expected["a"]})

    def test_bad_keys_are_refused(self, store: Store) -> None:
        publish(store, "e", {"a": b"A"})
        expected = {"a": digest_bytes(b"A")}
        operations: dict[str, Callable[[Any], object]] = {
            "read_published final": lambda k: store.read_published(k, "a"),
            "read_published rel": lambda k: store.read_published("e", k),
            "check_sizes": lambda k: store.check_sizes(k, expected),
            "check_sizes rel": lambda k: store.check_sizes("e", {k: expected["a"]}),
            "digest": store.digest,
            "open_write": lambda k: store.open_write(k).__enter__(),
            "local_dir_of": store.local_dir_of,
        }
        for bad in ("../escape", "/abs", "a//b", "", "s3://b/k", "a\\b", ["a"], None, 3):
            for name, operation in operations.items():
                if name == "check_sizes rel" and not isinstance(bad, str):
                    continue  # a record's file names are strings
                if name == "check_sizes" and bad == "":
                    continue  # the root: files relative to the store's root
                with pytest.raises(InvalidKey):
                    operation(bad)
                    pytest.fail(f"{name} accepted {bad!r}")

    # -------------------------------------------------------------- digests
    def test_digest(self, store: Store) -> None:
        data = os.urandom(DIGEST_CHUNK + 12345)  # more than one chunk
        store.write("d/big", data)
        store.write("d/empty", b"")
        assert store.digest("d/big") == FileDigest(
            size=len(data), sha256=hashlib.sha256(data).hexdigest(),
            blake3=blake3(data).hexdigest())
        assert store.digest("d/empty") == digest_bytes(b"")
        assert store.digest("d/missing") is None
        assert store.digest_tree("d") == {"big": digest_bytes(data), "empty": digest_bytes(b"")}
        assert store.digest_tree("nothing") == {}

    # ------------------------------------------------------- streamed writes
    def test_open_write_appears_whole_on_exit(self, store: Store) -> None:
        store.write("w/k", b"old")
        with store.open_write("w/k") as f:
            f.write(b"new ")
            f.write(b"bytes")
            assert store.read("w/k") == b"old"  # nothing visible until the block exits
        assert store.read("w/k") == b"new bytes"
        with store.open_write("w/fresh/deep") as f:
            f.write(b"x")
        assert store.read("w/fresh/deep") == b"x"

    def test_open_write_that_raises_leaves_nothing(self, store: Store) -> None:
        store.write("w/k", b"old")
        with pytest.raises(RuntimeError), store.open_write("w/k") as f:
            f.write(b"half")
            raise RuntimeError("encoder failed")
        with pytest.raises(RuntimeError), store.open_write("w/new") as f:
            raise RuntimeError("encoder failed")
        assert store.read("w/k") == b"old" and store.read("w/new") is None
        assert store.list("w") == ["w/k"]  # no temp file left behind as a key

    def test_write_from(self, store: Store, tmp_path: Any) -> None:
        data = os.urandom(3 << 20)
        path = tmp_path / "src"
        path.write_bytes(data)
        with open(path, "rb") as reader:
            assert store.write_from("s/k", reader) == len(data)
        assert store.read("s/k") == data

    # ------------------------------------------------------------ durability
    def test_durable_is_declared(self, store: Store) -> None:
        caps = store.capabilities
        assert isinstance(caps.durable, bool)
        if caps.profile in ("nfs", "lustre", "s3"):
            assert caps.durable
        if caps.profile in ("local", "memory"):
            assert not caps.durable

    # -------------------------------------------------- doors to directories
    def test_local_dir_of_follows_capabilities(self, store: Store) -> None:
        prefix = publish(store, "e", {"a": b"A"})
        directory = store.local_dir_of(prefix)
        if store.capabilities.local_paths:
            assert directory is not None
            with open(os.path.join(directory, "a"), "rb") as f:
                assert f.read() == b"A"
        else:
            assert directory is None

    def test_local_output_lands_under_the_prefix(self, store: Store) -> None:
        with store.local_output("out/call0") as directory:
            with open(os.path.join(directory, "t0.npy"), "wb") as f:
                f.write(b"T0")
            os.makedirs(os.path.join(directory, "sub"))
            with open(os.path.join(directory, "sub", "t1.npy"), "wb") as f:
                f.write(b"T1")
        assert store.read("out/call0/t0.npy") == b"T0"
        assert store.read("out/call0/sub/t1.npy") == b"T1"
        if not store.capabilities.local_paths:
            assert not os.path.exists(directory)  # the scratch directory is gone

    def test_staging_output_dir_follows_capabilities(self, store: Store) -> None:
        """A toolchain's output directory: the staging directory itself where keys are
        local files, else a scratch directory moved in by `digests()` (or the commit)."""
        with store.stage("e") as staging:
            staging.write("a", b"A")
            out = staging.output_dir()
            with open(os.path.join(out, "b"), "wb") as f:
                f.write(b"BB")
            os.makedirs(os.path.join(out, "sub"))
            with open(os.path.join(out, "sub", "c"), "wb") as f:
                f.write(b"C")
            if store.capabilities.local_paths:
                assert os.path.isfile(os.path.join(out, "a"))  # the staging directory
            digests = staging.digests()
            assert {rel: d.size for rel, d in digests.items()} == {"a": 1, "b": 2, "sub/c": 1}
            assert not store.capabilities.local_paths or os.path.isdir(out)
            assert staging.commit() is True
        assert published_files(store, "e") == {"a": b"A", "b": b"BB", "sub/c": b"C"}
        if not store.capabilities.local_paths:
            assert not os.path.exists(out)  # the scratch directory is gone

    def test_staging_output_dir_is_moved_in_by_the_commit(self, store: Store) -> None:
        with store.stage("e") as staging:
            with open(os.path.join(staging.output_dir(), "f"), "wb") as f:
                f.write(b"F")
            assert staging.commit() is True
        assert published_files(store, "e") == {"f": b"F"}

    def test_an_aborted_staging_leaves_no_output_dir(self, store: Store) -> None:
        with store.stage("e") as staging:
            out = staging.output_dir()
            with open(os.path.join(out, "f"), "wb") as f:
                f.write(b"F")
        assert not os.path.exists(out)
        assert store.published("e") is None

    # ------------------------------------------------------------ debris
    def test_survey_lists_what_killed_writers_left(self, store: Store) -> None:
        publish(store, "e", {"a": b"A"})
        assert self._debris(store, -1.0) == {}  # a publication is never debris
        abandoned = store.stage("e")  # a second writer of "e", killed before its commit
        abandoned.write("a", b"A2")
        other = store.stage("f")  # a writer of "f", killed before its commit
        other.write("x/y", b"XYZ")
        found = self._debris(store, -1.0)
        assert set(found) == {abandoned.prefix, other.prefix}
        assert found[other.prefix].size == 3 and found[abandoned.prefix].size == 2
        assert all(item.age_seconds > -1.0 for item in found.values())
        assert self._debris(store, 3600.0) == {}  # just written: not abandoned yet
        for item in found.values():
            assert store.remove_debris(item) != "changed"
        assert self._debris(store, -1.0) == {}
        assert store.read(join(store.published("e") or "", "a")) == b"A"
        assert store.published("f") is None
        assert set(store.survey(older_than=-1.0).published) == {"e"}

    @staticmethod
    def _debris(store: Store, older_than: float) -> dict[str, Debris]:
        return {d.prefix: d for d in store.survey(older_than=older_than).debris}

    def test_a_withdrawn_entry_is_not_debris_once_deleted(self, store: Store) -> None:
        publish(store, "e", {"a": b"A"})
        assert store.unpublish("e") is True
        assert self._debris(store, -1.0) == {}

    # ------------------------------------------------------- verified copy
    def _source(self, store: Store) -> tuple[str, dict[str, bytes], dict[str, FileDigest]]:
        files = {"big.neff": BIG, "small.bin": b"s" * 1000, "sub/empty": b""}
        prefix = publish(store, "src", files)
        return prefix, files, {rel: digest_bytes(data) for rel, data in files.items()}

    def test_copy_verified_copies_intact_both_ways(self, store: Store, other_store: Store) -> None:
        prefix, files, expected = self._source(store)
        with other_store.stage("dst") as staging:
            copy_verified(store, prefix, staging, expected)
            assert staging.commit() is True
        back = other_store.published("dst")
        assert back is not None
        assert {rel: other_store.read(join(back, rel)) for rel in files} == files
        with store.stage("again") as staging:  # and back, into this store
            copy_verified(other_store, back, staging, expected, workers=1)
            assert staging.commit() is True
        again = store.published("again")
        assert again is not None and store.read(join(again, "big.neff")) == BIG

    @pytest.mark.parametrize("rel", ["big.neff", "small.bin"])
    @pytest.mark.parametrize("digest", ["blake3", "sha256"])
    def test_copy_verified_catches_a_corrupt_file(
        self, store: Store, other_store: Store, rel: str, digest: str
    ) -> None:
        prefix, files, expected = self._source(store)
        store.write(join(prefix, rel), flip_last_byte(files[rel]))  # same size, other bytes
        if digest == "sha256":  # a record from before BLAKE3: the stream checks SHA-256
            expected = {r: FileDigest(size=d.size, sha256=d.sha256) for r, d in expected.items()}
        with other_store.stage("dst") as staging, pytest.raises(IntegrityError) as raised:
            copy_verified(store, prefix, staging, expected)
        name = "BLAKE3" if digest == "blake3" else "SHA-256"
        assert raised.value.rel == rel and f"fails its {name} check" in str(raised.value)
        assert other_store.published("dst") is None

    @pytest.mark.parametrize("rel", ["big.neff", "small.bin"])
    def test_copy_verified_catches_a_short_or_missing_file(
        self, store: Store, other_store: Store, rel: str
    ) -> None:
        prefix, files, expected = self._source(store)
        store.write(join(prefix, rel), files[rel][:-7])
        with other_store.stage("dst") as staging, pytest.raises(IntegrityError) as raised:
            copy_verified(store, prefix, staging, expected)
        assert raised.value.rel == rel
        assert f"has {len(files[rel]) - 7} bytes, expected {len(files[rel])}" in str(raised.value)
        store.delete(join(prefix, rel))
        with other_store.stage("dst") as staging, pytest.raises(IntegrityError, match="is missing"):
            copy_verified(store, prefix, staging, expected)
