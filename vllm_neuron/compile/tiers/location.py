"""Where the local tier of the compile cache lives: ``$VLLM_CACHE_ROOT/neuron/compile_cache``,
unless the default root is on NFS.

Why here and not in :mod:`vllm_neuron.envs`: the settings only say what the user set; that
the local tier must not live on NFS is a property of the cache (its file locks and atomic
renames coordinate the ranks of one node, and on NFS they are slow or unreliable), so the
decision belongs to the compile feature. A home directory on NFS is common on clusters,
so when VLLM_CACHE_ROOT is unset and its default is on NFS the local tier moves to
``/tmp/vllm_neuron_wdir_$USER``; sharing through NFS is the remote tier's job. An explicit
VLLM_CACHE_ROOT is the user's decision as to where, never moved. Wherever it is, the tier
must be this user's own - no other local user able to change what it holds - or it is not
used at all (`trusted_local_tier_dir`, `health.not_own_tier`): the /tmp fallback lives in a
directory every local user can write, and an explicit root may too.
"""

from __future__ import annotations

import atexit
import getpass
import os
import re
import shutil
import tempfile
from collections.abc import Mapping

from vllm_neuron.backends.mounts import NFS_TYPES, filesystem_type
from vllm_neuron.envs import (
    CompileCacheSettings,
    compile_cache_settings,
    load_compile_cache_settings,
    load_identity_settings,
    require_directory,
)
from vllm_neuron.envs.compile_cache import VLLM_CACHE_ROOT

from ..toolchains.private_dirs import why_not_a_temp_root
from .health import (
    LocalTierUnusable,
    check_private_directory,
    local_tier_problem,
    make_private_dirs,
    not_own_tier,
)

__all__ = [
    "NFS_FALLBACK_BASE",
    "get_neuron_compile_cache_dir",
    "local_tier_moves",
    "resolve_local_tier",
    "trusted_local_tier_dir",
    "writable_stand_in",
]

# Where the local tier goes when the default cache root is on NFS.
NFS_FALLBACK_BASE = "/tmp"


def local_tier_moves(settings: CompileCacheSettings, mounts_text: str | None = None) -> bool:
    """Whether the local tier leaves the cache root: only a default root (VLLM_CACHE_ROOT
    unset) that is on NFS (``mounts_text`` is /proc/mounts' text, read when None)."""
    return (
        not settings.cache_root_explicit
        and filesystem_type(settings.cache_root, mounts_text) in NFS_TYPES
    )


def _settings(
    settings: CompileCacheSettings | None, environ: Mapping[str, str] | None
) -> CompileCacheSettings:
    """``settings``, else the process's (or those of ``environ``: tests feed dicts)."""
    if settings is not None:
        return settings
    return compile_cache_settings() if environ is None else load_compile_cache_settings(environ)


def _login_name(user: str | None) -> str:
    """The user name for the /tmp fallback, safe to use as one path component.

    USER as set when it is, else the system's answer: a job started by a scheduler may
    have no USER, and the directory must still be this user's.
    """
    name = user
    if name is None:
        try:
            name = getpass.getuser()
        except (KeyError, OSError):
            name = f"uid{os.getuid()}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def get_neuron_compile_cache_dir(
    settings: CompileCacheSettings | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    mounts_text: str | None = None,
) -> str:
    """The local compile-cache directory: ``$VLLM_CACHE_ROOT/neuron/compile_cache``, or
    ``/tmp/vllm_neuron_wdir_$USER/neuron/compile_cache`` when the default root is on NFS.

    ``settings`` default to the process's (or those of ``environ``, when given; tests
    feed dicts). Raises :class:`vllm_neuron.envs.ConfigError` naming the setting when a
    regular file is in the way (the root itself or ``neuron/`` under it), since that
    directory can then never be created. Only computes the path: a process that will use
    the tier (load what it holds) asks `trusted_local_tier_dir`.
    """
    settings = _settings(settings, environ)
    root, setting = settings.cache_root, settings.cache_root_setting
    if local_tier_moves(settings, mounts_text):
        user = load_identity_settings(environ).user
        root = os.path.join(NFS_FALLBACK_BASE, f"vllm_neuron_wdir_{_login_name(user)}")
        setting = (f"{VLLM_CACHE_ROOT} (unset; its default {settings.cache_root} is on NFS, "
                   f"so the local tier is under {NFS_FALLBACK_BASE})")  # fmt: skip

    return require_directory(
        os.path.join(root, "neuron", "compile_cache"),
        setting=setting,
        purpose="the local compile cache",
    )


