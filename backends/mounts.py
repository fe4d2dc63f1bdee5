"""Which filesystem a path lives on, from /proc/mounts.

The storage profile (local, NFS, Lustre) follows from the mount, because that is what
decides whether flock and rename can be trusted.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

NFS_TYPES = frozenset({"nfs", "nfs4"})
LUSTRE_TYPES = frozenset({"lustre"})


@dataclass(frozen=True)
class Mount:
    """One line of /proc/mounts."""

    point: str
    fstype: str
    options: tuple[str, ...]


def _unescape(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as octal (\040 ...).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mounts(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        mounts.append(Mount(_unescape(fields[1]), fields[2], tuple(fields[3].split(","))))
    return mounts


def _read_mounts() -> str:
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def mount_for(path: str, mounts_text: str | None = None) -> Mount | None:
    """The mount that contains `path` (longest matching mount point), or None."""
    text = _read_mounts() if mounts_text is None else mounts_text
    # Resolve symlinks: a symlinked /home must be judged by where it really lives.
    target = os.path.realpath(os.path.expanduser(path))
    best: Mount | None = None
    for mount in parse_mounts(text):  # on a tie (over-mount) the later line wins
        point = mount.point.rstrip("/") or "/"
        inside = target == point or target.startswith(point if point == "/" else point + "/")
        if inside and (best is None or len(point) >= len(best.point.rstrip("/") or "/")):
            best = mount
    return best


def filesystem_type(path: str, mounts_text: str | None = None) -> str:
    """The fstype of the mount holding `path` ("" when unknown)."""
    mount = mount_for(path, mounts_text)
    return mount.fstype if mount else ""


def profile_for(path: str, mounts_text: str | None = None) -> tuple[str, bool]:
    """(profile, kernel_locks_trustworthy) for a local path.

    NFS: leases (flock is emulated and some mounts make it a silent no-op). Lustre: a real
    cluster-wide flock only with the ``flock`` mount option; otherwise leases.
    """
    mount = mount_for(path, mounts_text)
    if mount is None:
        return "local", True
    if mount.fstype in NFS_TYPES:
        return "nfs", False
    if mount.fstype in LUSTRE_TYPES:
        return "lustre", "flock" in mount.options
    return "local", True
