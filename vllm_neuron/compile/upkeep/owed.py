"""Promotions owed: an entry this node compiled for the fleet reaches the remote even when
the process that compiled it died (or lost the remote) before promoting it.

In the fleet's flow (`fleet.py`) the process that holds a key's remote lease compiles,
publishes locally, then promotes. Killed between the local publication and the promotion,
it leaves an entry that the node serves from its local tier ever after (a local hit never
looks at the remote), and that the rest of the fleet never sees: each node that misses
it compiles it again. So before compiling for the fleet the process leaves a note,
``.promote/<key>.json``, in its local tier, and removes it once the remote holds the
entry. A note that outlives its process is an owed promotion: the next cache used on the
tier with a writable remote settles it in its background pass (`upkeep.py`), off the hot
path, so a node restarted after such a crash serves its local hit at once and shares the
entry a moment later. A compile done while the remote was down owes its promotion the
same way.

Settling one note, under the key's local lock (taken waiting up to two lease durations: a
killed owner's lease on a tier without kernel locks expires in one; a process still at
work on the key after that keeps its note, for the next start): the note gone already ->
settled by another process; no local entry -> nothing to share, the note goes; else the
key's remote lease (the same wait), `promote_entry` (a no-op when the remote has the
entry), and the note goes. A corrupt local entry is quarantined, never shared. A remote
that fails or refuses writes ends the pass with the notes kept. The note's directory,
record and age rule (`cache gc`) are declared in `entry/notes.py` (`OWED`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Callable

from vllm_neuron.backends import LeaseUnusable, LockTimeout, Store
from vllm_neuron.backends.records import RecordError, encode

from ..entry.notes import OWED, OWED_DIR, OWED_NOTES, OwedPromotion
from ..entry.text import printable
from ..tiers.promote import CannotSign, LocalEntryProblem, promote_entry
from ..tiers.remote import RemoteTier
from ..trust.policy import TrustPolicy

logger = logging.getLogger("vllm_neuron.compile")

__all__ = ["OWED_DIR", "OWED_NOTES", "OwedPromotion", "owe_promotion", "owed_keys",
           "promotion_settled", "read_owed", "settle_owed"]  # fmt: skip

_NOTE_NAME = re.compile(r"([0-9a-f]{32})\.json")


def _note_key(key: str) -> str:
    return OWED.path(key)


def owe_promotion(local: Store, key: str, remote_url: str) -> None:
    """Note that `key` is being compiled for `remote_url`; best-effort (a tier that cannot
    take the note only loses the healing after a crash, never the compile)."""
    note = OwedPromotion(at=time.time(), remote=remote_url, pid=os.getpid(),
                         host=socket.gethostname())  # fmt: skip
    try:
        local.write(_note_key(key), encode(note))
    except Exception as exc:  # noqa: BLE001 - see above
        logger.debug("compile cache: could not note the promotion owed for %s: %s", key, exc)


def promotion_settled(local: Store, key: str) -> None:
    """The remote holds `key` (or never will from here): forget the note."""
    with contextlib.suppress(Exception):
        local.delete(_note_key(key))


def owed_keys(local: Store) -> list[str]:
    """Keys with a promotion owed in `local` (one listing; notes that do not read count:
    settling one only looks at the entry and the remote)."""
    try:
        names = local.list(OWED_DIR)
    except Exception as exc:  # noqa: BLE001 - hygiene never stops the cache from starting
        logger.debug("compile cache: cannot list owed promotions: %s", exc)
        return []
    keys = []
    for name in names:
        match = _NOTE_NAME.fullmatch(name.rsplit("/", 1)[-1])
        if match:
            keys.append(match.group(1))
    return sorted(keys)


def read_owed(local: Store, key: str) -> OwedPromotion | None:
    """The note of `key`, None when absent or unreadable (for `cache ls` and gc)."""
    try:
        return OWED_NOTES.read(local, _note_key(key))
    except RecordError:
        return None


def settle_owed(
    local: Store,
    tier: RemoteTier,
    keys: list[str],
    *,
    lease_seconds: float,
    lock_lease: float,
    quarantine: Callable[[str, str], None],
    stopping: Callable[[], bool] = lambda: False,
    policy: TrustPolicy | None = None,
) -> None:
    """Promote each owed key that can be promoted now (see the module doc), under `policy`:
    the trust of the cache that owes them (its signer signs what is shared, its keys judge
    what it may share); default the process's.

    Everything about a key is decided under its local lock: a note whose entry is not
    there yet may be a live compile's (it holds the lock until it publishes), and a note
    another process settled meanwhile is gone by then. `quarantine(key, reason)` withdraws
    a local entry that fails its checksums (it is never shared, nor served again).
    """
    for key in keys:
        if stopping():
            return
        remote = tier.store()
        if remote is None or tier.read_only:
            return  # down or read-only: the notes wait for a start that can write
        lock = local.lock(key, lease_duration=lock_lease)
        try:
            # Held: by a process at work on the key, or (a tier without kernel locks) still
            # by the killed process that owed this, until its lease expires.
            lock.acquire(timeout=2 * lock_lease)
        except LockTimeout:
            logger.debug("compile cache: %s is in use; its promotion waits", key)
            continue
        try:
            if not local.exists(_note_key(key)):
                continue  # settled by another process meanwhile
            if local.published(key) is None:
                promotion_settled(local, key)  # never published (or evicted): nothing to share
                continue
            if not _promote_owed(local, tier, remote, key, lease_seconds, quarantine,
                                 policy):  # fmt: skip
                return
        finally:
            lock.release()


def _promote_owed(
    local: Store, tier: RemoteTier, remote: Store, key: str, lease_seconds: float,
    quarantine: Callable[[str, str], None], policy: TrustPolicy | None = None,
) -> bool:
    """Promote one owed key under its local lock; False when the pass must stop (the
    remote failed or refuses writes: its lease could not be taken). What fails at that
    key alone (its lease folder, its publication) never stops the pass."""
    lease = remote.lock(key, lease_duration=lease_seconds)
    try:
        # Held: by the killed process that owed this (free once its lease expires) or by
        # a node compiling the key now (which promotes it itself).
        lease.acquire(timeout=2 * lease_seconds)
    except LockTimeout:
        logger.debug("compile cache: %s is being compiled on %s; its promotion waits", key,
                     remote.url)  # fmt: skip
        return True
    except (LeaseUnusable, RecordError) as exc:
        # That key's lease folder cannot be used (a file, over-full, a link out of the
        # remote; held one period first): a defect of that key, never the remote's. The
        # note goes - every later start would meet the same folder - and the fleet
        # compiles the key where it misses it.
        logger.warning("compile cache: the remote lease of %s on %s cannot be used (%s); "
                       "its owed promotion is dropped", key, remote.url,
                       printable(str(exc), 300))  # fmt: skip
        promotion_settled(local, key)
        return True
    except Exception as exc:  # noqa: BLE001 - the remote is best-effort
        return _remote_refused(tier, exc)
    try:
        promote_entry(local, remote, key, policy=policy)
    except CannotSign as exc:  # never shared unsigned or re-signed: nothing is owed
        logger.warning("compile cache: %s", exc)
        promotion_settled(local, key)
        return True
    except LocalEntryProblem as exc:
        if local.published(key) is not None:  # corrupt: withdrawn, never shared
            logger.warning("compile cache: not promoting %s: %s", key, exc)
            quarantine(key, str(exc))
        promotion_settled(local, key)
        return True
    except Exception as exc:  # noqa: BLE001 - the remote is best-effort
        # Leased, so the remote took a write: what fails now is that key's (its folder
        # refused, a publication stuck) unless a fresh probe fails too (`key_failed`); the
        # note stays, and the pass goes on while the remote is in use.
        tier.key_failed(key, exc)
        return True
    finally:
        with contextlib.suppress(Exception):
            lease.release()
    promotion_settled(local, key)
    logger.info("compile cache: promoted %s to %s (owed since an earlier process)", key,
                remote.url)  # fmt: skip
    return True


def _remote_refused(tier: RemoteTier, exc: Exception) -> bool:
    """Tell the tier what the remote did (refused writes: read-only; else an outage);
    False: the pass stops."""
    if isinstance(exc, PermissionError):
        tier.write_denied(exc)
    else:
        tier.failed(exc)
    return False
