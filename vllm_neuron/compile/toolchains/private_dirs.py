"""Directories whose contents go into an artifact, used only where no other user can change them.

What a builder compiles is signed and published to the fleet, so every directory its bytes
pass through on the way is one more place an unprivileged user of the node could plant code:
Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, by default the temporary directory's
``torchinductor_<user>``) with the precompiled headers every wrapper and kernel is compiled
with, the compile jobs' directories (workers/job_dirs.py) and the kept AOTInductor runtime
objects (aoti_runtime_store.py). Each is used only when it is *private* (`why_not_private`):

- the directory itself is this user's (no symbolic link), writable by no one else;
- every directory above it belongs to root or this user and is writable by no one else, or
  is sticky (as ``/tmp`` is), so no one else can rename it away and put another in its place.

A directory of ours is made ``0700`` when it does not exist yet. A world-writable parent that
is not sticky (a Kubernetes ``emptyDir`` mounted at ``/tmp``) is refused even for a directory
we have just made ``0700``: anyone who can write the parent can rename ours away and put
their own under its name between our check and the compiler's next open, and the compiler
opens by path. A directory that is refused is not used: a private one of our own is used
instead (`private_fallback`: under this user's cache root, ``$XDG_CACHE_HOME/vllm`` or
``~/.cache/vllm``), said once in a warning that names the directory and why.

Inductor is pointed at its private directory by ``TORCHINDUCTOR_CACHE_DIR`` (read by torch
at every use) before its first compile (`secure_inductor_dirs`): unless the user set it, the
local tier's node files (node_files.py); its precompiled headers ignore that variable (torch
puts them under its *default* directory in the temporary directory, fixed when
``torch._inductor.codecache`` is imported), so they are always moved into the local tier's
node files too. Torch's private names
are used here only, each looked up with a fallback: a torch laid out otherwise keeps its own
behaviour, said once.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import re
import stat
import tempfile
import threading
from collections.abc import Callable

from vllm_neuron.envs import default_cache_root

__all__ = ["INDUCTOR_CACHE_DIR", "PRIVATE_DIR", "make_private_dir", "private_fallback",
           "private_temp_root", "secure_inductor_dirs", "why_not_a_temp_root",
           "why_not_private"]  # fmt: skip

logger = logging.getLogger("vllm_neuron.compile")

INDUCTOR_CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR"
"""The variable torch reads (at every use) for Inductor's cache directory."""
PRIVATE_DIR = os.path.join("neuron", "private")
"""Under this user's cache root: where a refused directory's private replacement is made."""

_WARNED: set[str] = set()
_LOCK = threading.Lock()
_inductor_done = False


def why_not_private(directory: str) -> str | None:
    """None when no other user can change what `directory` holds (see the module); else
    why not, in words for a warning."""
    uid = os.getuid()
    try:
        st = os.lstat(directory)
    except OSError as exc:
        return f"it cannot be examined ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != uid:
        return f"it belongs to uid {st.st_uid}, not this user (uid {uid})"
    if st.st_mode & 0o022:
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return _why_not_private_above(directory)


def _why_not_private_above(directory: str) -> str | None:
    """Why another user could put a directory of theirs in `directory`'s place (see the
    module), or None: every directory above it is root's or this user's, and writable by
    no one else or sticky."""
    uid = os.getuid()
    parent = os.path.dirname(os.path.abspath(directory))
    while True:
        try:
            st = os.stat(parent)
        except OSError as exc:
            return f"the directory above it, {parent}, cannot be examined ({exc.strerror})"
        if st.st_uid not in (0, uid):
            return (f"the directory above it, {parent}, belongs to uid {st.st_uid}, who can "
                    "replace it")  # fmt: skip
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"the directory above it, {parent}, is writable by others and not sticky "
                    f"(mode {stat.S_IMODE(st.st_mode):04o}): another user can put a directory "
                    "of theirs in its place")  # fmt: skip
        if os.path.dirname(parent) == parent:
            return None
        parent = os.path.dirname(parent)


def make_private_dir(directory: str) -> str | None:
    """`directory`, made ``0700`` (its missing parents too, whatever the umask: a parent
    made ``0777`` under umask 0 would refuse it) when absent; None when it is private
    (`why_not_private`), else why not."""
    try:
        _make_parents(os.path.dirname(os.path.abspath(directory)))
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"it cannot be made ({exc.strerror})"
    return why_not_private(directory)


def _make_parents(parent: str) -> None:
    """The missing directories of `parent`, each made ``0700`` (at most, whatever the umask)."""
    missing = []
    while not os.path.isdir(parent) and os.path.dirname(parent) != parent:
        missing.append(parent)
        parent = os.path.dirname(parent)
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)


def private_fallback(name: str) -> str:
    """This user's own directory `name` under its cache root (`PRIVATE_DIR`), made ``0700``;
    an OSError naming it when it is not private either."""
    directory = os.path.join(default_cache_root(), PRIVATE_DIR, f"{name}-{os.getuid()}")
    why = make_private_dir(os.path.dirname(directory)) or make_private_dir(directory)
    if why is not None:
        raise OSError(f"no private directory for {name}: {directory}: {why}")
    return directory


