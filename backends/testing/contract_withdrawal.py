"""The store contract for what a publication is now, withdrawing one version of it, and
repairing a broken commit record.

Why its own module: these are the promises a fleet relies on when a node judges a shared
entry corrupt - the withdrawal removes exactly the version judged, never one another node
has just republished, and two withdrawals of one version never both succeed - and when a
commit record is garbage: it is reported, never read as a silent miss, and the next
commit replaces it without ever replacing a valid one. "Meanwhile" is a handshake: the
actor under test is stopped inside the protocol (`PauseAt`) while another acts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from .. import publication
from ..errors import PublicationStuck, StoreError
from ..keys import join
from ..layout import COMMIT_RECORD, VERSIONS_DIR
from ..store import Store
from ..testing_ops import publish, published_files
from .handshakes import HANG


class PauseAt:
    """Stops one thread at the first call of ``store.<method>`` that `when` accepts, until
    `release`; other threads pass. `run` starts the thread and waits until it is there."""

    def __init__(self, store: Store, method: str, when: Callable[..., bool]) -> None:
        self.reached, self._go = threading.Event(), threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        original = getattr(store, method)

        def hooked(*args: Any, **kwargs: Any) -> Any:
            if (threading.current_thread() is self._thread and not self.reached.is_set()
                    and when(*args, **kwargs)):
                self.reached.set()
                assert self._go.wait(HANG), "never released"
            return original(*args, **kwargs)

        setattr(store, method, hooked)  # on the instance: the store's own code calls it

    def run(self, fn: Callable[[], Any]) -> PauseAt:
        def target() -> None:
            try:
                self.result = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised by `release`
                self.error = exc

        self._thread = threading.Thread(target=target, name="paused-actor")
        self._thread.start()
        deadline = time.monotonic() + HANG
        while not self.reached.wait(0.01):
            if not self._thread.is_alive():
                raise AssertionError(f"the actor ended before the pause ({self.error!r})")
            assert time.monotonic() < deadline, "the actor hung before the pause"
        return self

    def release(self) -> Any:
        self._go.set()
        assert self._thread is not None
        self._thread.join(HANG)
        assert not self._thread.is_alive(), "the actor hung"
        if self.error is not None:
            raise self.error
        return self.result


def _inside_withdrawal(store: Store) -> PauseAt:
    """A pause inside a withdrawal, after it has won its right to withdraw: a commit-record
    store's re-read of the commit record (the version's tombstone is held), a rename
    store's look at what it moved aside."""
    if store.capabilities.atomic_rename:
        return PauseAt(store, "_dir_version", lambda key: key.startswith(".trash/"))
    return PauseAt(store, "read", lambda key, **_: key.endswith(COMMIT_RECORD))


