"""What the host toolchain keeps on a node beside the entries - torch's precompiled headers
(140-156 MB each, one per ISA), the kept AOTInductor runtime objects (aoti_runtime_store.py)
and Inductor's own cache directory - kept in the local tier, bounded and collected.

**Where.** In the local tier's dot-directory `NODE_DIR` (``<tier>/.node``), one *group* per
(interpreter, torch installation): ``.node/<group>/`` with ``headers/`` (torch's
``_HEADER_DIR``, one header per ISA and flags, as torch names them), ``runtime/`` (the kept
objects), ``inductor/`` (``TORCHINDUCTOR_CACHE_DIR`` unless the user set it) and `OWNER`,
a record naming the interpreter and torch it is for, rewritten at each process's first use
(its time is the group's last use). Every directory is made ``0700`` and used only when
private (private_dirs.py `why_not_private`): a world-writable, non-sticky ``/tmp`` (a
Kubernetes ``emptyDir``) changes nothing. Entry listings never see it (a dot-name).

The process that opens the local tier names it (`use_tier`, through
``_VLLM_NEURON_NODE_FILES``, inherited by the workers and the probe it starts). A process
with no writable local tier of its own (a read-only tier: its stand-in is shared, so it is
no place for files a process removes when it exits; or none named) keeps its group in a
throwaway directory (`THROWAWAY_PREFIX`, in the private temporary root), removed when it
exits, and one a killed process left is removed by the next one: nothing of ours stays in
``$TMPDIR``. Such a process builds its headers again (seconds, once per process).

**In use.** A process using a group holds, for its life, a kernel lock of its own in the
group's ``users/`` (dropped by the kernel when it dies), taken under the group's lock
``.node/<group>.lock``; `remove_group` takes that group lock, finds no live user, takes
torch's header build locks (torn_headers.py), then removes the group: nothing a live process
reads or builds is ever removed. Removal is `cache gc`'s (`collectable`: an interpreter or
torch that no longer exists, or unused for `UNUSED_SECONDS`) and the size bound's (idle
groups count toward it and go first: upkeep/eviction.py).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import logging
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from vllm_neuron.backends import (
    PRIVATE_FILE,
    KernelLock,
    LockTimeout,
    Record,
    RecordCodec,
    encode,
    open_store,
)
from vllm_neuron.envs.compile_cache import load_node_files_dir, set_node_files_dir

from . import private_dirs
from .private_dirs import make_private_dir, private_temp_root

__all__ = ["NODE_DIR", "OWNER", "THROWAWAY_PREFIX", "UNUSED_SECONDS", "NodeGroup",
           "NodeFilesOwner", "collectable", "group_dir", "node_groups", "remove_group",
           "secure_inductor_dirs", "sweep_header_debris", "torch_loader_scratch",
           "use_tier"]  # fmt: skip

logger = logging.getLogger("vllm_neuron.compile")

NODE_DIR = ".node"
"""The local tier's dot-directory of node files."""
OWNER = "owner.json"
"""In a group: whose it is (`NodeFilesOwner`)."""
USERS = "users"
THROWAWAY_PREFIX = "vllm_neuron_node_"
"""A process's own group directory in the temporary root: ``<prefix><pid>_<random>``."""
UNUSED_SECONDS = 14 * 86400.0
"""`cache gc` removes a group no process has started using for this long."""
DEBRIS_SECONDS = 3600.0
"""A header build's ``.gch.<pid>.<thread>.tmp`` this old (or its writer dead) is removed."""


class NodeFilesOwner(Record, frozen=True, tag="node-files-owner"):
    """For whom a group's files were made: the interpreter (its real path), torch's
    installation directory and version; `used`: the last process start that used it."""

    interpreter: str
    torch_dir: str
    torch_version: str
    used: float


OWNERS: RecordCodec[NodeFilesOwner] = RecordCodec(NodeFilesOwner)

_LOCK = threading.Lock()
_held: list[KernelLock] = []  # this process's user lock: held for its life


def use_tier(local_dir: str) -> None:
    """The local tier at `local_dir` (writable by this process) keeps this process's node
    files, and those of the processes it starts."""
    set_node_files_dir(os.path.join(local_dir, NODE_DIR))


def secure_inductor_dirs() -> None:
    """private_dirs.py `secure_inductor_dirs`, Inductor's cache and headers in this
    process's group: what every compile of ours calls before torch's first."""
    private_dirs.secure_inductor_dirs(group_dir)


def _identity() -> NodeFilesOwner:
    import torch

    return NodeFilesOwner(interpreter=os.path.realpath(sys.executable),
                          torch_dir=os.path.realpath(os.path.dirname(torch.__file__)),
                          torch_version=str(torch.__version__), used=time.time())  # fmt: skip


