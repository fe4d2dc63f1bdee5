"""Every environment variable of vllm_neuron: parsed once, typed, validated.

Why one module: a deployment is configured through environment variables that are read in
every vLLM process (API server, engine core, each worker). Parsing them in one place means
a typo such as ``NEURON_LIBTORCH_DISABLE_COMPILE_CACHE=ture`` fails loudly at start-up with
the variable's name and value, instead of being silently read as "false" by one process and
differently by another.

Settings are grouped per feature (one frozen dataclass and one ``load_*`` function each),
so later features (manifest, snapshot, profiling) add their own group without touching the
compile cache's. Each group has a pure loader that takes a mapping (tests feed it dicts) and
a cached accessor that parses ``os.environ`` once per process.

Conventions shared by every variable:

- surrounding whitespace is ignored, and a variable set to the empty string counts as
  unset (``export VAR=`` is how shells "unset" a variable in many launch scripts);
- booleans accept ``0/1/true/false/yes/no/on/off`` in any case, nothing else;
- a malformed value raises :class:`ConfigError` naming the variable and the value.
"""

from __future__ import annotations

import functools
import math
import os
import re
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

__all__ = [
    "ENVIRONMENT_VARIABLES",
    "CompileCacheSettings",
    "ConfigError",
    "EnvVar",
    "HostModeSettings",
    "ToolchainName",
    "check_snapshot_root",
    "compile_cache_settings",
    "filesystem_type",
    "get_neuron_compile_cache_dir",
    "host_mode_settings",
    "load_compile_cache_settings",
    "load_host_mode_settings",
    "load_run_id",
    "require_directory",
    "reset_for_tests",
    "run_id",
]

ToolchainName = Literal["auto", "host", "neuron"]
TOOLCHAIN_NAMES: tuple[ToolchainName, ...] = ("auto", "host", "neuron")

# Filesystem types on which the local cache must not live: its file locks and atomic
# renames are what coordinate the ranks of one node, and on NFS they are slow or unreliable.
NETWORK_FILESYSTEM_TYPES = frozenset({"nfs", "nfs4"})

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class ConfigError(ValueError):
    """A setting has a malformed value; the message names the setting and the value."""


@dataclass(frozen=True)
class EnvVar:
    """Documentation record of one variable, so the CLI and docs can list them all."""

    name: str
    default: str
    feature: str
    description: str


# Feature: compile cache -------------------------------------------------------------------

VLLM_CACHE_ROOT = "VLLM_CACHE_ROOT"
NEURON_LIBTORCH_REMOTE_CACHE = "NEURON_LIBTORCH_REMOTE_CACHE"
NEURON_LIBTORCH_DISABLE_COMPILE_CACHE = "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE"
NEURON_LIBTORCH_COMPILATION_TIMEOUT = "NEURON_LIBTORCH_COMPILATION_TIMEOUT"
VLLM_NEURON_DISABLE_WARMUP_COMPILE = "VLLM_NEURON_DISABLE_WARMUP_COMPILE"
VLLM_NEURON_TOOLCHAIN = "VLLM_NEURON_TOOLCHAIN"

DEFAULT_COMPILATION_TIMEOUT = 600.0

ENVIRONMENT_VARIABLES: tuple[EnvVar, ...] = (
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
        "URL or path of the shared remote cache tier (NFS/FSx path, s3://...).",
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
)


# Parsing helpers ---------------------------------------------------------------------------


def _raw(environ: Mapping[str, str], name: str) -> str | None:
    """The stripped value of ``name``, or None when it is unset or blank."""
    value = environ.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def parse_bool(name: str, raw: str) -> bool:
    """Parse a boolean setting strictly: a typo must not silently mean False."""
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(
        f"{name}={raw!r} is not a boolean; use one of 0/1, true/false, yes/no, on/off"
    )


def parse_positive_float(name: str, raw: str) -> float:
    """Parse a finite number > 0 (a timeout of 0, NaN or infinity is a configuration bug)."""
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={raw!r} must be a finite number greater than 0")
    return value


def _bool_var(environ: Mapping[str, str], name: str, default: bool) -> bool:
    # Errors quote the value exactly as set: a stray "\r" from a CRLF env file must show.
    return default if _raw(environ, name) is None else parse_bool(name, environ[name])


