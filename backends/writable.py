"""Whether a place on local disk can take files, and why not, in words a warning can quote.

Why here, in the storage layer: every feature that writes (the compile cache's tiers, the
snapshot root, a profile capture's run directory) must tell "this place cannot take files"
(no space, read-only, refused) from "this write was bad", and say it the same way
(``no space left: 0.9 MiB free``). The probe is a real write, not ``access()``, which
answers wrongly on NFS with root squashing and on read-only bind mounts.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile

__all__ = [
    "LOCAL_DISK_FULL_OR_READ_ONLY",
    "UNWRITABLE",
    "directory_problem",
    "free_bytes",
    "mib",
    "unwritable_cause",
    "why_unwritable",
]

# Failures of a write that say "this place cannot take files", not "this file is bad".
UNWRITABLE = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
              errno.EPERM: "operation not permitted", errno.ENOSPC: "no space left",
              errno.EDQUOT: "disk quota exceeded"}  # fmt: skip


LOCAL_DISK_FULL_OR_READ_ONLY = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
"""The faults a copy into the local tier can only owe to the local disk (a remote that
refuses access says EACCES, which stays the remote's)."""


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def free_bytes(path: str) -> int | None:
    """Bytes free for this user on ``path``'s filesystem (its nearest existing ancestor)."""
    probe = path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def unwritable_cause(exc: BaseException, under: str | None = None) -> OSError | None:
    """The OSError in ``exc``'s chain of causes (``raise ... from``: a toolchain wraps the
    failure of its own writes in its error) that says a place cannot take files, if any.

    A full disk or a read-only filesystem (ENOSPC, EDQUOT, EROFS) is the place's wherever
    it is met; a refused permission (EACCES, EPERM) only when the path it names is under
    ``under`` (the tier): a compiler's own work directory refusing it is the compile's
    failure. Only an ``Exception`` counts: an interrupt is never a disk fault."""
    seen: BaseException | None = exc
    for _ in range(16):  # a chain is short; a cycle must not loop
        if seen is None or not isinstance(seen, Exception):
            return None
        if isinstance(seen, OSError) and seen.errno in UNWRITABLE:
            if seen.errno in LOCAL_DISK_FULL_OR_READ_ONLY:
                return seen
            name = os.fspath(seen.filename) if seen.filename is not None else ""
            if under and isinstance(name, str) and name.startswith(under.rstrip("/") + "/"):
                return seen
        seen = seen.__cause__
    return None


def why_unwritable(exc: OSError, path: str) -> str | None:
    """A short reason (``no space left: 0.9 MiB free``) when ``exc`` says ``path``'s
    filesystem cannot take files; None for any other failure."""
    reason = UNWRITABLE.get(exc.errno or 0)
    if reason is None:
        return None
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        with contextlib.suppress(OSError):  # the free space is a detail of the reason
            reason += f": {mib(shutil.disk_usage(path).free)} free"
    return reason


def directory_problem(path: str) -> str | None:
    """Why the directory ``path`` (created if missing) cannot take files, or None.

    One real write: create the directory, create and remove a probe file in it."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=path)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        reason = why_unwritable(exc, path)
        if reason is None:
            return f"{type(exc).__name__}: {exc}"
        return f"{reason} ({exc.strerror}: {exc.filename or path})"
    return None
