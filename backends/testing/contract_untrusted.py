"""The store contract for reading what a hostile writer of a shared tier left.

Every backend: a record larger than `RECORD_MAX_BYTES` is refused (`RecordTooLarge`, a
`RecordError`) by every record reader - `read(key, max_size=...)`, `RecordCodec.read`,
`read_published` - and never read whole. Folder backends (``local_paths``): a FIFO, a
symbolic link (to ``/dev/zero``, to a node-local file) and a device at a key are refused
(`NotRegularFile`, or `IntegrityError` from the checking operations) without blocking.

A read that would block on a FIFO without the protection runs in a thread that this test
releases afterwards (it opens the FIFO's write end, which ends the blocked read): the test
fails after `HANG` seconds rather than hanging the suite.
"""

from __future__ import annotations

import functools
import os
import stat
import threading
from collections.abc import Callable
from typing import Any

import pytest

from ..digests import digest_bytes
from ..errors import IntegrityError, NotRegularFile, RecordError, RecordTooLarge
from ..keys import join
from ..records import COMMIT_RECORDS, RECORD_MAX_BYTES, CommitRecord, encode
from ..store import Store
from ..verified_copy import copy_verified
from .handshakes import HANG

OVERSIZE = RECORD_MAX_BYTES + 1


def settle(fn: Callable[[], Any], *, fifo: str | None = None) -> Any:
    """`fn()` run in a thread and its result (or its exception, raised here), failing if it
    has not finished within `HANG` seconds - then released through `fifo`'s write end."""
    started, out = threading.Event(), {}

    def run() -> None:
        started.set()
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, name="untrusted-read", daemon=True)
    thread.start()
    assert started.wait(HANG)
    thread.join(HANG)
    if thread.is_alive():
        if fifo is not None:  # release the blocked reader: a writer appears and goes
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        raise AssertionError(f"reading a FIFO blocked for {HANG} s: the read waited on it")
    if "error" in out:
        raise out["error"]
    return out.get("value")