def _expand_path(path: str, environ: Mapping[str, str]) -> str:
    """``~`` expanded with the HOME of ``environ`` (not only os.environ), made absolute.

    Absolute because worker processes may change directory after start-up.
    """
    home = _raw(environ, "HOME")
    if home is not None and (path == "~" or path.startswith("~/")):
        path = home + path[1:]
    return os.path.abspath(os.path.expanduser(path))


def default_cache_root(environ: Mapping[str, str] | None = None) -> str:
    """vLLM's own default: ``$XDG_CACHE_HOME/vllm``, else ``~/.cache/vllm``.

    Mirrors ``vllm.envs`` so that, with nothing set, our cache sits where vLLM's does.
    """
    env = os.environ if environ is None else environ
    xdg = _raw(env, "XDG_CACHE_HOME")
    base = xdg if xdg is not None else os.path.join("~", ".cache")
    return _expand_path(os.path.join(base, "vllm"), env)


# Path-valued settings ------------------------------------------------------------------------


def local_path_of(value: str) -> str | None:
    """The local path a path-or-URL setting names (``file://`` URLs included), or None for
    a remote store URL (``s3://``, ``memory://``), which has no local directory to check."""
    if "://" not in value:
        return value
    return value[len("file://"):] if value.startswith("file://") else None


def _kind_of(path: str) -> str:
    if os.path.islink(path) and not os.path.exists(path):
        return "a dangling symbolic link"
    return "a regular file" if os.path.isfile(path) else "a special file"


def require_directory(path: str, *, setting: str, purpose: str) -> str:
    """``path``, if it is a directory or can be created as one; else a ConfigError.

    Why: every directory of this package is created on first use, deep inside the first
    compile (or capture, or ledger line), where a regular file in the way surfaces as a bare
    ``NotADirectoryError`` about a derived path such as ``…/neuron`` that names no setting.
    Checked when the setting is resolved instead, the error names ``setting`` (the variable
    and its value as set) and what the directory is for. Only the path and its nearest
    existing ancestor are looked at (a few stats; nothing is created). Permissions are
    left to the first write: ``access()`` answers wrongly on NFS with root squashing, and a
    false refusal would stop a server that could have run.
    """
    probe = path
    while not os.path.isdir(probe):
        if os.path.lexists(probe):
            if probe == path:
                raise ConfigError(
                    f"{setting}: {path} is {_kind_of(path)}, not a directory (it is meant "
                    f"for {purpose})"
                )
            raise ConfigError(
                f"{setting}: {probe} is {_kind_of(probe)}, not a directory, so {purpose} "
                f"cannot be created at {path}"
            )
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return path


# Feature: compile cache -------------------------------------------------------------------


@dataclass(frozen=True)
class CompileCacheSettings:
    """Configuration of the two-tier compile cache (see docs/compile-cache.md).

    ``cache_root_explicit`` records whether VLLM_CACHE_ROOT was set: only the default
    location falls back to /tmp when the home directory is on NFS; an explicit root is the
    user's decision and is never second-guessed.
    """

    cache_root: str
    cache_root_explicit: bool = False
    remote_cache: str | None = None
    disable_compile_cache: bool = False
    compilation_timeout: float = DEFAULT_COMPILATION_TIMEOUT
    disable_warmup_compile: bool = False
    toolchain: ToolchainName = "auto"


