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

import os
import stat

from vllm_neuron.backends import Store
from vllm_neuron.backends.writable import (
    LOCAL_DISK_FULL_OR_READ_ONLY,
    UNWRITABLE,
    directory_problem,
    free_bytes,
    mib,
    unwritable_cause,
    why_unwritable,
)

local_tier_problem = directory_problem  # the tier's probe is the generic one

__all__ = [
    "UNWRITABLE",
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
    "make_private_dirs",
    "not_own_tier",
    "why_unwritable",
]

COMPILE_SPACE_RESERVE = 64 << 20
"""Free bytes a filesystem must have before a compile writes there. AOTInductor packaging
onto a filesystem that runs out of space aborts the whole process in C++ (``unexpected
pos``), which no ``except`` catches: a compile goes where this much is free, or fails with
an error that says so."""


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


def make_private_dirs(path: str) -> None:
    """Create the missing directories of ``path`` ``0700`` (whatever the umask), so that a
    tier made here passes `not_own_tier` at the next start; what exists is left as it is.
    Best-effort: a directory that cannot be made is the write probe's to report."""
    missing = []
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return


def not_own_tier(path: str) -> str | None:
    """Why the directory ``path`` is not this node's own tier - one that no other local user
    can change - or None when it is.

    Decided by the filesystem, never by how the tier was named: ``path`` itself (followed to
    where it really is) belongs to this user and no group or other may write it; every
    directory above it, on the path as given and on the real path, belongs to this user or
    root and no group or other may write it, unless it is sticky (as ``/tmp`` is: nobody
    else can rename or remove what this user made there). A part that does not exist yet
    is made by this user later and is not judged. As root every root-owned directory is
    this user's."""
    uid = os.getuid()
    leaf = os.path.realpath(path)
    chains: list[str] = []
    for start in (os.path.abspath(path), leaf):
        current = start
        while True:
            if current not in chains:
                chains.append(current)
            parent = os.path.dirname(current)
            if parent == current:
                break
            current = parent
    for directory in chains:
        try:
            info = os.stat(directory)
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"{directory}: cannot look at it ({exc.strerror})"
        mode = stat.S_IMODE(info.st_mode)
        if not stat.S_ISDIR(info.st_mode):
            return f"{directory} is not a directory"
        if directory == leaf:
            if info.st_uid != uid:
                return (f"{directory} belongs to uid {info.st_uid}, not to this user (uid "
                        f"{uid}): another user could replace what this process would load")
            if mode & 0o022:
                return (f"{directory} is writable by group or others (mode {mode:04o}): they "
                        "could replace what this process would load; chmod go-w it")
            continue
        if info.st_uid not in (0, uid):
            return (f"{directory}, above the tier, belongs to uid {info.st_uid}: that user "
                    "could put another directory in the tier's place")
        if mode & 0o022 and not mode & stat.S_ISVTX:
            return (f"{directory}, above the tier, is writable by group or others (mode "
                    f"{mode:04o}, not sticky): they could put another directory in the "
                    "tier's place")
    return None