def _warn_once(directory: str, why: str, instead: str) -> None:
    if directory not in _WARNED:
        _WARNED.add(directory)
        logger.warning("vllm_neuron: %s is not used: %s; what is compiled here goes into "
                       "artifacts, so %s", directory, why, instead)  # fmt: skip


def private_temp_root() -> str:
    """Where compile jobs are made: the temporary directory when it is private or sticky
    (as ``/tmp`` is: each job directory is then made ``0700`` in it), else this user's own
    (`private_fallback`, said once); an OSError when there is neither."""
    root = tempfile.gettempdir()
    why = why_not_a_temp_root(root)
    if why is None:
        return root
    fallback = private_fallback("tmp")
    _warn_once(root, why, f"compile jobs are made in {fallback}")
    return fallback


def why_not_a_temp_root(root: str) -> str | None:
    """None when a directory made ``0700`` in `root` cannot be replaced by another user:
    `root` is private, or root's or this user's and sticky (every directory above it
    private or sticky)."""
    try:
        st = os.stat(root)
    except OSError as exc:
        return f"it cannot be examined ({exc.strerror})"
    if st.st_mode & stat.S_ISVTX and st.st_uid in (0, os.getuid()):
        return _why_not_private_above(root)
    if st.st_mode & 0o022:
        return (f"it is writable by others and not sticky (mode {stat.S_IMODE(st.st_mode):04o}): "
                "another user can put a directory of theirs in the place of one made there")
    return why_not_private(root)


# ------------------------------------------------------------------ Inductor's directories
def secure_inductor_dirs(group: Callable[[], str] | None = None) -> None:
    """Make sure Inductor's cache directory and its precompiled headers' are private before
    its first compile in this process (see the module); idempotent, never raises (a torch
    laid out otherwise, or no private place at all, keeps torch's own behaviour, said once).
    """
    global _inductor_done
    with _LOCK:
        if _inductor_done:
            return
        _inductor_done = True
        try:
            _secure_inductor_dirs(group or (lambda: private_fallback("torchinductor")))
        except Exception as exc:  # noqa: BLE001 - torch's own behaviour, said
            logger.warning("vllm_neuron: Inductor's cache directory could not be checked (%s); "
                           "torch's own is used", exc)  # fmt: skip


def _secure_inductor_dirs(group_dir: Callable[[], str]) -> None:
    group = group_dir()  # the local tier's (node_files.py): private, bounded, collected
    chosen = os.environ.get(INDUCTOR_CACHE_DIR)
    default = _torch_default_cache_dir()
    if not chosen or os.path.abspath(chosen) == default:  # unset, or set by torch itself
        os.environ[INDUCTOR_CACHE_DIR] = os.path.join(group, "inductor")
        with contextlib.suppress(OSError):
            st = os.stat(default)
            if st.st_uid == os.getuid() and not st.st_mode & 0o022:  # as torch makes it
                os.rmdir(default)  # made (empty) by torch's first look: nothing stays
    elif (why := make_private_dir(os.path.abspath(chosen))) is not None:
        cache = private_fallback("torchinductor")
        os.environ[INDUCTOR_CACHE_DIR] = cache
        _warn_once(chosen, why, f"Inductor's cache directory is {cache} ({INDUCTOR_CACHE_DIR})")
    # Torch keeps the precompiled headers under its *default* directory whatever the
    # variable says (in the temporary directory, outside any tier): they go to the group's.
    _move_headers(os.path.join(group, "headers"))


def _torch_default_cache_dir() -> str:
    """Torch's default Inductor cache directory (``cache_dir_utils.default_cache_dir``);
    its rule mirrored when that name is gone. Torch sets ``TORCHINDUCTOR_CACHE_DIR`` to it
    at its first look when unset: that value is torch's, not the user's."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return os.path.abspath(default_cache_dir())
    except (ImportError, AttributeError):
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = f"uid_{os.getuid()}"
        user = re.sub(r'[\\/:*?"<>|]', "_", user)
        return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


def _move_headers(header_dir: str) -> None:
    """Point torch's precompiled headers (``codecache._HEADER_DIR`` and its lock directory)
    at `header_dir` when they are elsewhere; a torch without those names keeps its own."""
    from torch._inductor import codecache

    current = getattr(codecache, "_HEADER_DIR", None)
    if not isinstance(current, str) or not hasattr(codecache, "_HEADER_LOCK_DIR"):
        logger.warning("vllm_neuron: this torch keeps its precompiled headers elsewhere than "
                       "expected; they are not checked for another user's changes")  # fmt: skip
        return
    if os.path.abspath(current) == os.path.abspath(header_dir):
        return
    codecache._HEADER_DIR = header_dir
    codecache._HEADER_LOCK_DIR = os.path.join(header_dir, "locks")
