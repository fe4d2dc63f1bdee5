"""Settings of the two-tier compile cache (docs/compile-cache.md).

Only parsing lives here: where the local tier finally goes (it moves to /tmp when the
default root is on NFS) is the compile feature's decision, in
:mod:`vllm_neuron.compile.tiers.location`, made from these settings.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, cast

from ._parse import (
    ConfigError,
    EnvVar,
    bool_var,
    choice_var,
    environ_or_default,
    expand_path,
    normalize_location_var,
    parse_positive_float,
    parsed_once,
    pid_marker,
    raw,
    remote_location_var,
    require_directory,
    require_local_directory,
)

__all__ = [
    "DEFAULT_COMPILATION_TIMEOUT",
    "DEFAULT_COMPILE_RETRY_AFTER",
    "DEFAULT_REMOTE_LEASE_SECONDS",
    "NEURON_LIBTORCH_BAKED_CACHE",
    "NEURON_LIBTORCH_COMPILATION_TIMEOUT",
    "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE",
    "NEURON_LIBTORCH_REMOTE_CACHE",
    "REMOTE_WRITE_MODES",
    "TOOLCHAIN_NAMES",
    "VARIABLES",
    "VLLM_CACHE_ROOT",
    "VLLM_NEURON_CACHE_MAX_SIZE",
    "VLLM_NEURON_COMPILE_RETRY_AFTER",
    "VLLM_NEURON_COMPILE_WORKERS",
    "VLLM_NEURON_DEFER_COMPILES",
    "VLLM_NEURON_DISABLE_WARMUP_COMPILE",
    "VLLM_NEURON_REMOTE_LEASE_SECONDS",
    "VLLM_NEURON_REMOTE_WRITE",
    "VLLM_NEURON_TOOLCHAIN",
    "CompileCacheSettings",
    "RemoteWrite",
    "ToolchainName",
    "cache_max_size",
    "compile_cache_settings",
    "default_cache_root",
    "default_compile_workers",
    "load_compile_cache_settings",
    "parse_size",
    "remote_cache_url",
    "VLLM_NEURON_NODE_FILES",
    "VLLM_NEURON_SHARED_NODE_FILES",
    "VLLM_NEURON_MODEL_INFO_LOOKED",
    "load_model_info_looked",
    "mark_model_info_looked",
    "load_node_files_dir",
    "set_node_files_dir",
]

ToolchainName = Literal["auto", "host", "neuron"]
TOOLCHAIN_NAMES: tuple[ToolchainName, ...] = ("auto", "host", "neuron")
RemoteWrite = Literal["auto", "off"]
REMOTE_WRITE_MODES: tuple[RemoteWrite, ...] = ("auto", "off")

VLLM_CACHE_ROOT = "VLLM_CACHE_ROOT"
NEURON_LIBTORCH_REMOTE_CACHE = "NEURON_LIBTORCH_REMOTE_CACHE"
NEURON_LIBTORCH_DISABLE_COMPILE_CACHE = "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE"
NEURON_LIBTORCH_COMPILATION_TIMEOUT = "NEURON_LIBTORCH_COMPILATION_TIMEOUT"
NEURON_LIBTORCH_BAKED_CACHE = "NEURON_LIBTORCH_BAKED_CACHE"
VLLM_NEURON_DISABLE_WARMUP_COMPILE = "VLLM_NEURON_DISABLE_WARMUP_COMPILE"
VLLM_NEURON_TOOLCHAIN = "VLLM_NEURON_TOOLCHAIN"
VLLM_NEURON_REMOTE_WRITE = "VLLM_NEURON_REMOTE_WRITE"
VLLM_NEURON_REMOTE_LEASE_SECONDS = "VLLM_NEURON_REMOTE_LEASE_SECONDS"
VLLM_NEURON_COMPILE_RETRY_AFTER = "VLLM_NEURON_COMPILE_RETRY_AFTER"
VLLM_NEURON_CACHE_MAX_SIZE = "VLLM_NEURON_CACHE_MAX_SIZE"
VLLM_NEURON_DEFER_COMPILES = "VLLM_NEURON_DEFER_COMPILES"
VLLM_NEURON_COMPILE_WORKERS = "VLLM_NEURON_COMPILE_WORKERS"
# An internal marker, not a setting: named outside vLLM's ``VLLM_*`` namespace (host_mode).
VLLM_NEURON_NODE_FILES = "_VLLM_NEURON_NODE_FILES"
# Likewise: one directory of node files for every process of a tree whatever local tier each
# opens (the test suite's processes are one node's: its headers built once, not per tier).
VLLM_NEURON_SHARED_NODE_FILES = "_VLLM_NEURON_SHARED_NODE_FILES"
# Likewise: vLLM's first process has looked for vLLM's model information on the remote
# (plugin/model_info.py); the processes it starts (vLLM's inspection subprocess, the engine's)
# do not look again.
VLLM_NEURON_MODEL_INFO_LOOKED = "_VLLM_NEURON_MODEL_INFO_LOOKED"

COMPILE_MEMORY = 4 << 30
"""Memory one compile is assumed to need when the node's compile slots are sized from its
memory (VLLM_NEURON_COMPILE_WORKERS unset): an Inductor compile of one piece peaks near
1-2 GiB, a Neuron compile of one bucket at several; 4 GiB leaves the serving process room."""

DEFAULT_COMPILATION_TIMEOUT = 600.0
DEFAULT_REMOTE_LEASE_SECONDS = 30.0
DEFAULT_COMPILE_RETRY_AFTER = 300.0

VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        VLLM_CACHE_ROOT,
        "$XDG_CACHE_HOME/vllm or ~/.cache/vllm",
        "compile-cache",
        "vLLM cache root; the local compile cache is $VLLM_CACHE_ROOT/neuron/compile_cache.",
    ),
    EnvVar(
        NEURON_LIBTORCH_REMOTE_CACHE,
        "(unset)",
        "compile-cache",
        "URL or path of the shared remote cache tier (NFS/FSx path, s3://...); a malformed "
        "URL or an unknown scheme is refused at start-up.",
    ),
    EnvVar(
        NEURON_LIBTORCH_BAKED_CACHE,
        "(unset)",
        "compile-cache",
        "Comma-separated directories (or file:// URLs) of read-only compile caches - one "
        "baked into the image by `vllm-neuron cache bake` - consulted after the local tier "
        "and before the remote; never written.",
    ),
    EnvVar(
        VLLM_NEURON_REMOTE_WRITE,
        "auto",
        "compile-cache",
        "auto | off: auto promotes each compile to the remote tier and coordinates compiles "
        "through remote leases; off reads the remote only (promote with save_cache or "
        "`vllm-neuron cache promote`).",
    ),
    EnvVar(
        VLLM_NEURON_REMOTE_LEASE_SECONDS,
        "30",
        "compile-cache",
        "Seconds a remote compile lease lasts without renewal: the most a dead compiler "
        "delays the other nodes.",
    ),
    EnvVar(
        VLLM_NEURON_COMPILE_RETRY_AFTER,
        "300",
        "compile-cache",
        "Seconds after a compile failed somewhere in the fleet during which other "
        "processes raise its error instead of compiling the graph again; also the longest a "
        "node waits on another node's lease before compiling the graph itself.",
    ),
    EnvVar(
        VLLM_NEURON_CACHE_MAX_SIZE,
        "(unset: no bound)",
        "compile-cache",
        "Size bound of the local tier (500M, 50G; powers of 1024): after a publish and at "
        "start-up the least recently used entries are evicted, never a pinned one or one "
        "whose key's lock is held.",
    ),
    EnvVar(
        VLLM_NEURON_DEFER_COMPILES,
        "1",
        "compile-cache",
        "1: a graph whose compile another process holds (or that finds no free compile "
        "slot) is loaded at its first call, and tracing goes on to the next graph; 0 waits "
        "in place, one graph after another.",
    ),
    EnvVar(
        VLLM_NEURON_COMPILE_WORKERS,
        "min(the node's CPUs, memory / 4 GiB), at least 1",
        "compile-cache",
        "The most compiles that run at once on this node, across all its processes (slots "
        "are lock files in the local tier).",
    ),
    EnvVar(
        NEURON_LIBTORCH_DISABLE_COMPILE_CACHE,
        "0",
        "compile-cache",
        "1 disables the compile cache: every process compiles on its own.",
    ),
    EnvVar(
        NEURON_LIBTORCH_COMPILATION_TIMEOUT,
        "600",
        "compile-cache",
        "Seconds to wait for another process to finish compiling a graph.",
    ),
    EnvVar(
        VLLM_NEURON_DISABLE_WARMUP_COMPILE,
        "0",
        "compile-cache",
        "1 makes a cache miss fatal (pre-compiled-only mode).",
    ),
    EnvVar(
        VLLM_NEURON_TOOLCHAIN,
        "auto",
        "compile-cache",
        "auto | host | neuron: which toolchain compiles graphs (auto: neuron if installed).",
    ),
    EnvVar(
        VLLM_NEURON_NODE_FILES,
        "(set by the process that opens the local tier, inherited by the processes it starts)",
        "compile-cache",
        "Where the node's toolchain files (precompiled headers, kept AOTInductor runtime "
        "objects, Inductor's cache) are kept: the local tier's .node directory "
        "(vllm_neuron/compile/toolchains/node_files.py). Not a setting: leave it unset.",
    ),
    EnvVar(
        VLLM_NEURON_SHARED_NODE_FILES,
        "(unset)",
        "compile-cache",
        "Tests only: one directory of node files for a whole process tree, whatever local "
        "tier each process opens (the test suite's many tiers are one node's); wins over "
        "_VLLM_NEURON_NODE_FILES. Not a setting: leave it unset.",
    ),
    EnvVar(
        VLLM_NEURON_MODEL_INFO_LOOKED,
        "(set by vLLM's first process, inherited by the processes it starts)",
        "compile-cache",
        "The process id of the process of this start that looked on the remote tier for "
        "vLLM's model information (vllm_neuron/plugin/model_info.py); its descendants do not "
        "look again. Not a setting: leave it unset.",
    ),
)


@dataclass(frozen=True)
class CompileCacheSettings:
    """Configuration of the two-tier compile cache (see docs/compile-cache.md).

    ``cache_root_explicit`` records whether VLLM_CACHE_ROOT was set: only the default
    location falls back to /tmp when the home directory is on NFS; an explicit root is the
    user's decision and is never second-guessed.

    ``cache_root_setting`` is how an error about a directory under the root names it: the
    variable and its value as set, or where the default came from. It is fixed when the
    variables are parsed, so the features that derive directories from the root (the local
    tier, the snapshot bundles) quote the environment this group was read from without
    reading it again. It describes the settings and is not one, so equality ignores it.

    ``remote_write`` (VLLM_NEURON_REMOTE_WRITE), ``remote_lease_seconds``
    (VLLM_NEURON_REMOTE_LEASE_SECONDS) and ``compile_retry_after``
    (VLLM_NEURON_COMPILE_RETRY_AFTER) are how this process works with the rest of the fleet
    through the remote tier (docs/compile-cache.md).
    """

    cache_root: str
    cache_root_explicit: bool = False
    remote_cache: str | None = None
    disable_compile_cache: bool = False
    compilation_timeout: float = DEFAULT_COMPILATION_TIMEOUT
    disable_warmup_compile: bool = False
    toolchain: ToolchainName = "auto"
    remote_write: RemoteWrite = "auto"
    remote_lease_seconds: float = DEFAULT_REMOTE_LEASE_SECONDS
    compile_retry_after: float = DEFAULT_COMPILE_RETRY_AFTER
    cache_max_size: int | None = None  # VLLM_NEURON_CACHE_MAX_SIZE in bytes; None: no bound
    defer_compiles: bool = True  # VLLM_NEURON_DEFER_COMPILES
    compile_workers: int = 1  # VLLM_NEURON_COMPILE_WORKERS (or its default for this node)
    cache_root_setting: str = field(default="", compare=False)
    baked_caches: tuple[str, ...] = ()  # NEURON_LIBTORCH_BAKED_CACHE, in order

    def __post_init__(self) -> None:
        if not self.cache_root_setting:  # built by hand (tests): name the root itself
            object.__setattr__(
                self, "cache_root_setting", f"{VLLM_CACHE_ROOT} (resolved to {self.cache_root})"
            )


def default_cache_root(environ: Mapping[str, str] | None = None) -> str:
    """vLLM's own default: ``$XDG_CACHE_HOME/vllm``, else ``~/.cache/vllm``.

    Mirrors ``vllm.envs`` so that, with nothing set, our cache sits where vLLM's does.
    """
    env = environ_or_default(environ)
    xdg = raw(env, "XDG_CACHE_HOME")
    base = xdg if xdg is not None else os.path.join("~", ".cache")
    return expand_path(os.path.join(base, "vllm"), env)


def remote_cache_url(environ: Mapping[str, str] | None = None) -> str | None:
    """NEURON_LIBTORCH_REMOTE_CACHE as set (stripped), or None when unset or blank.

    Not validated, unlike :func:`load_compile_cache_settings`: the ``vllm-neuron cache``
    command offers it as a default while its parser is built, and a tool for inspecting
    and repairing caches must start even when another compile-cache variable is malformed.
    """
    return raw(environ_or_default(environ), NEURON_LIBTORCH_REMOTE_CACHE)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)


def parse_size(text: str, *, what: str = "size") -> int:
    """'500', '500M', '10G', '1.5GiB' -> bytes (powers of 1024); `what` names the setting
    or option in the ValueError. One set of rules for `VLLM_NEURON_CACHE_MAX_SIZE` and
    `vllm-neuron cache prune --max-size`."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{what}: cannot parse size {text!r} (e.g. 500M, 10G)")
    unit = (match.group(2) or "").lower().rstrip("b").rstrip("i")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit]
    return int(float(match.group(1)) * scale)


