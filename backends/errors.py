"""Errors raised by the storage layer.

Each error names what the user gave us (the URL, the key, the lock) so a failure in a
deployment can be traced to the setting that caused it without reading our code.
"""

from __future__ import annotations

from typing import Any


class StoreError(Exception):
    """Base class for every error the storage layer raises on purpose."""


class InvalidKey(StoreError, ValueError):
    """A key would escape the store root or is not a well-formed relative path."""


class UnknownScheme(StoreError, ValueError):
    """`open_store` was given a URL scheme it has no backend for."""


class InvalidLocation(StoreError, ValueError):
    """A location that cannot be what its writer meant: a mangled URL of a registered scheme
    (``s3:/bucket/x``, ``s3:bucket``), which would otherwise open as a local directory named
    ``s3:``, or a URL missing a part its scheme needs (``s3://`` without a bucket). The
    message names the location and, when it can, the URL that was probably meant."""


class MissingDependency(StoreError, ImportError):
    """The backend for a scheme needs an optional package that is not installed."""


class StoreUnavailable(StoreError, OSError):
    """The backend could not be reached (endpoint down, mount gone, credentials refused)."""


class StoreMissing(StoreUnavailable):
    """The store's root does not exist: an S3 bucket that is not there (``NoSuchBucket``), a
    local root directory that a reader finds missing. Never a `FileNotFoundError`, so no
    caller mistakes a missing bucket for a missing key (a miss)."""


class StoreAccessDenied(StoreUnavailable, PermissionError):
    """The store refused this caller: S3 ``AccessDenied`` (or another 403: a bad key, a bad
    signature), a root directory it may not read. A `PermissionError` too, so a caller that
    handles a refused write (``except PermissionError``) sees local and S3 refusals alike."""


class LockTimeout(StoreError, TimeoutError):
    """A lock was not acquired within the timeout the caller asked for."""


class LeaseUnusable(StoreError):
    """A lease that cannot be taken at all: its directory is no directory (a file planted in
    its place on a folder store), so no generation record can be created. Raised once the
    lock has waited one of its own periods on it ("busy, held by an unknown owner"): the
    caller goes on without the lease, for that name only, never takes it for the store's
    outage."""


class PublicationStuck(StoreError):
    """A broken commit record of one key that a commit could not replace within its one
    deadline (`publication.REPAIR_ATTEMPTS` times `TOMBSTONE_PATIENCE`): its withdrawal is
    held by a tombstone someone keeps rewriting (or a killed withdrawer's). A defect of that
    key, never the store's outage: the caller serves its own copy and goes on."""


class LeaseLost(StoreError):
    """A lease holder discovered that its lease expired and another holder took over.

    Work done under a lost lease must not be committed: the generation (fencing token)
    it carries is older than the current one.
    """


class IntegrityError(StoreError):
    """A file is missing, or its size or a checksum is not the one it must have.

    Raised by the checking operations (`check_sizes`, `copy_verified`); ``rel`` names the
    file relative to the checked prefix, ``where`` the prefix (URL and key), ``problem``
    what is wrong ("is missing", "fails its BLAKE3 check", ...).
    """

    def __init__(self, where: str, rel: str, problem: str) -> None:
        super().__init__(f"{where}: {rel} {problem}")
        self.where, self.rel, self.problem = where, rel, problem

    def __reduce__(self) -> tuple[type[IntegrityError], tuple[str, str, str]]:
        return type(self), (self.where, self.rel, self.problem)


class RecordError(StoreError, ValueError):
    """A persisted record that cannot be read: `source` (the file) and `problem`."""

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem

    def __reduce__(self) -> tuple[Any, ...]:  # raised in worker processes, pickled back
        return type(self), (self.source, self.problem)


class NotRegularFile(RecordError):
    """The file at a key is not a regular file (a FIFO, a device, a socket, a directory or
    a symbolic link): nothing this layer writes, so a defect of that path, never followed
    nor opened for reading in a way that blocks (folder stores, `backends/regular.py`).

    A `RecordError`, so every record reader treats it as the defective record it stands
    for (a miss, a quarantine, a note that says nothing), and never an `OSError`, which
    callers read as a full or read-only disk or an unreachable remote."""


class RecordTooLarge(RecordError):
    """A record larger than its reader's bound (`RECORD_MAX_BYTES`): a defect of that
    record, of which at most the bound plus one byte was read."""


class ListingTooLarge(RecordError):
    """A folder holding more names than its reader's bound (`list_dir`'s ``max_names``):
    on a shared tier, millions of names a writer without a key planted in a lease folder,
    a version folder or a notes folder. A defect of that folder (and the key it belongs
    to), never listed whole: at most the bound plus one name was read."""


def too_many_names(url: str, prefix: str, bound: int) -> ListingTooLarge:
    """The `ListingTooLarge` of folder `prefix` of the store at `url`."""
    return ListingTooLarge(f"{url}/{prefix}", f"holds more than the {bound} names its "
                                              "reader lists; not listed further")  # fmt: skip
