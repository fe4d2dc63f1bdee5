"""`open_store`: the one way to turn a URL into a `Store`, and the registry of URL schemes.

    /abs/path, rel/path, file:///abs/path   local disk (profile from /proc/mounts or option)
    s3://bucket/prefix                       S3 through s3fs
    memory://name                            in-process memory, isolated per name

Each scheme is one `register_scheme` call: its opener, the options it accepts, the optional
packages it needs and the command that installs them. `open_store` only looks the scheme up,
so adding a backend never edits it. Options a backend cannot take are a `TypeError` naming
them, not silence.

``create`` means the same for every scheme: ``True`` (the default) may make the root where
the backend has one to make (a local directory); ``False`` never creates anything, so a
caller that only reads passes ``create=False`` whatever the URL is.

What is a URL is decided here once (`is_url`, `normalize_location`, `local_path_of`), so the
code above the storage layer never sniffs for ``"://"`` and never disagrees with
`open_store` about which strings name local directories.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import MissingDependency, UnknownScheme
from .store import Store

# RFC 3986 scheme syntax, followed by "://". Anchored: "a/b://c" is a local path.
_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
# The scheme that plain paths (no "scheme://") are opened with.
LOCAL_SCHEME = "file"
# Accepted by every scheme: `open_store` consumes it and hands it to the opener.
_UNIVERSAL_OPTIONS = frozenset({"create"})


class Opener(Protocol):
    """Builds a store. ``location`` is the URL with ``scheme://`` removed (a plain path as
    given); ``options`` have been checked against the scheme's accepted options and no
    longer hold ``create``; with ``create=False`` the opener must create nothing."""

    def __call__(
        self, url: str, location: str, options: dict[str, Any], *, create: bool
    ) -> Store: ...


OptionNames = Iterable[str] | Callable[[], Iterable[str]]


@dataclass(frozen=True)
class Scheme:
    """One registered URL scheme (see `register_scheme` for the fields)."""

    name: str
    opener: Opener | str
    options: OptionNames
    requires: tuple[str, ...]
    install_hint: str | None
    label: str

    def resolve_opener(self) -> Opener:
        """The opener, importing its module first when it was registered as a string."""
        if not isinstance(self.opener, str):
            return self.opener
        module_name, _, attr = self.opener.partition(":")
        module = importlib.import_module(module_name, package=__package__)
        opener: Opener = getattr(module, attr)
        return opener

    def accepted_options(self) -> frozenset[str]:
        """Every option name this scheme takes, ``create`` included."""
        names = self.options() if callable(self.options) else self.options
        return frozenset(names) | _UNIVERSAL_OPTIONS


_registry: dict[str, Scheme] = {}
_registry_lock = threading.Lock()


def register_scheme(
    name: str,
    opener: Opener | str,
    *,
    options: OptionNames = (),
    requires: Iterable[str] = (),
    install_hint: str | None = None,
    label: str | None = None,
    replace: bool = False,
) -> Scheme:
    """Make ``name://...`` URLs open with ``opener``.

    ``opener`` is an `Opener`, or ``"module:function"`` naming one; the module (relative to
    this package when it starts with ".") is imported on the first open, so an optional
    backend costs nothing until it is used. ``options`` are the option names it accepts
    (``create`` is always accepted), or a function returning them when they depend on an
    optional package (called only after ``requires`` are found). ``requires`` are top-level
    module names that must be importable; when one is missing, `open_store` raises
    `MissingDependency` quoting ``install_hint`` (default ``pip install <names>``).
    ``label`` is how the scheme is listed in `UnknownScheme` errors.

    Registering a name twice is a ValueError unless ``replace`` is true.
    """
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", name):
        raise ValueError(f"register_scheme: {name!r} is not a URL scheme name")
    if isinstance(opener, str) and not re.fullmatch(r"\.*[\w.]+:\w+", opener):
        raise ValueError(f"register_scheme: opener {opener!r} is not 'module:function'")
    if not callable(options):
        options = frozenset(options)
        if any(not isinstance(o, str) for o in options):
            raise TypeError(f"register_scheme: option names must be str, got {sorted(options)}")
    key = name.lower()
    scheme = Scheme(
        name=key,
        opener=opener,
        options=options,
        requires=tuple(requires),
        install_hint=install_hint,
        label=label or key,
    )
    with _registry_lock:
        if key in _registry and not replace:
            raise ValueError(f"register_scheme: scheme {key!r} is already registered")
        _registry[key] = scheme
    return scheme


def unregister_scheme(name: str) -> None:
    """Forget ``name`` (a KeyError if it is not registered); tests use it to clean up."""
    with _registry_lock:
        del _registry[name.lower()]


def registered_schemes() -> tuple[str, ...]:
    """The registered scheme names, in registration order."""
    with _registry_lock:
        return tuple(_registry)


# Locations ---------------------------------------------------------------------------------


def _split(location: str) -> tuple[str, str]:
    """(lower-cased scheme, rest) of a URL; (``LOCAL_SCHEME``, location) for a plain path."""
    m = _SCHEME_RE.match(location)
    if m is None:
        return LOCAL_SCHEME, location
    return m.group(1).lower(), location[m.end() :]


def _check_location(location: str | os.PathLike[str], what: str) -> str:
    location = os.fspath(location)
    if not isinstance(location, str) or not location:
        raise ValueError(f"{what} needs a non-empty path or URL, got {location!r}")
    if "\x00" in location:
        raise ValueError(f"store URL must not contain NUL: {location!r}")
    return location


def _absolute(path: str, home: str | None) -> str:
    """``path`` with ``~`` expanded (with ``home`` when given, else $HOME) and made absolute:
    absolute because worker processes may change directory after start-up."""
    if home is not None and (path == "~" or path.startswith("~/")):
        path = home + path[1:]
    return os.path.abspath(os.path.expanduser(path))


def is_url(location: str | os.PathLike[str]) -> bool:
    """True when ``location`` starts with ``scheme://`` (any scheme, registered or not, so
    an unknown one reaches `open_store`'s `UnknownScheme` instead of becoming a directory);
    False for a plain path. ``file://`` URLs are URLs: use `local_path_of` to ask whether a
    location has a local directory."""
    return _SCHEME_RE.match(os.fspath(location)) is not None


def local_path_of(location: str | os.PathLike[str], *, home: str | None = None) -> str | None:
    """The absolute local directory `open_store` would use for ``location`` (a plain path or
    a ``file://`` URL, ``~`` expanded with ``home`` or $HOME), or None for any other scheme,
    which has no local directory to check."""
    location = _check_location(location, "local_path_of")
    scheme, rest = _split(location)
    return _absolute(rest, home) if scheme == LOCAL_SCHEME else None


def local_root_missing(location: str | os.PathLike[str]) -> bool:
    """True when ``location`` is local (a path or ``file://`` URL) and no directory is there.

    What a reader asks before ``open_store(location, create=False)``, to say "no cache
    here" instead of reading an empty tier. Any other scheme says False: whether a prefix
    exists there is known only by reading it.
    """
    path = local_path_of(location)
    return path is not None and not os.path.isdir(path)


def normalize_location(raw: str | os.PathLike[str], *, home: str | None = None) -> str:
    """``raw`` as a setting should keep it: a plain path ``~``-expanded (with ``home`` or
    $HOME) and made absolute, a ``file://`` URL with its path made absolute the same way
    (``file:///abs``), any other URL unchanged. `open_store` opens the same root from the
    result as from ``raw``, whatever the current directory is later.

    ValueError for an empty location or one containing NUL, as `open_store`.
    """
    location = _check_location(raw, "normalize_location")
    m = _SCHEME_RE.match(location)
    if m is None:
        return _absolute(location, home)
    if m.group(1).lower() == LOCAL_SCHEME:
        return "file://" + _absolute(location[m.end() :], home)
    return location


# open_store --------------------------------------------------------------------------------


def check_options(scheme: str, options: Iterable[str], allowed: Iterable[str]) -> None:
    """A TypeError naming the options a scheme does not accept (and listing those it does)."""
    allowed = set(allowed)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(
            f"open_store: option(s) {', '.join(unknown)} not accepted for {scheme!r} stores "
            f"(accepted: {', '.join(sorted(allowed)) or 'none'})"
        )


def _supported() -> str:
    with _registry_lock:
        return ", ".join(s.label for s in _registry.values())


def _missing(scheme: Scheme) -> list[str]:
    missing = []
    for package in scheme.requires:
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(package)
    return missing


def _missing_dependency(scheme: Scheme, url: str, missing: list[str]) -> MissingDependency:
    hint = scheme.install_hint or f"pip install {' '.join(missing)}"
    noun = "package" if len(missing) == 1 else "packages"
    return MissingDependency(
        f"scheme {scheme.name!r} ({url}) needs the {', '.join(missing)} {noun}: {hint}"
    )


def open_store(url: str | os.PathLike[str], **options: Any) -> Store:
    """Open the store at `url`. See the module docstring for the accepted forms.

    Every scheme: ``create`` (bool, default True; False never creates anything).
    Local options: ``profile`` ("auto", "local", "nfs", "lustre"), ``lock`` ("auto",
    "kernel", "lease"), ``fsync`` (bool); ``create`` makes the root directory.
    S3 options: ``storage_options`` (dict passed to s3fs) or s3fs keyword arguments directly,
    ``endpoint_url``, ``connect_timeout``, ``read_timeout``, ``retries``.
    """
    url = _check_location(url, "open_store")
    name, location = _split(url)
    scheme = _registry.get(name)
    if scheme is None:
        raise UnknownScheme(
            f"no store backend for scheme {name!r} in {url!r}; supported: {_supported()}"
        )
    missing = _missing(scheme)
    if missing:
        raise _missing_dependency(scheme, url, missing)
    try:
        opener = scheme.resolve_opener()
    except ModuleNotFoundError as exc:
        # Found but not importable: a required package missing one of its own dependencies.
        if scheme.requires and exc.name is not None:
            raise _missing_dependency(scheme, url, [exc.name]) from exc
        raise
    check_options(name, options, scheme.accepted_options())
    create = options.pop("create", True)
    if not isinstance(create, bool):
        raise TypeError(f"open_store: create must be True or False, got {create!r}")
    return opener(url, location, options, create=create)


# The built-in schemes ----------------------------------------------------------------------


def _open_local(url: str, location: str, options: dict[str, Any], *, create: bool) -> Store:
    from ._local import PROFILES, LocalStore
    from .mounts import profile_for

    path = _absolute(location, None)
    profile = options.get("profile", "auto")
    lock = options.get("lock", "auto")
    if profile == "auto":
        probe = path
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        profile, kernel_ok = profile_for(probe)
    elif profile in PROFILES:
        kernel_ok = profile == "local"
    else:
        raise ValueError(f"open_store: profile must be auto or one of {PROFILES}, got {profile!r}")
    if lock not in ("auto", "kernel", "lease"):
        raise ValueError(f"open_store: lock must be auto, kernel or lease, got {lock!r}")
    kernel_locks = kernel_ok if lock == "auto" else lock == "kernel"
    if create:
        os.makedirs(path, exist_ok=True)
    return LocalStore(
        url, path, profile=profile, kernel_locks=kernel_locks, fsync=options.get("fsync")
    )


def _open_memory(url: str, location: str, options: dict[str, Any], *, create: bool) -> Store:
    # A name's table exists in this process as soon as it is named; nothing outlives it.
    from ._memory import MemoryStore

    return MemoryStore(url, location.strip("/"))


@functools.cache
def _s3_options() -> frozenset[str]:
    from ._s3 import accepted_options

    return accepted_options() | {"storage_options"}


def _open_s3(url: str, location: str, options: dict[str, Any], *, create: bool) -> Store:
    # Opening S3 makes no request (buckets are never created), whatever `create` says.
    from ._s3 import S3Store

    storage_options = dict(options.pop("storage_options", None) or {})
    storage_options.update(options)
    check_options("s3", storage_options, _s3_options() - {"storage_options"})
    if not location.strip("/"):
        raise ValueError(f"S3 store URL needs a bucket: {url!r} (expected s3://bucket/prefix)")
    return S3Store(url, location, storage_options)


register_scheme(
    LOCAL_SCHEME,
    _open_local,
    options={"profile", "lock", "fsync"},
    label="file (or a plain path)",
)
register_scheme(
    "s3",
    _open_s3,
    options=_s3_options,
    requires=("s3fs",),
    install_hint="pip install 'vllm-neuron[s3]'",
)
register_scheme("memory", _open_memory)
