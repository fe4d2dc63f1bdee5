"""Compile once per fleet: a key that no tier holds is compiled by one process in the fleet.

Inside a node the ranks already queue on the key's local lock; the process that holds it
comes here on a miss of both tiers. It takes the key's lease **on the remote store**
(`Store.lock`: a fenced lease made of create-if-absent generation records on S3 and NFS, a
kernel lock on a folder every node reaches through one kernel), compiles, publishes
locally, promotes to the remote and lets the lease go. A process that finds the lease
held waits for the remote commit, polling with backoff, and fetches it.

Why this is safe without trusting the lease: publication on the remote is
first-writer-wins (a rename that refuses a non-empty target, or an exclusive commit
record), so a holder that was presumed dead and comes back late cannot replace what its
successor published; it checks its lease (`Lock.check`, the fencing generation) before
promoting or writing a failure note, to avoid the wasted upload and the false note.

What a dead or failing compiler costs:

* a holder that dies stops renewing its lease; one waiter takes the lease over when it
  expires (`VLLM_NEURON_REMOTE_LEASE_SECONDS` after the last renewal the waiter saw, on
  the waiter's own monotonic clock: no node's wall clock is trusted) and compiles;
* a compile that fails leaves a failure note on the remote (`entry/failure_notes.py`); waiters on
  every node raise its error at once, and processes that start within the cool-down
  (`VLLM_NEURON_COMPILE_RETRY_AFTER`) raise it too instead of compiling the same failing
  graph again. A note is advice, bounded (anyone who can write the remote can write one):
  it stops a process's compile of a key for one cool-down at most, on that process's own
  clock; one dated past the clock-skew margin is ignored; under ``require`` only a note
  signed by a trusted builder's key counts (a builder signs the notes it writes);
* a lease is advice, bounded too: a waiter compiles the key itself, without the lease
  (its promotion owed), once it has waited one cool-down (`VLLM_NEURON_COMPILE_RETRY_AFTER`)
  or its own timeout, whichever comes first, with nothing published - whoever renews the
  lease; a lease that cannot be taken at all (`LeaseUnusable`: a file where its folder
  should be) costs one lease period, then the same;
* a remote that fails (unreachable, denied) is set aside by `RemoteTier` with one
  warning, and the process compiles locally, as without a remote; a failure on one key's
  own object while the remote still answers its probe is that key's (`RemoteTier.key_failed`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from vllm_neuron.backends import LeaseLost, LeaseUnusable, Lock, LockTimeout, Record, Store
from vllm_neuron.backends.records import RecordError

from ..entry.events import LeaseTakenOver, LeaseWaited
from ..entry.failure_notes import (
    FailureNote,
    NoteSigner,
    describe,
    note_message,
    printable,
    recent_failure,
    write_failure_note,
)
from ..entry.outcomes import CacheResult, CompileError, FetchedFromFleet, Wait, Won
from ..tiers.remote import RemoteTier
from ..trust.policy import TrustPolicy
from ..trust.signing import judge_note, sign_note

logger = logging.getLogger("vllm_neuron.compile")

Claim = FetchedFromFleet | Won | Wait
"""What `RemoteSingleFlight.claim` says of a key (docs/compile-cache.md, "Compile once per
fleet")."""

MAX_POLL_INTERVAL = 1.0
"""The longest pause between two looks at the remote while another node compiles: the
delay a finished compile can add to its waiters, against one small request per second."""


class FleetCompileError(CompileError):
    """The compile of a key failed elsewhere in the fleet (within the cool-down)."""


def failure_message(key: str, note: FailureNote, remote: Store) -> str:
    """What `FleetCompileError` says: the note's text capped and escaped (`printable`)."""
    return note_message(key, note, remote.url)


class RemoteSingleFlight:
    """One node's side of the fleet-wide protocol for one cache (see the module doc)."""

    def __init__(
        self,
        tier: RemoteTier,
        *,
        lease_seconds: float,
        retry_after: float,
        timeout: float,
        record: Callable[[Record], None],
        trust: TrustPolicy | None = None,
        stopped_in: Store | None = None,
    ) -> None:
        self.tier = tier
        # This node's own local tier: where it keeps, across restarts, when failure notes
        # first stopped a key's compile (`failure_notes.recent_failure`).
        self.stopped_in = stopped_in
        self.timeout = timeout  # NEURON_LIBTORCH_COMPILATION_TIMEOUT, for the message
        self.lease_seconds = lease_seconds
        self.retry_after = retry_after
        self._record = record
        # Whose failure notes stop a compile (``require``: a trusted key's only), and the
        # key this process signs its own with (a builder's).
        self.trust = TrustPolicy() if trust is None else trust
        signer = self.trust.signer
        self._note_signer = None if signer is None else NoteSigner(
            signer.key_id, lambda payload: sign_note(signer, payload))

    def claim(
        self,
        key: str,
        *,
        started: float,
        deadline: float,
        wait: bool = True,
        fetch: Callable[[], CacheResult | None],
    ) -> Claim:
        """Who compiles `key`: `FetchedFromFleet` once another node published it, `Won` when this
        process may compile it (with the key's lease, or - the remote down, read-only or
        unset - alone, the promotion owed), or `Wait("remote-lease")` when another node holds
        the lease and the caller asked not to wait. `fetch` is the caller's fetch from the
        remote (verified, into its local tier), tried while the lease is held elsewhere and
        once more when it is won.

        `started` (epoch seconds) is when this process began waiting for `key`: a failure
        recorded after it is this wait's failure (`FleetCompileError`). `deadline`
        (monotonic) bounds the wait, and so does one cool-down (`retry_after`): then this
        process compiles alone (`Won` without a lease, the promotion owed). A failure note
        is looked for at every poll (with `wait`) and once the lease is won (a remote that
        fails to answer then is a remote outage, as anywhere in this loop). A `Won`
        with a lease must be given back (`let_go`) whatever the compile does.
        """
        remote = self.tier.store()
        if remote is None or self.tier.read_only:
            return Won(owes=True)
        lease = remote.lock(key, lease_duration=self.lease_seconds)
        wait_start = time.perf_counter()
        alone_at = min(deadline, time.monotonic() + self.retry_after)
        waited = False
        delay = 0.05
        while True:
            try:
                if wait:  # a deferral looks for a failure only once it wins the lease, or
                    # at the first call: one request less per graph it traces past
                    self._raise_if_failed_elsewhere(remote, key, started, wait_start, waited)
                # Every poll: a waiter sees a dead holder's lease run out only by watching
                # it stop changing (one read while it does not; docs/compile-cache.md).
                lease.acquire(timeout=0)
                # Looked for again once the lease is won, waiting or not: a holder writes its
                # failure note before it lets the lease go, so the look before the lease can
                # miss a failure this one cannot (the holder failed between the two).
                try:
                    self._raise_if_failed_elsewhere(remote, key, started, wait_start, waited)
                except BaseException:
                    self._let_go(lease)  # a failed graph, or the remote failed: below
                    raise
                break
            except LockTimeout:
                pass
            except FleetCompileError:
                raise
            except (RecordError, LeaseUnusable) as exc:  # the key's lease folder is unusable
                # (over-full, linked out of the remote, a file; held one period first): a
                # defect of that key, never of the remote - compiled here alone, not owed (a
                # promotion would meet the same folder)
                logger.warning("compile cache: the remote lease of %s cannot be used (%s); "
                               "compiling it for this node only", key,
                               printable(str(exc), 300))  # fmt: skip
                self._waited(key, wait_start, waited, "alone")
                fetched = fetch()
                return Won(owes=False) if fetched is None else FetchedFromFleet(fetched)
            except PermissionError as exc:  # a read-only remote: fetch from it, write nothing
                self.tier.write_denied(exc)
                self._waited(key, wait_start, waited, "read-only")
                if not wait:  # not looked for before the lease: a failed graph stays failed
                    self._best_effort_failure_look(remote, key, started, wait_start, waited)
                fetched = fetch()
                return Won(owes=True) if fetched is None else FetchedFromFleet(fetched)
            except Exception as exc:  # noqa: BLE001 - the remote is best-effort
                self.tier.key_failed(key, exc)
                self._waited(key, wait_start, waited, "remote-down")
                return Won(owes=True)
            if not wait:  # another node compiles it: trace on, wait at the first call
                # (the caller looked for its result just before: no second look)
                return Wait("remote-lease")
            waited = True
            fetched = fetch()
            if fetched is not None:
                self._waited(key, wait_start, waited, "fetched")
                return FetchedFromFleet(fetched)
            if self.tier.store() is None:  # the fetch found the remote down: go on alone
                self._waited(key, wait_start, waited, "remote-down")
                return Won(owes=True)
            now = time.monotonic()
            if now >= alone_at:
                self._waited(key, wait_start, waited, "timeout")
                self._alone(key, remote, wait_start)
                return Won(owes=True)
            pause = min(delay, alone_at - now)
            free_in = lease.seconds_until_free()  # the lease seen runs out sooner: look then
            time.sleep(min(pause, free_in) if free_in > 0 else pause)
            delay = min(delay * 1.5, MAX_POLL_INTERVAL)
        self._waited(key, wait_start, waited, "acquired")
        try:
            previous = lease.took_over_from
            if previous is not None:
                self._record(LeaseTakenOver(key=key, at=time.time(), previous_owner=previous,
                                            remote=remote.url))  # fmt: skip
                logger.warning("compile cache: took over the compile of %s from %s, whose "
                               "lease on %s expired", key, printable(previous, 200),
                               remote.url)  # fmt: skip
            fetched = fetch()  # published between our last look and the lease
        except BaseException:
            self._let_go(lease)
            raise
        if fetched is not None:
            self._let_go(lease)
            return FetchedFromFleet(fetched)
        return Won(owes=True, lease=lease, remote=remote)

    def claim_without_lease(
        self,
        key: str,
        *,
        started: float,
        deadline: float,
        wait: bool = True,
        fetch: Callable[[], CacheResult | None],
    ) -> Claim:
        """`claim` for a process that must never take the lease (it cannot sign what it
        would publish, docs/trust.md): `FetchedFromFleet` once the node holding the lease
        publishes it, or - when nobody holds it - `Won` without a lease: compiled for this
        node alone, with nothing promoted and nothing owed. A failure noted by the holder is
        raised."""
        remote = self.tier.store()
        if remote is None:
            return Won(owes=False)
        lease = remote.lock(key, lease_duration=self.lease_seconds)
        wait_start = time.perf_counter()
        alone_at = min(deadline, time.monotonic() + self.retry_after)
        waited = False
        delay = 0.05
        while True:
            try:
                # The lease first, then the note: a holder writes its failure note before it
                # lets the lease go, so a lease seen free after a failure comes with its note.
                busy = lease.busy()
                self._raise_if_failed_elsewhere(remote, key, started, wait_start, waited)
            except FleetCompileError:
                raise
            except Exception as exc:  # noqa: BLE001 - the remote is best-effort
                self.tier.key_failed(key, exc)
                self._waited(key, wait_start, waited, "remote-down")
                return Won(owes=False)
            fetched = fetch()
            if fetched is not None:
                self._waited(key, wait_start, waited, "fetched")
                return FetchedFromFleet(fetched)
            if not busy or self.tier.store() is None:
                self._waited(key, wait_start, waited, "alone")
                return Won(owes=False)
            if not wait:  # the builder compiles it: trace on, wait at the first call
                return Wait("remote-lease")
            waited = True
            now = time.monotonic()
            if now >= alone_at:
                self._waited(key, wait_start, waited, "timeout")
                self._alone(key, remote, wait_start)
                return Won(owes=False)
            time.sleep(min(delay, alone_at - now))
            delay = min(delay * 1.5, MAX_POLL_INTERVAL)

    # ------------------------------------------------------- a won claim
    def note_failure(self, won: Won, key: str, exc: Exception) -> None:
        """The compile of a key this process won failed: a failure note on the remote, so
        every node's waiters raise it at once - unless the lease was taken over meanwhile
        (the new holder's outcome counts). Nothing without a lease."""
        if won.lease is None or won.remote is None:
            return
        try:
            won.lease.check()
        except LeaseLost:
            return  # taken over: the new holder's outcome counts
        except Exception as remote_error:  # noqa: BLE001 - the remote is best-effort
            self.tier.key_failed(key, remote_error)
            return
        refused = write_failure_note(won.remote, key, describe(exc), sign=self._note_signer)
        if isinstance(refused, PermissionError):
            self.tier.write_denied(refused)
        elif refused is not None:
            logger.warning("compile cache: could not record the failed compile of %s in %s: "
                           "%s", key, won.remote.url, refused)

    def still_holds(self, won: Won, key: str) -> bool:
        """Whether this process may promote what it compiled for `won`: it holds the lease
        still (fencing: a successor that took it over owns the key now). False without a
        lease, and when the remote fails to answer (set aside)."""
        if won.lease is None or won.remote is None:
            return False
        try:
            won.lease.check()
        except LeaseLost as exc:  # fencing: a successor owns the key now
            logger.warning("compile cache: compiled %s, but the lease on %s was taken over "
                           "(%s); leaving the promotion to the new holder", key,
                           won.remote.url, exc)  # fmt: skip
            return False
        except Exception as exc:  # noqa: BLE001 - the remote is best-effort
            self.tier.key_failed(key, exc)
            return False
        return True

    def let_go(self, won: Won) -> None:
        """Give back `won`'s lease, if it has one (an unreleased lease expires by itself)."""
        if won.lease is not None:
            self._let_go(won.lease)

    def _alone(self, key: str, remote: Store, since: float) -> None:
        """Say that this process stops waiting for the holder of `key`'s lease: a lease is
        advice, and anyone who can write the remote can write (and renew) one."""
        logger.warning(
            "compile cache: waited %.0f s for another node to compile %s (its lease on %s "
            "held, nothing published; VLLM_NEURON_COMPILE_RETRY_AFTER=%g, "
            "NEURON_LIBTORCH_COMPILATION_TIMEOUT=%g); compiling it here, without the lease",
            time.perf_counter() - since, key, remote.url, self.retry_after, self.timeout)

    # ---------------------------------------------------------------- parts
    def _raise_if_failed_elsewhere(self, remote: Store, key: str, started: float,
                                   wait_start: float, waited: bool) -> None:  # fmt: skip
        """`FleetCompileError` when a compile of `key` failed in the fleet during this wait
        (or within `retry_after`): every waiter raises it at once, not at its timeout."""
        since = min(started, time.time() - self.retry_after)
        verify = self._note_untrusted if self.trust.requires else None
        note = recent_failure(remote, key, since=since, retry_after=self.retry_after,
                              verify=verify, stopped_in=self.stopped_in)  # fmt: skip
        if note is not None:
            self._waited(key, wait_start, waited, "failed-elsewhere")
            raise FleetCompileError(failure_message(key, note, remote))

    def _note_untrusted(self, note: FailureNote, payload: bytes) -> str | None:
        """Why a failure note is not a trusted builder's (``require``), or None."""
        verdict = judge_note(self.trust.keys, note.signer, note.signature, payload)
        return None if verdict.trusted else verdict.reason

    def _best_effort_failure_look(self, remote: Store, key: str, started: float,
                                  wait_start: float, waited: bool) -> None:  # fmt: skip
        """`_raise_if_failed_elsewhere` where the remote may fail to answer: only a failure
        note it does return stops the compile."""
        try:
            self._raise_if_failed_elsewhere(remote, key, started, wait_start, waited)
        except FleetCompileError:
            raise
        except Exception as exc:  # noqa: BLE001 - the remote is best-effort
            logger.debug("compile cache: no failure note of %s read: %s", key, exc)

    def _waited(self, key: str, since: float, waited: bool, outcome: str) -> None:
        if waited:
            self._record(LeaseWaited(key=key, at=time.time(),
                                     seconds=time.perf_counter() - since, outcome=outcome))

    def _let_go(self, lease: Lock) -> None:
        try:
            lease.release()
        except Exception as exc:  # noqa: BLE001 - an unreleased lease expires by itself
            logger.debug("compile cache: could not release a remote lease: %s", exc)
