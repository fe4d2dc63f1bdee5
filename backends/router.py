"""`open_store`: the one way to turn a URL into a `Store`.

    /abs/path, rel/path, file:///abs/path   local disk (profile from /proc/mounts or option)
    s3://bucket/prefix                       S3 through s3fs
    memory://name                            in-process memory, isolated per name

Options a backend cannot take are a `TypeError` naming them, not silence.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any
from urllib.parse import urlsplit

from .base import Store
from .errors import MissingDependency, UnknownScheme

_INSTALL_HINTS = {"s3": ("s3fs", "pip install 'vllm-neuron[s3]'")}
_SUPPORTED = ("file (or a plain path)", "s3", "memory")


def _reject_unknown(scheme: str, options: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(
            f"open_store: option(s) {', '.join(unknown)} not accepted for {scheme!r} stores "
            f"(accepted: {', '.join(sorted(allowed)) or 'none'})"
        )


def open_store(url: str | os.PathLike[str], **options: Any) -> Store:
    """Open the store at `url`. See the module docstring for the accepted forms.

    Local options: ``profile`` ("auto", "local", "nfs", "lustre"), ``lock`` ("auto",
    "kernel", "lease"), ``fsync`` (bool), ``create`` (make the root directory, default True).
    S3 options: ``storage_options`` (dict passed to s3fs) or s3fs keyword arguments directly,
    ``endpoint_url``, ``connect_timeout``, ``read_timeout``, ``retries``.
    """
    url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise ValueError(f"open_store needs a non-empty path or URL, got {url!r}")
    if "\x00" in url:
        raise ValueError(f"store URL must not contain NUL: {url!r}")
    scheme = urlsplit(url).scheme if "://" in url else ""
    if scheme in ("", "file"):
        return _open_local(url, options)
    if scheme == "memory":
        _reject_unknown("memory", options, set())
        from ._memory import MemoryStore

        name = url[len("memory://") :].strip("/")
        return MemoryStore(url, name)
    if scheme == "s3":
        if importlib.util.find_spec("s3fs") is None:
            pkg, hint = _INSTALL_HINTS["s3"]
            raise MissingDependency(f"scheme 's3' ({url}) needs the {pkg} package: {hint}")
        from ._s3 import S3Store, accepted_options

        storage_options = dict(options.pop("storage_options", None) or {})
        storage_options.update(options)
        _reject_unknown("s3", storage_options, set(accepted_options()))
        bucket_and_prefix = url[len("s3://") :]
        if not bucket_and_prefix.strip("/"):
            raise ValueError(f"S3 store URL needs a bucket: {url!r} (expected s3://bucket/prefix)")
        return S3Store(url, bucket_and_prefix, storage_options)
    hint = ""
    if scheme in _INSTALL_HINTS:
        hint = f"; for {scheme!r} install {_INSTALL_HINTS[scheme][1]}"
    raise UnknownScheme(
        f"no store backend for scheme {scheme!r} in {url!r}; supported: {', '.join(_SUPPORTED)}"
        + hint
    )


def _open_local(url: str, options: dict[str, Any]) -> Store:
    from ._local import PROFILES, LocalStore
    from .mounts import profile_for

    _reject_unknown("file", options, {"profile", "lock", "fsync", "create"})
    path = url[len("file://") :] if url.startswith("file://") else url
    path = os.path.abspath(os.path.expanduser(path))
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
    if options.get("create", True):
        os.makedirs(path, exist_ok=True)
    return LocalStore(
        url, path, profile=profile, kernel_locks=kernel_locks, fsync=options.get("fsync")
    )