def load_compile_cache_settings(environ: Mapping[str, str] | None = None) -> CompileCacheSettings:
    """Parse and validate the compile-cache variables from ``environ`` (default os.environ)."""
    env: Mapping[str, str] = os.environ if environ is None else environ

    root_raw = _raw(env, VLLM_CACHE_ROOT)
    if root_raw is None:
        cache_root = default_cache_root(env)
    else:
        # The default root is checked where it is used: on NFS the local tier moves to /tmp.
        cache_root = require_directory(
            _expand_path(root_raw, env),
            setting=f"{VLLM_CACHE_ROOT}={env[VLLM_CACHE_ROOT]!r}",
            purpose="vLLM's and this package's caches",
        )

    remote = _raw(env, NEURON_LIBTORCH_REMOTE_CACHE)
    remote_path = None if remote is None else local_path_of(remote)
    if remote_path is not None:
        require_directory(
            _expand_path(remote_path, env),
            setting=f"{NEURON_LIBTORCH_REMOTE_CACHE}={env[NEURON_LIBTORCH_REMOTE_CACHE]!r}",
            purpose="the remote compile-cache tier",
        )

    timeout = (
        DEFAULT_COMPILATION_TIMEOUT
        if _raw(env, NEURON_LIBTORCH_COMPILATION_TIMEOUT) is None
        else parse_positive_float(
            NEURON_LIBTORCH_COMPILATION_TIMEOUT, env[NEURON_LIBTORCH_COMPILATION_TIMEOUT]
        )
    )

    toolchain_raw = _raw(env, VLLM_NEURON_TOOLCHAIN)
    toolchain: ToolchainName = "auto"
    if toolchain_raw is not None:
        lowered = toolchain_raw.lower()
        if lowered not in TOOLCHAIN_NAMES:
            raise ConfigError(
                f"{VLLM_NEURON_TOOLCHAIN}={env[VLLM_NEURON_TOOLCHAIN]!r} is not a toolchain; "
                f"use one of {', '.join(TOOLCHAIN_NAMES)}"
            )
        toolchain = cast(ToolchainName, lowered)

    disable_cache = _bool_var(env, NEURON_LIBTORCH_DISABLE_COMPILE_CACHE, False)
    disable_warmup = _bool_var(env, VLLM_NEURON_DISABLE_WARMUP_COMPILE, False)
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
        cache_root_explicit=root_raw is not None,
        remote_cache=remote,
        disable_compile_cache=disable_cache,
        compilation_timeout=timeout,
        disable_warmup_compile=disable_warmup,
        toolchain=toolchain,
    )


@functools.lru_cache(maxsize=1)
def compile_cache_settings() -> CompileCacheSettings:
    """The process's compile-cache settings, parsed from os.environ on first use."""
    return load_compile_cache_settings()


def reset_for_tests() -> None:
    """Forget every cached settings group so the next accessor call re-reads os.environ."""
    compile_cache_settings.cache_clear()
    for accessor in _SETTINGS_ACCESSORS:
        accessor.cache_clear()


# Local cache directory ---------------------------------------------------------------------

def filesystem_type(path: str, mounts_text: str | None = None) -> str:
    """The filesystem type of the mount holding ``path`` ("" when unknown).

    One parser for the whole project: the storage layer's, which also picks the store
    profile from the same mount table.
    """
    from vllm_neuron.backends.mounts import filesystem_type as _filesystem_type

    return _filesystem_type(path, mounts_text)


