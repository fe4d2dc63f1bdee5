"""The optional remote tier of the compile cache: reaching it, and fetching from it.

The remote tier is best-effort (`RemoteTier`): it is opened and probed on first use (one
cheap request: a missing bucket, refused access or an endpoint that does not answer is
caught here, not read as an empty cache), and when it fails there is one warning per
outage and the node carries on with its local tier alone. The remote is set aside for
`REMOTE_RETRY_AFTER` seconds after the first failure, twice as long after each failed
retry, up to `REMOTE_RETRY_MAX`, so a long warm-up against a dead endpoint pays its
timeout a handful of times, not once a minute; a retry is a probe, and the first one that
succeeds ends the outage (logged). A refused write makes the tier read-only for the
process (`write_denied`), as ``VLLM_NEURON_REMOTE_WRITE=off`` does from the start.

A fetch copies a published remote entry into a local staging area with the storage
layer's verified copy (every file checked as it is copied: BLAKE3 when recorded, else
SHA-256), writes the record last and publishes (`fetch_entry`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from vllm_neuron.backends import (
    IntegrityError,
    LeaseUnusable,
    Progress,
    PublicationStuck,
    Record,
    Store,
    copy_verified,
    fault_point,
    join,
    open_store,
    probe_store,
    validate_key,
)
from vllm_neuron.backends.records import RECORD_MAX_BYTES, RecordError
from vllm_neuron.envs.compile_cache import REMOTE_WRITE_MODES, RemoteWrite

from ..entry.events import RemoteUnavailable
from ..entry.failure_notes import printable
from ..entry.record import ENTRY_RECORD, EntryRecord, decode_record, encode_record
from ..trust.origin import seal
from ..trust.policy import TrustPolicy, UntrustedEntry, fetched_from
from ..trust.signing import SIGNATURE_FILE, Verdict
from .quarantine import PublicationProblem

logger = logging.getLogger("vllm_neuron.compile")

KEY_DEFECTS: tuple[type[BaseException], ...] = (
    PermissionError, NotADirectoryError, IsADirectoryError, RecordError, LeaseUnusable,
    PublicationStuck)
"""What a writer of the remote can leave at one key, and so that key's defect while the
remote answers a probe (`RemoteTier.key_failed`): a refusal or a path that is no
directory (S3's per-object ``AccessDenied``, EACCES, ENOTDIR, EISDIR), a record or folder
that does not read within its bounds (`RecordError`, `ListingTooLarge`), a lease folder
that cannot be used, a broken commit record its tombstone holds (`PublicationStuck`)."""

REMOTE_RETRY_AFTER = 60.0
"""Seconds the remote is set aside after the failure that starts an outage."""
REMOTE_RETRY_MAX = 600.0
"""The longest set-aside: each failed retry doubles it up to this."""


class RemoteTier:
    """The remote store: opened and probed on first use, set aside after a failure.

    ``store()`` is what every remote operation asks first; it makes a request only to open
    the store (the probe) and, after an outage, once per set-aside to see whether the remote
    is back. ``failed(exc)`` is how a caller reports a remote operation that failed.
    ``clock`` is for tests (monotonic seconds).
    """

    def __init__(
        self,
        url: str | None,
        options: Mapping[str, Any],
        record: Callable[[Record], None],
        *,
        write: RemoteWrite = "auto",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if write not in REMOTE_WRITE_MODES:
            raise ValueError(
                f"VLLM_NEURON_REMOTE_WRITE must be one of {', '.join(REMOTE_WRITE_MODES)}, "
                f"got {write!r}"
            )
        self.url = url
        self._options = dict(options)
        self._record = record
        self._clock = clock
        self._write: RemoteWrite = write
        self._store: Store | None = None
        self._checked = False  # probed successfully since the last failure
        self._down_until = 0.0
        self._set_aside = 0.0  # the current outage's set-aside; 0 while the remote is up
        self._outage_started = 0.0
        self._denied: BaseException | None = None
        self._key_defects: set[str] = set()  # keys warned about (`key_failed`)
        # Reentrant: store() reports its own failures. Held while probing, so concurrent
        # callers wait for one probe instead of each paying the endpoint's timeout.
        self._lock = threading.RLock()
        self._when_back: list[Callable[[], None]] = []

    def when_back(self, callback: Callable[[], None]) -> None:
        """Call `callback` (in the thread that found out, best-effort) each time the remote
        answers again after an outage: what waited for it (promotions owed) can go now."""
        self._when_back.append(callback)

    def store(self) -> Store | None:
        """The remote store, or None when unset or set aside after a failure."""
        if self.url is None:
            return None
        with self._lock:
            if self._set_aside and self._clock() < self._down_until:
                return None
            if self._store is not None and self._checked:
                return self._store
            try:
                if self._store is None:
                    self._store = open_store(self.url, **self._options)
                probe_store(self._store)
            except Exception as exc:  # noqa: BLE001 - the remote is best-effort
                self.failed(exc)
                return None
            self._checked = True
            back = bool(self._set_aside)
            if back:
                logger.info(
                    "compile cache: remote tier %s (NEURON_LIBTORCH_REMOTE_CACHE) is "
                    "reachable again after %.0f s; using it again",
                    self.url,
                    self._clock() - self._outage_started,
                )
                self._set_aside = 0.0
            store = self._store
        if back:
            for callback in list(self._when_back):
                try:
                    callback()
                except Exception as exc:  # noqa: BLE001 - never fails the caller's operation
                    logger.warning("compile cache: after the remote came back: %s", exc)
        return store

    @property
    def set_aside_seconds(self) -> float:
        """How long the remote is left alone after the last failure (0 while it is up)."""
        return self._set_aside

    def failed(self, exc: BaseException) -> None:
        """A remote operation failed: warn once per outage, then leave the remote alone.

        The first failure starts an outage: one warning, one ``remote_unavailable`` event,
        `REMOTE_RETRY_AFTER` seconds set aside. A failure reported while the remote is set
        aside (another thread's operation) changes nothing; the failure of the retry that
        follows a set-aside doubles it, up to `REMOTE_RETRY_MAX`.
        """
        with self._lock:
            now = self._clock()
            self._checked = False
            if self._set_aside and now < self._down_until:
                return
            first = not self._set_aside
            if first:
                self._set_aside = REMOTE_RETRY_AFTER
                self._outage_started = now
            else:
                self._set_aside = min(self._set_aside * 2, REMOTE_RETRY_MAX)
            self._down_until = now + self._set_aside
        if not first:
            logger.debug("compile cache: remote tier %s still unavailable (%s); next try in "
                         "%.0f s", self.url, exc, self._set_aside)  # fmt: skip
            return
        self._record(RemoteUnavailable(at=time.time(), remote=str(self.url), reason=str(exc)))
        logger.warning(
            "compile cache: remote tier %s (NEURON_LIBTORCH_REMOTE_CACHE) failed: %s; "
            "continuing with the local cache only (next try in %.0f s)",
            self.url,
            exc,
            REMOTE_RETRY_AFTER,
        )

    def key_failed(self, key: str, exc: BaseException) -> None:
        """A remote operation on `key` failed. A `KEY_DEFECTS` error (what a writer of the
        remote can leave at one key) is a defect of that key when a fresh probe of the
        remote still answers: one warning per key, the key is compiled here, and the
        remote stays in use for every other key. Anything else, or a probe that fails
        too, is the remote's (`failed`)."""
        if isinstance(exc, KEY_DEFECTS) and self._answers():
            if key not in self._key_defects:
                self._key_defects.add(key)
                logger.warning("compile cache: remote tier %s refused %s (%s), though it "
                               "answers otherwise; compiling that key here", self.url, key,
                               printable(str(exc), 500))  # fmt: skip
            return
        self.failed(exc)

    def _answers(self) -> bool:
        """Whether the remote answers a fresh probe now (one cheap request)."""
        with self._lock:
            store = self._store
            if store is None or (self._set_aside and self._clock() < self._down_until):
                return False
            try:
                probe_store(store)
            except Exception:  # noqa: BLE001 - the caller says it was the remote's
                return False
            return True

    @property
    def read_only(self) -> bool:
        """True when this process must not write to the remote: VLLM_NEURON_REMOTE_WRITE=off,
        or a write was refused (`write_denied`). Reads go on either way."""
        return self._write == "off" or self._denied is not None

    def write_denied(self, exc: BaseException) -> None:
        """A write to the remote was refused (``PermissionError``; on S3 ``AccessDenied``,
        `StoreAccessDenied`): from now on this process only reads the remote, as with
        VLLM_NEURON_REMOTE_WRITE=off, with one warning. Not an outage: reads go on."""
        with self._lock:
            if self._denied is not None:
                return
            self._denied = exc
            configured_off = self._write == "off"
        if configured_off:
            return
        logger.warning(
            "compile cache: remote tier %s (NEURON_LIBTORCH_REMOTE_CACHE) refused a write: "
            "%s; degrading to VLLM_NEURON_REMOTE_WRITE=off (read-only: promote with "
            "save_cache or `vllm-neuron cache promote` from a node that may write)",
            self.url,
            exc,
        )


def fetch_entry(
    remote: Store, key: str, local: Store, *, progress: Progress | None = None,
    policy: TrustPolicy | None = None, admit: Callable[[Verdict], bool] | None = None,
    sealed: bool = True,
) -> EntryRecord | None:
    """Publish the remote entry `key` in `local`, every file verified as it is copied
    (`progress(done, total)` as the bytes land, within each file).

    None when the remote has no such entry. `PublicationProblem` (an `EntryProblem`): the
    remote entry is defective - a broken publication (a commit record that does not read
    or names a version without files), a missing or unreadable record, a file that fails
    its check - and its `version` is the one judged (the caller quarantines that one).
    `FileNotFoundError`: it was withdrawn while being copied. `UntrustedEntry`: ``policy``
    requires a trusted signer and the entry has none (nothing is copied; ``admit``, default
    ``policy.admits``, decides and says so). Anything else: the remote (or the local disk)
    failed.

    The entry's signature (``entry.sig``) comes along, and the local record notes where the
    entry came from and which trusted key verified it (``fetched``: a local hit judges it
    again by that key id), sealed by the local tier's node key (`trust.origin`; not with
    ``sealed=False``: a throw-away tier that nobody judges again). Returns the local record.
    """
    found = remote.publication(key)
    if found.state == "absent":
        return None
    if found.problem is not None or found.prefix is None:
        raise PublicationProblem(str(found.problem), version=found.version)
    prefix = found.prefix
    try:
        # Bounded, regular files only: a record too large or a FIFO is this entry's defect
        # (`RecordError`), never read whole nor waited on, never an outage of the remote.
        record_bytes = remote.read(join(prefix, ENTRY_RECORD), max_size=RECORD_MAX_BYTES)
    except RecordError as exc:
        raise PublicationProblem(f"{remote.url}/{key}/{ENTRY_RECORD} is unreadable: "
                                 f"{exc.problem}", version=found.version) from exc  # fmt: skip
    if record_bytes is None:
        raise PublicationProblem(f"{remote.url}/{key}: {ENTRY_RECORD} is missing",
                                 version=found.version)  # fmt: skip
    try:
        record = decode_record(record_bytes, source=f"{remote.url}/{key}/{ENTRY_RECORD}")
    except RecordError as exc:
        raise PublicationProblem(f"{exc.source} is unreadable: {exc.problem}",
                                 version=found.version) from exc  # fmt: skip
    if record.key != key:
        raise PublicationProblem(f"{remote.url}/{key}: record names key "
                                 f"{printable(record.key, 100)}",
                                 version=found.version)  # fmt: skip
    try:
        signature = remote.read(join(prefix, SIGNATURE_FILE), max_size=RECORD_MAX_BYTES)
    except (OSError, RecordError):  # unreadable (too large, not a file): this entry's
        signature = b""  # problem (it is unsigned), not a remote outage
    verdict = None
    if policy is not None and policy.checking:
        verdict = policy.judge(record_bytes, signature, source=f"{remote.url}/{key}")
        if not verdict.trusted:
            admitted = (admit(verdict) if admit is not None
                        else policy.admits(key, remote.url, verdict, action="fetch"))  # fmt: skip
            if not admitted:
                raise UntrustedEntry(key, remote.url, verdict)
    unsound = _unsound_files(record)
    if unsound is not None:  # whoever wrote the record: a defect of this entry, no outage
        raise PublicationProblem(f"{remote.url}/{key}: {unsound}", version=found.version)
    with local.stage(key) as staging:
        try:
            copy_verified(remote, prefix, staging, record.files, progress=progress)
        except IntegrityError as exc:
            if remote.publication(key).version != found.version:
                raise FileNotFoundError(f"{remote.url}/{key} was withdrawn") from None
            raise PublicationProblem(str(exc), version=found.version) from None
        if signature is not None:
            staging.write(SIGNATURE_FILE, signature)
        record = msgspec.structs.replace(record, fetched=fetched_from(remote.url, verdict),
                                         compiled_on=msgspec.UNSET)  # fmt: skip
        if sealed:  # this node's word that it fetched it, and which key verified it then
            record = seal(local, record)
        else:
            record = msgspec.structs.replace(record, sealed=msgspec.UNSET)
        staging.write(ENTRY_RECORD, encode_record(record))
        fault_point("fetch.copied")
        staging.commit()
    return record


def _unsound_files(record: EntryRecord) -> str | None:
    """Why the files a fetched record lists cannot be an entry's (a name no store key may
    be - ``../x``, an absolute path - or a negative size), or None. Checked before any copy:
    the storage layer would refuse them with its own errors, which the flow takes for a
    remote that failed."""
    for name, digest in record.files.items():
        try:
            validate_key(name)
        except Exception as exc:  # noqa: BLE001 - InvalidKey, or a name that is no str
            return f"{ENTRY_RECORD} lists a file no entry may hold ({printable(name)}): {exc}"
        if digest.size < 0:
            return f"{ENTRY_RECORD} gives {printable(name)} a negative size"
    return None
