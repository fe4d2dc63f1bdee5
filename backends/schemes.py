"""The registry of URL schemes: what each scheme opens, accepts, needs and probes.

`open_store` (``router.py``) and the location checks (``locations.py``) only look schemes
up here, so adding a backend is one `register_scheme` call and never edits them.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from .store import Store

# RFC 3986 scheme syntax, followed by "://". Anchored: "a/b://c" is a local path.
_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
# A scheme name and a colon at the start: a URL when "//" follows, else (for a registered
# scheme) a mangled one.
_SCHEME_COLON_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
# A scheme name and "//" without the colon ("s3//bucket/x"): mangled, for a registered scheme.
_SCHEME_SLASHES_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)//")
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


def scheme_named(name: str) -> Scheme | None:
    """The registered scheme called ``name`` (any case), or None."""
    with _registry_lock:
        return _registry.get(name.lower())


def scheme_labels() -> str:
    """How the registered schemes are listed in errors: their labels, comma-separated."""
    with _registry_lock:
        return ", ".join(s.label for s in _registry.values())