def _user_name(environ: Mapping[str, str]) -> str:
    """The user name for the /tmp fallback, safe to use as one path component."""
    name = _raw(environ, "USER")
    if name is None:
        try:
            import getpass

            name = getpass.getuser()
        except (KeyError, OSError, ImportError):
            name = f"uid{os.getuid()}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def get_neuron_compile_cache_dir(
    settings: CompileCacheSettings | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    mounts_text: str | None = None,
) -> str:
    """The local compile-cache directory: ``$VLLM_CACHE_ROOT/neuron/compile_cache``.

    When VLLM_CACHE_ROOT is not set and the default root is on NFS (a home directory on
    NFS is common on clusters), the local tier moves to
    ``/tmp/vllm_neuron_wdir_$USER/neuron/compile_cache``: the local tier's locks and renames
    must be node-local, and sharing through NFS is the remote tier's job.

    Raises :class:`ConfigError` naming the setting when a regular file is in the way (the
    root itself or ``neuron/`` under it), since that directory can then never be created.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    if settings is None:
        settings = compile_cache_settings() if environ is None else load_compile_cache_settings(env)
    root = settings.cache_root
    moved = (
        not settings.cache_root_explicit
        and filesystem_type(root, mounts_text) in NETWORK_FILESYSTEM_TYPES
    )
    if moved:
        root = os.path.join("/tmp", f"vllm_neuron_wdir_{_user_name(env)}")
    return require_directory(
        os.path.join(root, "neuron", "compile_cache"),
        setting=_cache_root_setting(settings, env, moved=moved),
        purpose="the local compile cache",
    )


def _cache_root_setting(
    settings: CompileCacheSettings, environ: Mapping[str, str], *, moved: bool = False
) -> str:
    """How an error names the cache root: the variable and its value as set, or where the
    default came from when it is unset."""
    if settings.cache_root_explicit:
        return f"{VLLM_CACHE_ROOT}={environ.get(VLLM_CACHE_ROOT)!r}"
    if moved:
        return (f"{VLLM_CACHE_ROOT} (unset; its default {settings.cache_root} is on NFS, so "
                "the local tier is under /tmp)")
    xdg = _raw(environ, "XDG_CACHE_HOME")
    origin = f"XDG_CACHE_HOME={environ.get('XDG_CACHE_HOME')!r}" if xdg else "~/.cache"
    return f"{VLLM_CACHE_ROOT} (unset; default {settings.cache_root} from {origin})"


# Feature: compile-artifact manifest ---------------------------------------------------------

VLLM_NEURON_MANIFEST_DIR = "VLLM_NEURON_MANIFEST_DIR"

ENVIRONMENT_VARIABLES += (
    EnvVar(
        VLLM_NEURON_MANIFEST_DIR,
        "(unset)",
        "manifest",
        "Directory or store URL for compile ledgers and per-engine manifests; "
        "unset or empty disables the manifest (there is no default location).",
    ),
)


@dataclass(frozen=True)
class ManifestSettings:
    """The manifest is on exactly when `manifest_dir` is set (docs/manifest.md)."""

    manifest_dir: str | None = None

    @property
    def enabled(self) -> bool:
        return self.manifest_dir is not None


def load_manifest_settings(environ: Mapping[str, str] | None = None) -> ManifestSettings:
    """VLLM_NEURON_MANIFEST_DIR: a local path (made absolute) or a store URL."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    raw = _raw(env, VLLM_NEURON_MANIFEST_DIR)
    if raw is None:
        return ManifestSettings()
    if "\x00" in raw:
        raise ConfigError(f"{VLLM_NEURON_MANIFEST_DIR}={raw!r} contains a NUL byte")
    path = local_path_of(raw)
    if path is not None:
        # The ledger is best-effort (a write that fails at run time is logged, never fatal),
        # so a file in the way would otherwise only lose the manifest, quietly.
        require_directory(
            _expand_path(path, env),
            setting=f"{VLLM_NEURON_MANIFEST_DIR}={env[VLLM_NEURON_MANIFEST_DIR]!r}",
            purpose="the compile ledgers and manifests",
        )
    return ManifestSettings(raw if "://" in raw else _expand_path(raw, env))


@functools.lru_cache(maxsize=1)
def manifest_settings() -> ManifestSettings:
    """The process's manifest settings, parsed from os.environ on first use."""
    return load_manifest_settings()


# The run of an engine: which ledger segments belong to the manifest being emitted --------------

VLLM_NEURON_RUN_ID = "VLLM_NEURON_RUN_ID"

ENVIRONMENT_VARIABLES += (
    EnvVar(
        VLLM_NEURON_RUN_ID,
        "(set by the first process of a run, inherited by the others)",
        "manifest",
        "Id of one engine run, shared by all its processes; a manifest folds only the ledger "
        "of its own run. Set it yourself only when the ranks of one engine are started as "
        "separate programs (torchrun): the same value for all of them, a new one per run.",
    ),
)

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_run_id_lock = threading.Lock()