class WithdrawalContractTests:
    """`publication`, `unpublish(final, version=...)` and the repair of broken commit
    records. Subclasses supply a ``store`` fixture."""

    # ------------------------------------------------------------ publication
    def test_publication_states(self, store: Store) -> None:
        assert store.publication("e").state == "absent"
        prefix = publish(store, "e", {"a": b"A"})
        now = store.publication("e")
        assert (now.state, now.prefix, now.problem) == ("published", prefix, None)
        assert now.version
        assert store.publication("e").version == now.version  # stable while published
        assert store.unpublish("e", version=now.version) is True
        assert store.publication("e").state == "absent"
        publish(store, "e", {"a": b"again"})
        assert store.publication("e").version != now.version  # another publication

    def test_empty_publication_is_published_not_broken(self, store: Store) -> None:
        with store.stage("e") as empty:
            assert empty.commit() is True
        assert store.publication("e").state == "published"

    # ------------------------------------------------------------ withdrawal
    def test_unpublish_of_a_version(self, store: Store) -> None:
        publish(store, "e", {"a": b"A"})
        version = store.publication("e").version
        assert version is not None
        assert store.unpublish("e", version=version) is True
        assert store.published("e") is None and store.list("") == []
        assert store.unpublish("e", version=version) is False

    def test_stale_version_is_not_withdrawn_after_a_republish(self, store: Store) -> None:
        publish(store, "e", {"a": b"old"})
        judged = store.publication("e").version
        assert judged is not None
        assert store.unpublish("e") is True  # another node withdrew it, and republished
        publish(store, "e", {"a": b"new"})
        assert store.unpublish("e", version=judged) is False
        assert published_files(store, "e") == {"a": b"new"}
        assert store.publication("e").state == "published"

    def test_concurrent_withdrawals_of_one_version_one_wins(self, store: Store) -> None:
        publish(store, "e", {"a": b"A"})
        version = store.publication("e").version
        first = _inside_withdrawal(store).run(lambda: store.unpublish("e", version=version))
        assert store.unpublish("e", version=version) is False  # meanwhile
        assert store.unpublish("e") is False  # an unconditional one neither
        assert first.release() is True
        assert store.published("e") is None

    def test_racing_withdrawals_exactly_one_reports_success(self, store: Store) -> None:
        publish(store, "e", {"a": b"A"})
        version = store.publication("e").version
        barrier = threading.Barrier(6)
        results: list[bool] = []
        lock = threading.Lock()

        def withdraw(conditional: bool) -> None:
            barrier.wait(HANG)
            won = store.unpublish("e", version=version if conditional else None)
            with lock:
                results.append(won)

        threads = [threading.Thread(target=withdraw, args=(i % 2 == 0,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG)
        assert sorted(results) == [False] * 5 + [True]
        assert store.published("e") is None

    def test_stale_withdrawal_meanwhile_replaced_leaves_the_new_one(self, store: Store) -> None:
        publish(store, "e", {"a": b"v1"})
        judged = store.publication("e").version
        assert store.unpublish("e") is True
        publish(store, "e", {"a": b"v2"})
        stale = _inside_withdrawal(store).run(lambda: store.unpublish("e", version=judged))
        # Meanwhile another publisher commits (it wins where the stale withdrawal has moved
        # v2 aside, and loses where v2 is still published).
        with store.stage("e") as staging:
            staging.write("a", b"v3")
            won = staging.commit()
        assert stale.release() is False
        assert published_files(store, "e") == {"a": b"v3" if won else b"v2"}



class CommitRecordContractTests:
    """Broken commit records (garbage, or naming a missing version): detected, withdrawn by
    their version, repaired by the next commit, never replacing a valid one. For the
    backends that publish with commit records (memory, S3); a rename store has no record
    to break. Subclasses supply a ``store`` fixture."""

    def test_garbage_commit_record_is_broken_and_the_next_commit_repairs_it(
        self, store: Store
    ) -> None:
        assert not store.capabilities.atomic_rename
        publish(store, "e", {"a": b"old"})
        store.write(join("e", COMMIT_RECORD), b"\x00garbage{")
        assert store.published("e") is None  # the hot path: unpublished
        broken = store.publication("e")
        assert broken.state == "broken" and broken.version and broken.prefix is None
        assert broken.problem and COMMIT_RECORD in broken.problem
        assert store.published_children("") == ["e"]  # listed, so a listing can show it
        with store.stage("e") as staging:
            staging.write("a", b"new")
            assert staging.commit() is True
        assert published_files(store, "e") == {"a": b"new"}
        assert store.publication("e").state == "published"

    def test_commit_record_naming_a_missing_version_is_repaired(self, store: Store) -> None:
        assert not store.capabilities.atomic_rename
        prefix = publish(store, "e", {"a": b"old"})
        store.delete_tree(prefix)
        broken = store.publication("e")
        assert (broken.state, broken.prefix) == ("broken", prefix)
        assert broken.problem and "no files" in broken.problem
        with store.stage("e") as staging:
            staging.write("a", b"new")
            assert staging.commit() is True
        assert published_files(store, "e") == {"a": b"new"}

    def test_garbage_commit_record_is_withdrawn_by_its_version(self, store: Store) -> None:
        assert not store.capabilities.atomic_rename
        store.write(join("e", COMMIT_RECORD), b"not json")
        version = store.publication("e").version
        assert version is not None
        assert store.unpublish("e", version="unreadable-" + "0" * 32) is False
        assert store.unpublish("e", version=version) is True
        assert store.publication("e").state == "absent" and store.list("") == []

    def test_repair_never_replaces_a_valid_commit(self, store: Store) -> None:
        assert not store.capabilities.atomic_rename
        store.write(join("e", COMMIT_RECORD), b"garbage")
        repairer = store.stage("e")
        repairer.write("a", b"repairer")
        # The repairer has seen the broken record and is about to withdraw it ...
        paused = PauseAt(store, "create", lambda key, data: "withdraw-" in key).run(
            repairer.commit)
        with store.stage("e") as other:  # ... when another publisher repairs it first.
            other.write("a", b"other")
            assert other.commit() is True
        assert paused.release() is False
        assert published_files(store, "e") == {"a": b"other"}

    def test_racing_repairers_publish_exactly_once(self, store: Store) -> None:
        assert not store.capabilities.atomic_rename
        store.write(join("e", COMMIT_RECORD), b"garbage")
        barrier = threading.Barrier(4)
        results: dict[int, bool] = {}

        def repair(i: int) -> None:
            with store.stage("e") as staging:
                staging.write("a", b"%d" % i)
                barrier.wait(HANG)
                results[i] = staging.commit()

        threads = [threading.Thread(target=repair, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG)
        winners = [i for i, won in results.items() if won]
        assert len(results) == 4 and len(winners) == 1
        assert published_files(store, "e") == {"a": b"%d" % winners[0]}

    def test_a_killed_withdrawal_holds_its_version_and_is_a_leftover(self, store: Store) -> None:
        assert not store.capabilities.atomic_rename
        store.write(join("e", COMMIT_RECORD), b"garbage")
        version = store.publication("e").version
        assert version is not None
        tombstone = join("e", VERSIONS_DIR, "withdraw-" + version)
        assert store.create(join(tombstone, "owner"), b"killed")
        assert store.unpublish("e", version=version) is False
        [debris] = [d for d in store.survey(older_than=-1.0).debris if d.prefix == tombstone]
        assert debris.kind == "tombstone"
        store.remove_debris(debris)  # what `cache gc` does after 6 hours
        assert store.unpublish("e", version=version) is True

    def test_a_planted_tombstone_delays_a_commit_one_patience_at_most(
        self, store: Store, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A tombstone nobody removes (a killed withdrawer's, or one a writer of the store
        planted beside a garbage commit record) stops the next commit of a good entry for
        `TOMBSTONE_PATIENCE` on the committer's own clock, then is removed: the entry is
        published (it raised "cannot be replaced" until `cache gc`, six hours later)."""
        monkeypatch.setattr(publication, "TOMBSTONE_PATIENCE", 0.3)
        store.write(join("e", COMMIT_RECORD), b"garbage")
        version = store.publication("e").version
        assert version is not None
        tombstone = join("e", VERSIONS_DIR, "withdraw-" + version)
        assert store.create(join(tombstone, "owner"), b"planted")
        with store.stage("e") as staging:
            staging.write("a", b"A")
            assert staging.commit()
        assert published_files(store, "e") == {"a": b"A"}
        assert not store.list(tombstone)

    def test_a_tombstone_rewritten_for_ever_stops_a_commit_one_deadline_at_most(
        self, store: Store, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A writer of the store who rewrites a planted tombstone's ``owner`` faster than
        `TOMBSTONE_PATIENCE` (so it never looks unchanged) holds a commit up to its one
        deadline, `REPAIR_ATTEMPTS` patiences, never reset: then the commit either got
        through or raises `PublicationStuck`, a defect of that key - never loops for ever
        (it holds the key's lock and lease meanwhile). A tombstone stuffed with names is
        never listed whole."""
        monkeypatch.setattr(publication, "TOMBSTONE_PATIENCE", 0.1)
        store.write(join("e", COMMIT_RECORD), b"garbage")
        version = store.publication("e").version
        assert version is not None
        tombstone = join("e", VERSIONS_DIR, "withdraw-" + version)
        for i in range(publication.TOMBSTONE_MAX_NAMES + 5):
            store.write(join(tombstone, f"junk{i}"), b"x")
        stop, rewrites = threading.Event(), [0]

        def rewrite() -> None:
            while not stop.is_set():
                rewrites[0] += 1
                store.write(join(tombstone, "owner"), f"mallory {rewrites[0]}".encode())

        store.write(join(tombstone, "owner"), b"mallory 0")
        real_list = store.list

        def never_the_tombstone_whole(prefix: str = "") -> list[str]:
            assert not prefix.startswith(tombstone), f"listed {prefix} whole"
            return real_list(prefix)

        monkeypatch.setattr(store, "list", never_the_tombstone_whole)
        adversary = threading.Thread(target=rewrite, daemon=True)
        adversary.start()
        bound = publication.REPAIR_ATTEMPTS * publication.TOMBSTONE_PATIENCE
        started = time.monotonic()
        try:
            with store.stage("e") as staging:
                staging.write("a", b"A")
                try:
                    staging.commit()
                except StoreError as exc:
                    assert isinstance(exc, PublicationStuck), exc
        finally:
            stop.set()
            adversary.join(HANG)
        assert time.monotonic() - started < bound + 5.0
        assert rewrites[0] > 1