def trusted_local_tier_dir(
    settings: CompileCacheSettings | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    mounts_text: str | None = None,
    make: bool = False,
) -> str:
    """`get_neuron_compile_cache_dir`, for a process that will load what the tier holds: it
    must be this user's own (`health.not_own_tier`: owned by this user, writable by no one
    else, and so every directory above it unless sticky) - whatever root it is under, the
    /tmp fallback (created 0700 when missing) or an explicit VLLM_CACHE_ROOT - else
    :class:`LocalTierUnusable` names the setting and the reason (never used: the caller
    bypasses the cache). ``make``: the missing directories are created 0700 first."""
    settings = _settings(settings, environ)
    local_dir = get_neuron_compile_cache_dir(settings, environ=environ, mounts_text=mounts_text)
    root = os.path.dirname(os.path.dirname(local_dir))  # <root>/neuron/compile_cache
    if local_tier_moves(settings, mounts_text):
        setting = f"{VLLM_CACHE_ROOT} (unset; its default {settings.cache_root} is on NFS)"
        try:
            check_private_directory(root)
        except LocalTierUnusable as exc:
            raise LocalTierUnusable(f"{setting}: refused the fallback directory: {exc}"
                                    ) from None  # fmt: skip
    elif settings.cache_root_explicit:
        setting = f"{VLLM_CACHE_ROOT}={settings.cache_root}"
    else:
        setting = f"{VLLM_CACHE_ROOT} (unset: its default {settings.cache_root})"
    if make:
        make_private_dirs(local_dir)
    problem = not_own_tier(local_dir)
    if problem is not None:
        raise LocalTierUnusable(f"{setting}: the local compile cache {local_dir} is not this "
                                f"user's own: {problem}")  # fmt: skip
    return local_dir


def resolve_local_tier(
    settings: CompileCacheSettings | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    mounts_text: str | None = None,
) -> tuple[str, str | None]:
    """The local tier's directory and, when this process cannot use it, why (naming the
    setting): not this user's own (`trusted_local_tier_dir`: another local user could
    change what it holds, so it is bypassed - never used as a tier whose entries are merely
    judged, which under ``off`` or ``warn`` would load them), or the directory cannot be
    written (read-only, no permission, no space). Probed with one real write, once per
    process (by the assembly); with the cache disabled nothing is made or probed. A
    malformed setting still raises ConfigError.
    """
    settings = _settings(settings, environ)
    try:
        local_dir = trusted_local_tier_dir(settings, environ=environ, mounts_text=mounts_text,
                                           make=not settings.disable_compile_cache)
    except LocalTierUnusable as exc:
        return "", str(exc)
    if settings.disable_compile_cache:
        return local_dir, None
    problem = local_tier_problem(local_dir)
    if problem is None:
        return local_dir, None
    setting = (f"{VLLM_CACHE_ROOT}={settings.cache_root}" if settings.cache_root_explicit
               else f"the local compile cache {local_dir}")  # fmt: skip
    return local_dir, f"{setting}: cannot write {local_dir}: {problem}"


def writable_stand_in(
    settings: CompileCacheSettings | None = None, *, environ: Mapping[str, str] | None = None,
) -> tuple[str | None, str | None]:
    """Where a process whose local tier is read-only writes instead: its compiles, their
    unpacked copies, its events and statistics (docs/compile-cache.md, "Read-only and baked
    tiers"). ``$TMPDIR/vllm_neuron_wdir_$USER/neuron/compile_cache`` when no other user can
    replace that directory (TMPDIR private, or sticky as ``/tmp`` is; shared by the ranks of
    the node, this user's own, created 0700); else - TMPDIR writable by others and not
    sticky (a Kubernetes ``emptyDir``), or that name taken by another user - a new private
    directory of this process (``mkdtemp``: 0700, a name nobody can guess or make first),
    removed when the process exits. (the directory, None), or (None, why there is none)."""
    try:
        temp = tempfile.gettempdir()
    except OSError as exc:  # FileNotFoundError: no usable temporary directory at all
        return None, f"no writable temporary directory ({exc})"
    user = _login_name(load_identity_settings(environ).user)
    refused = None
    if why_not_a_temp_root(temp) is None:
        root = os.path.join(temp, f"vllm_neuron_wdir_{user}")
        try:
            check_private_directory(root)
        except LocalTierUnusable as exc:
            refused = str(exc)  # another user made it first: one of our own instead
        else:
            local_dir = os.path.join(root, "neuron", "compile_cache")
            make_private_dirs(local_dir)
            problem = not_own_tier(local_dir) or local_tier_problem(local_dir)
            return (None, f"{local_dir}: {problem}") if problem else (local_dir, None)
    try:
        root = tempfile.mkdtemp(prefix=f"vllm_neuron_wdir_{user}_", dir=temp)  # 0700
    except OSError as exc:
        return None, f"{temp}: cannot make a private directory in it ({exc.strerror or exc})"
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    local_dir = os.path.join(root, "neuron", "compile_cache")
    make_private_dirs(local_dir)
    # Made 0700 by this process under a name no one could guess; its parent may be anyone's
    # to write (that is why it is ours alone), so only the write probe is left to judge.
    problem = local_tier_problem(local_dir)
    if problem:
        return None, f"{local_dir}: {problem}" + (f" ({refused})" if refused else "")
    return local_dir, None


def holds_entries(local_dir: str) -> bool:
    """Whether the local tier at `local_dir` holds an entry: a directory named by a key,
    the first one found ends the look (a warm start must not pay for a walk of the tier). A
    tier that does not exist yet holds none; one that cannot be read counts as holding some
    (no head start is taken on a guess)."""
    try:
        with os.scandir(local_dir) as children:
            return any(len(child.name) == 32 and not child.name.startswith(".")
                       and child.is_dir() for child in children)  # fmt: skip
    except FileNotFoundError:
        return False
    except OSError:
        return True