class UntrustedReadContractTests:
    """Bounded record reads everywhere; regular files only on folder stores."""

    def test_an_oversize_record_is_refused_unread(self, store: Store) -> None:
        store.write("r/big", b"x" * OVERSIZE)
        store.write("r/edge", b"y" * RECORD_MAX_BYTES)
        with pytest.raises(RecordTooLarge):
            store.read("r/big", max_size=RECORD_MAX_BYTES)
        assert store.read("r/edge", max_size=RECORD_MAX_BYTES) == b"y" * RECORD_MAX_BYTES
        assert len(store.read("r/big") or b"") == OVERSIZE  # unbounded: streams, content
        assert store.read("r/none", max_size=RECORD_MAX_BYTES) is None
        store.write("r/empty", b"")
        assert store.read("r/empty", max_size=RECORD_MAX_BYTES) == b""
        # The record codec's door is bounded by default: a defect of that record.
        store.write("r/commit", encode(CommitRecord(version="v", committed_at=1.0))
                    + b" " * OVERSIZE)  # fmt: skip
        with pytest.raises(RecordError, match="more than|larger than"):
            COMMIT_RECORDS.read(store, "r/commit")

    def test_read_published_is_bounded(self, store: Store) -> None:
        with store.stage("p") as staging:
            staging.write("entry.json", b"{" * 10 + b" " * OVERSIZE)
            staging.write("small.json", b"{}")
            assert staging.commit()
        with pytest.raises(RecordTooLarge):
            store.read_published("p", "entry.json")
        found = store.read_published("p", "small.json")
        assert found is not None and found[1] == b"{}"
        found = store.read_published("p", "entry.json", max_size=None)
        assert found is not None and found[1] is not None and len(found[1]) == OVERSIZE + 10

    # ---------------------------------------------------------- folder stores
    def _folder(self, store: Store) -> str:
        if not store.capabilities.local_paths:
            pytest.skip("no paths: nothing but regular objects can be stored")
        path = store.local_path("")
        assert path is not None
        return path

    def _plant(self, store: Store, key: str, kind: str, target: str = "/dev/zero") -> str:
        """Put a FIFO, a symbolic link or a socket at `key` (a hostile writer's move)."""
        path = store.local_path(key)
        assert path is not None
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "link":
            os.symlink(target, path)
        elif kind == "socket":
            import socket

            with socket.socket(socket.AF_UNIX) as sock:
                sock.bind(path)
        return path

    @pytest.mark.parametrize("kind", ["fifo", "link", "link-to-file", "socket"])
    def test_a_file_that_is_not_regular_is_refused_without_blocking(
            self, store: Store, kind: str) -> None:  # fmt: skip
        root = self._folder(store)
        target = "/dev/zero"
        if kind == "link-to-file":  # a node-local regular file: never followed either
            target = os.path.join(os.path.dirname(root.rstrip("/")), "node-local.json")
            with open(target, "wb") as f:
                f.write(b"{}")
            kind = "link"
        path = self._plant(store, "e/entry.json", kind, target=target)
        fifo = path if kind == "fifo" else None
        for max_size in (RECORD_MAX_BYTES, None):
            with pytest.raises(NotRegularFile):
                settle(functools.partial(store.read, "e/entry.json", max_size=max_size),
                       fifo=fifo)  # fmt: skip
        with pytest.raises(RecordError):  # every record reader: a defect of that record
            settle(lambda: COMMIT_RECORDS.read(store, "e/entry.json"), fifo=fifo)
        with pytest.raises(NotRegularFile):
            settle(lambda: store.open_read("e/entry.json"), fifo=fifo)
        with pytest.raises(NotRegularFile):
            settle(lambda: store.digest("e/entry.json"), fifo=fifo)
        assert store.info("e/entry.json") is None  # no file of the store
        with pytest.raises(IntegrityError, match="not a regular file"):
            settle(lambda: store.check_sizes("e", {"entry.json": digest_bytes(b"")}), fifo=fifo)

    @pytest.mark.parametrize("kind", ["fifo", "link"])
    def test_a_published_record_that_is_not_regular_is_refused(
            self, store: Store, kind: str) -> None:  # fmt: skip
        self._folder(store)
        with store.stage("q") as staging:
            staging.write("other", b"o")
            assert staging.commit()
        prefix = store.published("q")
        assert prefix is not None
        path = self._plant(store, join(prefix, "entry.json"), kind)
        with pytest.raises(NotRegularFile):
            settle(lambda: store.read_published("q", "entry.json"),
                   fifo=path if kind == "fifo" else None)  # fmt: skip

    @pytest.mark.parametrize("kind", ["fifo", "link"])
    def test_a_verified_copy_refuses_a_file_that_is_not_regular(
            self, store: Store, other_store: Store, kind: str) -> None:  # fmt: skip
        root = self._folder(store)
        # Outside the store: a node-local file a link could lead the copy to.
        local_file = os.path.join(os.path.dirname(root.rstrip("/")), "node-local-secret")
        with open(local_file, "wb") as f:
            f.write(b"s" * 2_000_000)  # large enough for the kernel-copy path too
        path = self._plant(store, "src/big.bin", kind, target=local_file)
        for size in (0, 2_000_000):
            expected = {"big.bin": digest_bytes(b"s" * size)}
            with other_store.stage("dst") as staging, pytest.raises(IntegrityError) as err:
                settle(functools.partial(copy_verified, store, "src", staging, expected),
                       fifo=path if kind == "fifo" else None)  # fmt: skip
            assert "not a regular file" in str(err.value)
            assert "2000000" not in str(err.value)  # the linked file's size never shows

    def test_a_linked_directory_outside_the_store_is_not_copied(
            self, store: Store, other_store: Store, tmp_path: Any) -> None:
        root = self._folder(store)
        outside = tmp_path / "node-local"
        outside.mkdir()
        (outside / "a.bin").write_bytes(b"n" * 1234)
        os.symlink(outside, os.path.join(root, "linked"))
        with other_store.stage("dst") as staging, pytest.raises(IntegrityError) as err:
            copy_verified(store, "linked", staging, {"a.bin": digest_bytes(b"")})
        assert "outside the tier" in str(err.value) and "1234" not in str(err.value)

    def test_a_device_is_refused(self, store: Store) -> None:
        root = self._folder(store)
        path = os.path.join(root, "dev", "zero")
        os.makedirs(os.path.dirname(path))
        try:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
        except PermissionError:
            pytest.skip("mknod needs privileges this process has not")
        with pytest.raises(NotRegularFile, match="character device"):
            settle(lambda: store.read("dev/zero", max_size=RECORD_MAX_BYTES))
        with pytest.raises(NotRegularFile):
            settle(lambda: store.read("dev/zero"))