def load_run_id(environ: Mapping[str, str] | None = None) -> str | None:
    """VLLM_NEURON_RUN_ID, validated (it names a directory of the ledger), or None if unset."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    raw = _raw(env, VLLM_NEURON_RUN_ID)
    if raw is not None and not _RUN_ID.match(raw):
        raise ConfigError(
            f"{VLLM_NEURON_RUN_ID}={env[VLLM_NEURON_RUN_ID]!r} is not a run id; use 1 to 64 "
            "letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return raw


def run_id() -> str:
    """The id of this engine run, created on first use and exported to ``os.environ``.

    Why an environment variable: one engine run is several processes (API server, engine
    core, one worker per TP rank, forked compile workers), and every one of them writes
    ledger segments that the emitting rank must fold, while segments left by an earlier run
    that crashed before its emit must not be. The first process that needs the id (the
    general plugin in vLLM's first process, before any engine process is started; outside
    vLLM the compile runtime, when the manifest is on) creates one; every process started
    from it, by fork, spawn or vLLM's Ray executor (which copies ``VLLM_*`` variables to
    its workers), inherits it. A new ``vllm serve`` starts from a shell or a supervisor that
    never had it, so it gets a new id. Read at each use rather than cached: a Ray worker
    receives its environment after it has imported this module.
    """
    with _run_id_lock:
        current = load_run_id()
        if current is None:
            current = f"{os.getpid()}-{secrets.token_hex(6)}"
            os.environ[VLLM_NEURON_RUN_ID] = current
        return current


# Every feature's cached accessor, so `reset_for_tests` forgets them all.
_SETTINGS_ACCESSORS: list[functools._lru_cache_wrapper[Any]] = [manifest_settings]


# Feature: input snapshots (parsed and validated in vllm_neuron/snapshot/config.py) ---------

ENVIRONMENT_VARIABLES += (
    EnvVar(
        "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_ENABLE",
        "0",
        "snapshot",
        "Master switch of input snapshot capture; needs synchronous scheduling.",
    ),
    EnvVar(
        "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_CAPTURE_AT_CALL",
        "(unset: call 0 when no other rule is set)",
        "snapshot",
        "Comma-separated 0-based post-warm-up call indices of each executable, or -1 for all.",
    ),
    EnvVar(
        "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_CAPTURE_TOKEN",
        "(unset)",
        "snapshot",
        "Comma-separated target token positions (prompt length + decode step); decode only.",
    ),
    EnvVar(
        "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_CAPTURE_REQUEST",
        "(unset)",
        "snapshot",
        "Comma-separated request ids; vLLM's <id>-<8 hex> matches its base id <id>.",
    ),
    EnvVar(
        "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_MAX_CAPTURES",
        "4",
        "snapshot",
        "Process-global budget of captured forwards (every executable of a forward shares one).",
    ),
    EnvVar(
        "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_RANKS",
        "(unset: every rank)",
        "snapshot",
        "Comma-separated tp ranks that capture; a malformed list warns and captures all.",
    ),
    EnvVar(
        "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_FORMAT",
        "pt",
        "snapshot",
        "Tensor file format: pt (torch.save, loaded weights_only), npy, or safetensors.",
    ),
    EnvVar(
        "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR",
        "$VLLM_CACHE_ROOT/neuron/snapshots",
        "snapshot",
        "Bundle root: a local path or a store URL (memory://name, s3://bucket/prefix).",
    ),
)

SNAPSHOT_DIR = "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR"


def check_snapshot_root(root: str, environ: Mapping[str, str] | None = None) -> str:
    """``root`` (the resolved bundle root of an enabled capture), or a ConfigError when a
    file is in the way, naming VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR, or VLLM_CACHE_ROOT
    when the root is its default under the cache root.

    Why: bundles are written at the first captured forward, long after start-up, where a
    failed write would lose the very forward the capture was set up for.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    path = local_path_of(root)
    if path is None:
        return root
    if _raw(env, SNAPSHOT_DIR) is not None:
        setting = f"{SNAPSHOT_DIR}={env[SNAPSHOT_DIR]!r}"
    else:
        setting = (f"{SNAPSHOT_DIR} (unset: {root} under "
                   f"{_cache_root_setting(load_compile_cache_settings(env), env)})")
    require_directory(path, setting=setting, purpose="the input snapshot bundles")
    return root


# Feature: profile capture (docs/profiling.md) ---------------------------------------------

NEURON_PROJECT_ROOT = "NEURON_PROJECT_ROOT"
VLLM_NEURON_VENV_PATH = "VLLM_NEURON_VENV_PATH"
VLLM_NEURON_DIR = "VLLM_NEURON_DIR"

