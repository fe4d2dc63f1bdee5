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
`open_store` about which strings name local directories. `check_location` says whether
`open_store` would accept a location without opening anything: a registered scheme's name
followed by ``:`` but not ``//`` (``s3:/bucket/x``, ``S3:bucket``, ``file:/x``) is a mangled
URL, never a relative directory named ``s3:``, and is refused with the URL probably meant.

`probe_store` makes the one cheap request that tells a store that cannot serve (its bucket
or root directory missing, access refused, the endpoint not answering) from an empty one;
each scheme registers its probe.
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

from .errors import (
    InvalidLocation,
    MissingDependency,
    StoreAccessDenied,
    StoreMissing,
    StoreUnavailable,
    UnknownScheme,
)
from .store import Store

# RFC 3986 scheme syntax, followed by "://". Anchored: "a/b://c" is a local path.
_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
# A scheme name and a colon at the start: a URL when "//" follows, else (for a registered
# scheme) a mangled one.
_SCHEME_COLON_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
# The scheme that plain paths (no "scheme://") are opened with.
LOCAL_SCHEME = "file"
# Accepted by every scheme: `open_store` consumes it and hands it to the opener.
_UNIVERSAL_OPTIONS = frozenset({"create"})


class Prober(Protocol):
    """Makes one cheap request to ``store`` (opened by this scheme's opener): returns when
    the store can serve, raises `StoreMissing`, `StoreAccessDenied` or `StoreUnavailable`
    (naming the URL) when it cannot."""

    def __call__(self, store: Store) -> None: ...


class LocationCheck(Protocol):
    """Refuses (`InvalidLocation`) a URL of this scheme that misses a part it needs;
    ``location`` is the URL with ``scheme://`` removed. Makes no request."""

    def __call__(self, url: str, location: str) -> None: ...


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
    probe: Prober | str | None = None
    check: LocationCheck | None = None

    def resolve_opener(self) -> Opener:
        """The opener, importing its module first when it was registered as a string."""
        opener: Opener = _resolve(self.opener)
        return opener

    def resolve_probe(self) -> Prober | None:
        """The probe (None: this scheme has nothing to ask), imported like the opener."""
        if self.probe is None:
            return None
        probe: Prober = _resolve(self.probe)
        return probe

    def accepted_options(self) -> frozenset[str]:
        """Every option name this scheme takes, ``create`` included."""
        names = self.options() if callable(self.options) else self.options
        return frozenset(names) | _UNIVERSAL_OPTIONS