def cache_max_size(environ: Mapping[str, str] | None = None) -> int | None:
    """VLLM_NEURON_CACHE_MAX_SIZE in bytes, None when unset or blank; `ConfigError` naming
    the variable and the value when it is not a size above 0."""
    env = environ_or_default(environ)
    value = raw(env, VLLM_NEURON_CACHE_MAX_SIZE)
    if value is None:
        return None
    setting = f"{VLLM_NEURON_CACHE_MAX_SIZE}={env[VLLM_NEURON_CACHE_MAX_SIZE]!r}"
    try:
        size = parse_size(value, what=setting)
    except ValueError as exc:
        raise ConfigError(f"{exc}; unset it for no bound") from None
    if size <= 0:
        raise ConfigError(f"{setting}: the bound must be above 0 bytes; unset it for no bound")
    return size


def _cache_root_setting(env: Mapping[str, str], root: str, explicit: bool) -> str:
    if explicit:
        return f"{VLLM_CACHE_ROOT}={env.get(VLLM_CACHE_ROOT)!r}"
    xdg = raw(env, "XDG_CACHE_HOME")
    origin = f"XDG_CACHE_HOME={env.get('XDG_CACHE_HOME')!r}" if xdg else "~/.cache"
    return f"{VLLM_CACHE_ROOT} (unset; default {root} from {origin})"