ENVIRONMENT_VARIABLES += (
    EnvVar(
        NEURON_PROJECT_ROOT,
        "(the current directory)",
        "profiling",
        "The one output knob: every capture artifact lands under <root>/agent_artifacts/.",
    ),
    EnvVar(
        VLLM_NEURON_VENV_PATH,
        "(unset)",
        "profiling",
        "Python environment of the server; its bin/ is put first on the server's PATH.",
    ),
    EnvVar(
        VLLM_NEURON_DIR,
        "(unset: the current directory)",
        "profiling",
        "The vLLM Neuron source tree; the profiling server's working directory.",
    ),
    EnvVar(
        "HF_HOME",
        "$NEURON_PROJECT_ROOT/agent_artifacts/models",
        "profiling",
        "Where model weights live; given to the profiling server when unset.",
    ),
)


@dataclass(frozen=True)
class ProfilingSettings:
    """Where a capture writes and how its server is started (all paths absolute)."""

    project_root: str
    hf_home: str
    venv_path: str | None = None
    vllm_neuron_dir: str | None = None


def load_profiling_settings(
    environ: Mapping[str, str] | None = None, *, project_root: str | None = None
) -> ProfilingSettings:
    """``project_root`` (the ``--project-root`` flag) wins over NEURON_PROJECT_ROOT."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    root_raw = project_root if project_root else _raw(env, NEURON_PROJECT_ROOT)
    root = _expand_path(root_raw, env) if root_raw else os.path.abspath(os.getcwd())
    hf_raw = _raw(env, "HF_HOME")
    hf_home = (
        _expand_path(hf_raw, env) if hf_raw else os.path.join(root, "agent_artifacts", "models")
    )
    paths: dict[str, str | None] = {}
    for name in (VLLM_NEURON_VENV_PATH, VLLM_NEURON_DIR):
        raw = _raw(env, name)
        if raw is None:
            paths[name] = None
            continue
        path = _expand_path(raw, env)
        if not os.path.isdir(path):
            raise ConfigError(f"{name}={env[name]!r} is not a directory")
        paths[name] = path
    return ProfilingSettings(
        project_root=root,
        hf_home=hf_home,
        venv_path=paths[VLLM_NEURON_VENV_PATH],
        vllm_neuron_dir=paths[VLLM_NEURON_DIR],
    )


# Feature: the vLLM plugin's host mode (vllm_neuron/plugin) ----------------------------------

VLLM_NEURON_HOST_MODE = "VLLM_NEURON_HOST_MODE"

ENVIRONMENT_VARIABLES += (
    EnvVar(
        VLLM_NEURON_HOST_MODE,
        "0",
        "vllm-plugin",
        "1 runs the whole artifact system inside a real vLLM without Trainium: a platform "
        "extending vLLM's CPU platform whose compiler is the two-tier cache (host toolchain).",
    ),
)


@dataclass(frozen=True)
class HostModeSettings:
    """Whether vLLM runs on this package's host platform (CPU, host toolchain)."""

    enabled: bool = False


def load_host_mode_settings(environ: Mapping[str, str] | None = None) -> HostModeSettings:
    """VLLM_NEURON_HOST_MODE, a strict boolean; host mode compiles with the host toolchain,
    so asking for the Neuron toolchain at the same time is refused."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    enabled = _bool_var(env, VLLM_NEURON_HOST_MODE, False)
    toolchain = _raw(env, VLLM_NEURON_TOOLCHAIN)
    if enabled and toolchain is not None and toolchain.lower() == "neuron":
        raise ConfigError(
            f"{VLLM_NEURON_HOST_MODE}={env[VLLM_NEURON_HOST_MODE]!r} runs vLLM on the host CPU "
            f"and compiles with the host toolchain, but {VLLM_NEURON_TOOLCHAIN}="
            f"{env[VLLM_NEURON_TOOLCHAIN]!r} asks for Neuron: unset one of them"
        )
    return HostModeSettings(enabled=enabled)


@functools.lru_cache(maxsize=1)
def host_mode_settings() -> HostModeSettings:
    """The process's host-mode setting, parsed from os.environ on first use."""
    return load_host_mode_settings()


_SETTINGS_ACCESSORS.append(host_mode_settings)