def _group_name(owner: NodeFilesOwner) -> str:
    text = "\0".join((owner.interpreter, owner.torch_dir, owner.torch_version))
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def group_dir() -> str:
    """This process's group directory (see the module), registered as in use; made once."""
    with _LOCK:
        owner = _identity()
        base = load_node_files_dir()
        why = "no local tier named it" if base is None else (_why_not_on_a_command_line(base)
                                                             or _why_no_room(base)
                                                             or make_private_dir(base))
        if why is None and base is not None:
            try:
                return _register(base, _group_name(owner), owner)
            except OSError as exc:
                why = str(exc)
        throwaway = _throwaway()
        # A tier that was named but cannot keep them costs every process its headers: said.
        # A tier without room is said where the tier fills (its writes warn): info here.
        quiet = base is None or (why or "").startswith("its filesystem has")
        logger.log(logging.INFO if quiet else logging.WARNING,
                   "vllm_neuron: precompiled headers and runtime objects are kept in %s, "
                   "removed when this process exits (%s)", throwaway,
                   why if base is None else f"{base}: {why}")  # fmt: skip
        return _register(throwaway, "group", owner)


MIN_FREE = 1 << 30
"""Free bytes a tier's filesystem must have for node files to go there: a precompiled header
is 140-156 MB, and a header that cannot be written fails the compile that builds it (a full
tier must cost a tier's write, never a compile)."""


def _why_no_room(base: str) -> str | None:
    """Why the filesystem of `base` (or of its nearest existing parent) has no room for node
    files (`MIN_FREE`), or None."""
    probe = base
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        free = shutil.disk_usage(probe).free
    except OSError as exc:
        return f"its free space cannot be read ({exc.strerror})"
    if free < MIN_FREE:
        return f"its filesystem has {free} bytes free, under {MIN_FREE} (a header is ~150 MB)"
    return None


def _why_not_on_a_command_line(path: str) -> str | None:
    """Why torch could not compile with files under `path`, or None: torch writes a compile's
    paths into one command line unquoted and splits it again (``shlex``), so a path with a
    space, a quote or another character the shell treats specially would be cut in two."""
    if shlex.quote(path) == path:
        return None
    return (f"its path {path!r} holds a character torch's compile command line cannot carry "
            "(a space, a quote...)")


def _register(base: str, name: str, owner: NodeFilesOwner) -> str:
    group = os.path.join(base, name)
    with _group_lock(base, name, timeout=None):
        for directory in (group, os.path.join(group, USERS)):
            why = make_private_dir(directory)
            if why is not None:
                raise OSError(f"{directory}: {why}")
        mine = os.path.join(group, USERS, f"{os.getpid()}.lock")
        if not any(held.path == mine and held.held for held in _held):  # once per group
            user = KernelLock(mine, name=f"node files {name} in use")
            user.acquire(timeout=0)
            _held.append(user)
        open_store(group, create=False, profile="local").write(OWNER, encode(owner),
                                                               mode=PRIVATE_FILE)  # fmt: skip
    for sub in ("headers", "runtime", "inductor"):
        why = make_private_dir(os.path.join(group, sub))
        if why is not None:
            raise OSError(f"{os.path.join(group, sub)}: {why}")
    sweep_header_debris(os.path.join(group, "headers"))
    return group


@contextlib.contextmanager
def _group_lock(base: str, name: str, *, timeout: float | None) -> Iterator[None]:
    lock = KernelLock(os.path.join(base, f"{name}.lock"), name=f"node files {name}")
    lock.acquire(timeout=timeout)
    try:
        yield
    finally:
        lock.release()