def _resolve(ref: Any) -> Any:
    """``ref`` itself, or the attribute a ``"module:function"`` string names (imported now)."""
    if not isinstance(ref, str):
        return ref
    module_name, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module_name, package=__package__), attr)


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
    probe: Prober | str | None = None,
    check: LocationCheck | None = None,
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
    ``label`` is how the scheme is listed in `UnknownScheme` errors. ``probe`` (a `Prober`
    or ``"module:function"``) is what `probe_store` asks of this scheme's stores (None:
    nothing to ask, as for memory). ``check`` is run by `check_location` (so by `open_store`)
    on every URL of the scheme, without any request.

    Registering a name twice is a ValueError unless ``replace`` is true.
    """
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", name):
        raise ValueError(f"register_scheme: {name!r} is not a URL scheme name")
    for what, ref in (("opener", opener), ("probe", probe)):
        if isinstance(ref, str) and not re.fullmatch(r"\.*[\w.]+:\w+", ref):
            raise ValueError(f"register_scheme: {what} {ref!r} is not 'module:function'")
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
        probe=probe,
        check=check,
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
    """``location`` as a str: non-empty, no NUL, and not a mangled URL (`_refuse_mangled`)."""
    location = os.fspath(location)
    if not isinstance(location, str) or not location:
        raise ValueError(f"{what} needs a non-empty path or URL, got {location!r}")
    if "\x00" in location:
        raise ValueError(f"store URL must not contain NUL: {location!r}")
    _refuse_mangled(location)
    return location


def _refuse_mangled(location: str) -> None:
    """`InvalidLocation` for a registered scheme's name and a colon without ``//`` after it.

    Such a string is a legal relative path (a directory named ``s3:``), but nobody means
    that: opened as a path, ``s3:/bucket/cache`` would create ``./s3:/bucket/cache`` and
    every node would "share" a cache that is local to each. A path that really starts so
    can be written ``./s3:/...``. Unregistered names (``C:``, ``bogus:x``) stay paths.
    """
    if _SCHEME_RE.match(location):
        return
    m = _SCHEME_COLON_RE.match(location)
    if m is None:
        return
    name = m.group(1).lower()
    with _registry_lock:
        known = name in _registry
    if not known:
        return
    rest = location[m.end() :].replace("\\", "/").lstrip("/").strip()
    if name == LOCAL_SCHEME:
        meant = f"file:///{rest}" if rest else "file:///absolute/path"
    else:
        meant = f"{name}://{rest}" if rest else f"{name}://..."
    raise InvalidLocation(
        f"{location!r} is not a valid {name} URL (a URL has '//' after '{name}:'); "
        f"did you mean {meant}?"
    )


def check_location(location: str | os.PathLike[str]) -> str:
    """``location`` (as a str) if `open_store` would accept it; else the error it would raise.

    Makes no request, imports no backend and creates nothing, so settings are checked at
    start-up: `ValueError` for an empty location or one containing NUL, `InvalidLocation`
    for a mangled URL of a registered scheme (``s3:/bucket/x``: "did you mean
    s3://bucket/x?") or a URL its scheme refuses (``s3://`` without a bucket),
    `UnknownScheme` for a ``scheme://`` nobody registered. Whether the store can be reached
    is `probe_store`'s question.
    """
    location = _check_location(location, "check_location")
    name, rest = _split(location)
    with _registry_lock:
        scheme = _registry.get(name)
    if scheme is None:
        raise UnknownScheme(
            f"no store backend for scheme {name!r} in {location!r}; supported: {_supported()}"
        )
    if scheme.check is not None:
        scheme.check(location, rest)
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
    which has no local directory to check. `InvalidLocation` for a mangled URL
    (``s3:/bucket``), which `open_store` refuses rather than open as a directory."""
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

    ValueError for an empty location or one containing NUL, and `InvalidLocation` for a
    mangled URL (``s3:/bucket``), as `open_store`; an unregistered ``scheme://`` is left as
    it is (`check_location` refuses it).
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
    ``endpoint_url``, ``connect_timeout``, ``read_timeout``, ``request_timeout``, ``retries``.

    The location is checked first (`check_location`): a mangled URL (``s3:/bucket``) is
    `InvalidLocation`, an unregistered scheme `UnknownScheme`. Opening makes no request;
    `probe_store` asks whether the store can serve.
    """
    url = check_location(url)
    name, location = _split(url)
    scheme = _registry[name]
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


def probe_store(store: Store) -> None:
    """Ask ``store`` once whether it can serve; return quietly when it can.

    One cheap request for S3 (a one-key listing of the prefix), a look at the root
    directory for a local store, nothing for memory. Raises `StoreMissing` (no such bucket,
    no root directory), `StoreAccessDenied` (``AccessDenied`` and other refusals; also a
    `PermissionError`) or `StoreUnavailable` (no answer within the store's bounds), each
    naming the store's URL and the backend's own error. What `open_store` cannot tell
    without a request, so a reader of a missing bucket is an error, not an empty listing.
    """
    name, _ = _split(store.url)
    with _registry_lock:
        scheme = _registry.get(name)
    probe = None if scheme is None else scheme.resolve_probe()
    if probe is not None:
        probe(store)


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


def _probe_local(store: Store) -> None:
    # A reader's question: is the root a directory this process may list? (A writer's
    # open_store(create=True) has made it already.) One scandir, first entry only.
    path = store.root
    try:
        with os.scandir(path) as entries:
            next(entries, None)
    except (FileNotFoundError, NotADirectoryError):
        raise StoreMissing(f"store {store.url}: no directory at {path}") from None
    except PermissionError as exc:
        raise StoreAccessDenied(f"store {store.url}: {path} cannot be read ({exc})") from None
    except OSError as exc:
        raise StoreUnavailable(f"store {store.url}: {path} cannot be read ({exc})") from exc


def _open_memory(url: str, location: str, options: dict[str, Any], *, create: bool) -> Store:
    # A name's table exists in this process as soon as it is named; nothing outlives it.
    from ._memory import MemoryStore

    return MemoryStore(url, location.strip("/"))


@functools.cache
def _s3_options() -> frozenset[str]:
    from ._s3 import accepted_options

    return accepted_options() | {"storage_options"}


def _check_s3(url: str, location: str) -> None:
    bucket = location.split("/", 1)[0]
    if not bucket:
        rest = location.strip("/")
        meant = f"s3://{rest}" if rest else "s3://bucket/prefix"
        raise InvalidLocation(
            f"S3 store URL needs a bucket: {url!r}; did you mean {meant}? "
            "(expected s3://bucket/prefix)"
        )


def _open_s3(url: str, location: str, options: dict[str, Any], *, create: bool) -> Store:
    # Opening S3 makes no request (buckets are never created), whatever `create` says.
    from ._s3 import S3Store

    storage_options = dict(options.pop("storage_options", None) or {})
    storage_options.update(options)
    check_options("s3", storage_options, _s3_options() - {"storage_options"})
    return S3Store(url, location, storage_options)


register_scheme(
    LOCAL_SCHEME,
    _open_local,
    options={"profile", "lock", "fsync"},
    label="file (or a plain path)",
    probe=_probe_local,
)
register_scheme(
    "s3",
    _open_s3,
    options=_s3_options,
    requires=("s3fs",),
    install_hint="pip install 'vllm-neuron[s3]'",
    probe="._s3:probe",
    check=_check_s3,
)
register_scheme("memory", _open_memory)
