"""The optional remote tier of the compile cache: reaching it, and fetching from it.

The remote tier is best-effort: when it cannot be opened or a request fails, there is one
warning and the node carries on with its local tier alone for `REMOTE_RETRY_AFTER`
seconds (`RemoteTier`). A fetch copies a published remote entry into a local staging area
with the storage layer's verified copy (every file checked as it is copied: BLAKE3 when
recorded, else SHA-256), writes the record last and publishes (`fetch_entry`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from vllm_neuron.backends import IntegrityError, Record, Store, copy_verified, join, open_store
from vllm_neuron.backends.records import RecordError

from .entry import ENTRY_RECORD, EntryProblem, EntryRecord, decode_record
from .events import RemoteUnavailable

logger = logging.getLogger("vllm_neuron.compile")

REMOTE_RETRY_AFTER = 60.0


class RemoteTier:
    """The remote store, opened on first use and set aside for a while after a failure."""

    def __init__(
        self, url: str | None, options: Mapping[str, Any], record: Callable[[Record], None]
    ) -> None:
        self.url = url
        self._options = dict(options)
        self._record = record
        self._store: Store | None = None
        self._down_until = 0.0
        self._warned = False
        self._read_only = False

    def store(self) -> Store | None:
        """The remote store, or None when unset or currently unreachable."""
        if self.url is None or time.monotonic() < self._down_until:
            return None
        if self._store is None:
            try:
                self._store = open_store(self.url, **self._options)
            except Exception as exc:  # noqa: BLE001 - the remote is best-effort
                self.failed(exc)
                return None
        return self._store

    def failed(self, exc: BaseException) -> None:
        """The remote failed: record it, warn once, and leave it alone for a while."""
        self._down_until = time.monotonic() + REMOTE_RETRY_AFTER
        self._record(RemoteUnavailable(at=time.time(), remote=str(self.url), reason=str(exc)))
        if not self._warned:
            self._warned = True
            logger.warning(
                "compile cache: remote tier %s (NEURON_LIBTORCH_REMOTE_CACHE) failed: %s; "
                "continuing with the local cache only",
                self.url,
                exc,
            )

    @property
    def read_only(self) -> bool:
        """True once a write was denied: the remote is then read from, never written."""
        return self._read_only

    def write_denied(self, exc: BaseException) -> None:
        """A write to the remote was refused (permissions): go on as with
        VLLM_NEURON_REMOTE_WRITE=off, with one warning."""
        if self._read_only:
            return
        self._read_only = True
        logger.warning(
            "compile cache: the remote tier %s (NEURON_LIBTORCH_REMOTE_CACHE) refused a "
            "write: %s; using it read-only, as with VLLM_NEURON_REMOTE_WRITE=off",
            self.url,
            exc,
        )


def fetch_entry(remote: Store, key: str, local: Store) -> EntryRecord | None:
    """Publish the remote entry `key` in `local`, every file verified as it is copied.

    None when the remote has no such entry. `EntryProblem`: the remote entry is defective
    (the caller quarantines it). `FileNotFoundError`: it was withdrawn while being copied.
    Anything else: the remote (or the local disk) failed.
    """
    prefix = remote.published(key)
    if prefix is None:
        return None
    record_bytes = remote.read(join(prefix, ENTRY_RECORD))
    if record_bytes is None:
        raise EntryProblem(f"{remote.url}/{key}: {ENTRY_RECORD} is missing")
    try:
        record = decode_record(record_bytes, source=f"{remote.url}/{key}/{ENTRY_RECORD}")
    except RecordError as exc:
        raise EntryProblem(f"{exc.source} is unreadable: {exc.problem}") from exc
    if record.key != key:
        raise EntryProblem(f"{remote.url}/{key}: record names key {record.key}")
    with local.stage(key) as staging:
        try:
            copy_verified(remote, prefix, staging, record.files)
        except IntegrityError as exc:
            if remote.published(key) != prefix:
                raise FileNotFoundError(f"{remote.url}/{key} was withdrawn") from None
            raise EntryProblem(str(exc)) from None
        staging.write(ENTRY_RECORD, record_bytes)
        staging.commit()
    return record
