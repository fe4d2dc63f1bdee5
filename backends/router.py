"""`open_store`: the one way to turn a URL into a `Store`; `probe_store`; the built-in schemes.

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

What is a URL, and which locations are refused, is decided in ``locations.py``; the
registry itself is ``schemes.py``.

`probe_store` makes the one cheap request that tells a store that cannot serve (its bucket
or root directory missing, access refused, the endpoint not answering) from an empty one;
each scheme registers its probe.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Iterable
from typing import Any

from ._local import PROFILES, LocalStore
from .errors import (
    InvalidLocation,
    MissingDependency,
    StoreAccessDenied,
    StoreMissing,
    StoreUnavailable,
)
from .locations import LOCAL_SCHEME, absolute_path, check_location, split_location
from .mounts import profile_for
from .schemes import Scheme, register_scheme, scheme_named
from .store import Store

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
    name, location = split_location(url)
    scheme = scheme_named(name)
    assert scheme is not None  # check_location refused unregistered schemes
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
    name, _ = split_location(store.url)
    scheme = scheme_named(name)
    probe = None if scheme is None else scheme.resolve_probe()
    if probe is not None:
        probe(store)


# The built-in schemes ----------------------------------------------------------------------


def _open_local(url: str, location: str, options: dict[str, Any], *, create: bool) -> Store:
    path = absolute_path(location, None)
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
    from ._s3_client import accepted_options  # lazy: only s3:// URLs need the S3 client

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
