"""Whether this process can use its local tier at all, and why not: found once, at start.

Why: a compile cache is an optimisation. A cache root on a read-only filesystem (a hardened
pod's ``readOnlyRootFilesystem``), one this user may not write, or one with no space left
must not stop a compile or a request: the process runs as with the cache disabled and says
so once, naming the setting and the reason. The probe is a real write (a file created and
removed in the tier's directory), not ``access()``, which answers wrongly on NFS with root
squashing and on read-only bind mounts.

A fallback directory in a shared ``/tmp`` (the local tier's home when the default root is on
NFS) must also be this user's own: one that another local user created first, or that group
or others may write, would let that user replace the code this process loads. It is created
``0700``, and refused (the cache bypassed) when it is not owned by this user or is writable
by others.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile

from vllm_neuron.backends import Store

__all__ = [
    "COMPILE_SPACE_RESERVE",
    "LOCAL_DISK_FULL_OR_READ_ONLY",
    "LocalTierFault",
    "LocalTierUnusable",
    "free_bytes",
    "mib",
    "tier_dir",
    "unwritable_cause",
    "check_private_directory",
    "local_tier_problem",
    "why_unwritable",
]

# Failures of a write that say "this place cannot take files", not "this file is bad".
UNWRITABLE = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
              errno.EPERM: "operation not permitted", errno.ENOSPC: "no space left",
              errno.EDQUOT: "disk quota exceeded"}  # fmt: skip


COMPILE_SPACE_RESERVE = 64 << 20
"""Free bytes a filesystem must have before a compile writes there. AOTInductor packaging
onto a filesystem that runs out of space aborts the whole process in C++ (``unexpected
pos``), which no ``except`` catches: a compile goes where this much is free, or fails with
an error that says so."""

LOCAL_DISK_FULL_OR_READ_ONLY = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
"""The faults a copy into the local tier can only owe to the local disk (a remote that
refuses access says EACCES, which stays the remote's)."""


class LocalTierFault(RuntimeError):
    """A write to the local tier failed for a reason of the place, not of the graph (no
    space, read-only, no permission): the graph is served from a scratch area instead."""


class LocalTierUnusable(RuntimeError):
    """The local tier cannot be used by this process; the message says which setting and
    why (the caller bypasses the tier, or refuses to start in pre-compiled-only mode)."""


def tier_dir(local: Store) -> str | None:
    """The tier's directory on local disk, or None (a tier that is not a directory)."""
    staging_dir = local.local_dir_of(".staging")
    return os.path.dirname(staging_dir) if staging_dir else None


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


def local_tier_problem(path: str) -> str | None:
    """Why the directory ``path`` (created if missing) cannot hold the local tier, or None.

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


def check_private_directory(path: str) -> str:
    """``path``, created ``0700`` if missing; raises :class:`LocalTierUnusable` when it is not
    a real directory owned by this user, or when group or others may write it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise LocalTierUnusable(f"{path}: cannot create it ({exc.strerror})") from exc
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise LocalTierUnusable(f"{path} is not a directory of its own (a link or a file)")
    if info.st_uid != os.getuid():
        raise LocalTierUnusable(
            f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}): "
            "another user created it first, and could replace what this process would load"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise LocalTierUnusable(
            f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):04o}): they "
            "could replace what this process would load; make it 0700 or remove it"
        )
    return path