def _toolchain(env: Mapping[str, str]) -> ToolchainName:
    value = raw(env, VLLM_NEURON_TOOLCHAIN)
    if value is None:
        return "auto"
    lowered = value.lower()
    if lowered not in TOOLCHAIN_NAMES:
        raise ConfigError(
            f"{VLLM_NEURON_TOOLCHAIN}={env[VLLM_NEURON_TOOLCHAIN]!r} is not a toolchain; "
            f"use one of {', '.join(TOOLCHAIN_NAMES)}"
        )
    return cast(ToolchainName, lowered)


def default_compile_workers() -> int:
    """How many compiles this node carries at once when VLLM_NEURON_COMPILE_WORKERS is
    unset: one per CPU of the node, but no more than its memory holds at `COMPILE_MEMORY`
    each, and at least one. The node's CPUs, not this process's affinity: the bound is
    the node's, shared by its processes, and vLLM pins each rank of a CPU engine to its own
    cores (every rank would otherwise see one CPU, and the node one compile at a time)."""
    cpus = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        memory = COMPILE_MEMORY * cpus
    return max(1, min(cpus, memory // COMPILE_MEMORY))


def _compile_workers(env: Mapping[str, str]) -> int:
    text = raw(env, VLLM_NEURON_COMPILE_WORKERS)
    if text is None:
        return default_compile_workers()
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(
            f"{VLLM_NEURON_COMPILE_WORKERS}={env[VLLM_NEURON_COMPILE_WORKERS]!r} is not a "
            "positive whole number of concurrent compiles (unset it for the default: "
            f"{default_compile_workers()} on this node)"
        )
    return value


def _positive_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    return default if raw(env, name) is None else parse_positive_float(name, env[name])


def load_compile_cache_settings(environ: Mapping[str, str] | None = None) -> CompileCacheSettings:
    """Parse and validate the compile-cache variables from ``environ`` (default os.environ)."""
    env = environ_or_default(environ)

    root_raw = raw(env, VLLM_CACHE_ROOT)
    explicit = root_raw is not None
    if root_raw is None:
        # The default root is checked where it is used: on NFS the local tier moves to /tmp.
        cache_root = default_cache_root(env)
    else:
        cache_root = require_directory(
            expand_path(root_raw, env),
            setting=f"{VLLM_CACHE_ROOT}={env[VLLM_CACHE_ROOT]!r}",
            purpose="vLLM's and this package's caches",
        )

    remote = remote_location_var(env, NEURON_LIBTORCH_REMOTE_CACHE)
    if remote is not None:
        require_local_directory(
            remote, env,
            setting=f"{NEURON_LIBTORCH_REMOTE_CACHE}={env[NEURON_LIBTORCH_REMOTE_CACHE]!r}",
            purpose="the remote compile-cache tier",
        )  # fmt: skip

    timeout = (
        DEFAULT_COMPILATION_TIMEOUT
        if raw(env, NEURON_LIBTORCH_COMPILATION_TIMEOUT) is None
        else parse_positive_float(
            NEURON_LIBTORCH_COMPILATION_TIMEOUT, env[NEURON_LIBTORCH_COMPILATION_TIMEOUT]
        )
    )

    toolchain = _toolchain(env)
    remote_write = cast(
        RemoteWrite, choice_var(env, VLLM_NEURON_REMOTE_WRITE, REMOTE_WRITE_MODES, "auto")
    )
    lease_seconds = _positive_seconds(
        env, VLLM_NEURON_REMOTE_LEASE_SECONDS, DEFAULT_REMOTE_LEASE_SECONDS
    )
    retry_after = _positive_seconds(
        env, VLLM_NEURON_COMPILE_RETRY_AFTER, DEFAULT_COMPILE_RETRY_AFTER
    )
    disable_cache = bool_var(env, NEURON_LIBTORCH_DISABLE_COMPILE_CACHE, False)
    disable_warmup = bool_var(env, VLLM_NEURON_DISABLE_WARMUP_COMPILE, False)
    if disable_cache and disable_warmup:
        # Pre-compiled-only mode needs the cache to find the pre-compiled graphs; with the
        # cache off every graph would be a miss, so the combination can only be a mistake.
        raise ConfigError(
            f"{VLLM_NEURON_DISABLE_WARMUP_COMPILE}={env[VLLM_NEURON_DISABLE_WARMUP_COMPILE]!r}"
            f" (pre-compiled graphs only) cannot be combined with "
            f"{NEURON_LIBTORCH_DISABLE_COMPILE_CACHE}="
            f"{env[NEURON_LIBTORCH_DISABLE_COMPILE_CACHE]!r} (no compile cache): "
            "unset one of them"
        )

    return CompileCacheSettings(
        cache_root=cache_root,
        cache_root_explicit=explicit,
        remote_cache=remote,
        disable_compile_cache=disable_cache,
        compilation_timeout=timeout,
        disable_warmup_compile=disable_warmup,
        toolchain=toolchain,
        remote_write=remote_write,
        remote_lease_seconds=lease_seconds,
        compile_retry_after=retry_after,
        cache_max_size=cache_max_size(env),
        defer_compiles=bool_var(env, VLLM_NEURON_DEFER_COMPILES, True),
        compile_workers=_compile_workers(env),
        cache_root_setting=_cache_root_setting(env, cache_root, explicit),
        baked_caches=_baked_caches(env),
    )


def _baked_caches(env: Mapping[str, str]) -> tuple[str, ...]:
    """NEURON_LIBTORCH_BAKED_CACHE: each comma-separated location checked and made absolute
    (a mangled URL is a ConfigError naming the variable); blanks between commas ignored."""
    value = raw(env, NEURON_LIBTORCH_BAKED_CACHE)
    if value is None:
        return ()
    found: list[str] = []
    for part in value.split(","):
        part = part.strip()
        if part:
            location = normalize_location_var({NEURON_LIBTORCH_BAKED_CACHE: part,
                                               **({"HOME": env["HOME"]} if "HOME" in env
                                                  else {})}, NEURON_LIBTORCH_BAKED_CACHE)
            if location is not None and location not in found:
                found.append(location)
    return tuple(found)


@parsed_once
def compile_cache_settings() -> CompileCacheSettings:
    """The process's compile-cache settings, parsed from os.environ on first use."""
    return load_compile_cache_settings()


def load_node_files_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """_VLLM_NEURON_NODE_FILES: the local tier's directory of node files, as the process that
    opened the tier set it for the processes it starts; None when unset. Read at each use
    (set while running); no setting of the user's, so never an error.
    _VLLM_NEURON_SHARED_NODE_FILES, when set, wins over it: one directory for a whole process
    tree whatever tier each process opens (the test suite: one node, many tiers)."""
    env = environ_or_default(environ)
    return raw(env, VLLM_NEURON_SHARED_NODE_FILES) or raw(env, VLLM_NEURON_NODE_FILES) or None


def load_model_info_looked(environ: Mapping[str, str] | None = None) -> int | None:
    """_VLLM_NEURON_MODEL_INFO_LOOKED: the process id of the process of this start that looked
    for vLLM's model information on the remote, or None when unset; a value that is no
    process id is no marker (None), never an error: it is no setting of the user's."""
    return pid_marker(environ_or_default(environ), VLLM_NEURON_MODEL_INFO_LOOKED)


def mark_model_info_looked() -> None:
    """Set _VLLM_NEURON_MODEL_INFO_LOOKED to this process's id, for the processes it starts."""
    os.environ[VLLM_NEURON_MODEL_INFO_LOOKED] = str(os.getpid())


def set_node_files_dir(directory: str) -> None:
    """Set _VLLM_NEURON_NODE_FILES for this process and the processes it starts."""
    os.environ[VLLM_NEURON_NODE_FILES] = directory