def _throwaway() -> str:
    """A new private directory of this process in the temporary root, removed at exit;
    what killed processes left there is removed first."""
    root = private_temp_root()
    for name in os.listdir(root):
        pid = name.removeprefix(THROWAWAY_PREFIX).split("_", 1)[0]
        if name.startswith(THROWAWAY_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    directory = tempfile.mkdtemp(prefix=f"{THROWAWAY_PREFIX}{os.getpid()}_", dir=root)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_header_debris(headers: str, *, now: float | None = None) -> int:
    """Remove the ``<header>.gch.<pid>.<thread>.tmp`` files header builds killed mid-way left
    (torn_headers.py `publish_by_rename`): once their writer is gone or they are an hour
    old. How many were removed."""
    now = time.time() if now is None else now
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(headers):
            parts = name.split(".")
            if len(parts) < 4 or parts[-1] != "tmp" or ".gch." not in name:
                continue
            path = os.path.join(headers, name)
            with contextlib.suppress(OSError):
                writer = int(parts[-3]) if parts[-3].isdigit() else 0
                if not _alive(writer) or now - os.stat(path).st_mtime > DEBRIS_SECONDS:
                    os.unlink(path)
                    removed += 1
    return removed


# ------------------------------------------------------------------ collection
@dataclass(frozen=True)
class NodeGroup:
    """One group of a tier's node files: its name, bytes, owner record (None when it does
    not read), last use, and whether a live process uses it now."""

    name: str
    size: int
    owner: NodeFilesOwner | None
    last_used: float
    in_use: bool


def node_groups(local_dir: str) -> list[NodeGroup]:
    """The node-file groups of the local tier at `local_dir`."""
    base = os.path.join(local_dir, NODE_DIR)
    try:
        names = sorted(n for n in os.listdir(base) if os.path.isdir(os.path.join(base, n)))
    except FileNotFoundError:
        return []
    store = open_store(base, create=False, profile="local")
    out = []
    for name in names:
        size = sum(info.size for info in store.iter_files(name))
        owner: NodeFilesOwner | None
        try:
            data = store.read(f"{name}/{OWNER}", max_size=1 << 16)
            owner = None if data is None else OWNERS.decode(data)
        except Exception:  # noqa: BLE001 - an owner that does not read: collectable
            owner = None
        info = store.info(f"{name}/{OWNER}")
        used = info.mtime if info is not None else 0.0
        out.append(NodeGroup(name, size, owner, used, _users_alive(os.path.join(base, name))))
    return out


def collectable(group: NodeGroup, *, now: float | None = None) -> str | None:
    """Why `cache gc` removes `group` (its interpreter or torch is gone, or it has not been
    used for `UNUSED_SECONDS`), or None."""
    now = time.time() if now is None else now
    owner = group.owner
    if owner is None:
        return "its owner record is missing or does not read"
    if not os.path.exists(owner.interpreter):
        return f"its interpreter {owner.interpreter} no longer exists"
    if not os.path.isdir(owner.torch_dir):
        return f"its torch {owner.torch_dir} no longer exists"
    if now - group.last_used > UNUSED_SECONDS:
        return f"unused for {(now - group.last_used) / 86400:.0f} days"
    return None


def _users_alive(group: str) -> bool:
    """Whether a live process holds its user lock in `group` (a dead one's file goes)."""
    users = os.path.join(group, USERS)
    try:
        names = os.listdir(users)
    except FileNotFoundError:
        return False
    alive = False
    for name in names:
        lock = KernelLock(os.path.join(users, name), name=f"node files user {name}")
        try:
            lock.acquire(timeout=0)
        except LockTimeout:
            alive = True
            continue
        with contextlib.suppress(OSError):
            os.unlink(lock.path)
        lock.release()
    return alive


def remove_group(local_dir: str, name: str) -> bool:
    """Remove group `name` of the tier at `local_dir` unless a live process uses it or
    builds one of its headers (see the module); whether it was removed."""
    base = os.path.join(local_dir, NODE_DIR)
    group = os.path.join(base, name)
    try:
        with _group_lock(base, name, timeout=0):
            if _users_alive(group):
                return False
            with _header_locks(os.path.join(group, "headers", "locks")):
                open_store(base, create=False, profile="local").delete_tree(name)
                with contextlib.suppress(OSError):
                    os.rmdir(group)
    except LockTimeout:
        return False
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(base, f"{name}.lock"))
    return True


@contextlib.contextmanager
def _header_locks(lock_dir: str) -> Iterator[None]:
    """Every build lock torch holds in `lock_dir`, taken without waiting (LockTimeout when
    one is held): the same kernel locks as torch's ``FileLock``."""
    with contextlib.ExitStack() as held:
        with contextlib.suppress(FileNotFoundError):
            for name in sorted(os.listdir(lock_dir)):
                lock = KernelLock(os.path.join(lock_dir, name), name=f"header {name}")
                lock.acquire(timeout=0)
                held.callback(lock.release)
        yield


# ------------------------------------------------------------------ torch's loader
_LOADER_LOCK = threading.Lock()


@contextlib.contextmanager
def torch_loader_scratch() -> Iterator[None]:
    """For a call of torch's package loader: the ``aotinductor_*`` directory it unpacks a
    package into (under ``TMPDIR``, read by its C++ at the call, removed only when the
    model is destroyed) goes into a private directory of ours, removed after the call (the
    opened shared object needs no file). One such load at a time in a process."""
    with _LOADER_LOCK:
        scratch = tempfile.mkdtemp(prefix=f"{THROWAWAY_PREFIX}{os.getpid()}_load_",
                                   dir=private_temp_root())  # fmt: skip
        before = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = scratch
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = before
            shutil.rmtree(scratch, ignore_errors=True)
