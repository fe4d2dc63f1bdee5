"""What is a URL, what is a local directory, and which locations are refused.

Decided here once (`is_url`, `normalize_location`, `local_path_of`, `local_root_missing`),
so the code above the storage layer never sniffs for ``"://"`` and never disagrees with
`open_store` about which strings name local directories. `check_location` says whether
`open_store` would accept a location without opening anything: a registered scheme's name
followed by ``:`` but not ``//`` (``s3:/bucket/x``, ``S3:bucket``, ``file:/x``) is a mangled
URL, never a relative directory named ``s3:``, and is refused with the URL probably meant;
so is one followed by ``//`` without the colon (``s3//bucket/x``, ``file//x``).
`check_remote_location` is what every remote tier goes through (``--to``, ``--from``,
``--remote``, NEURON_LIBTORCH_REMOTE_CACHE): those checks, and no relative path.
"""

from __future__ import annotations

import os

from .errors import InvalidLocation, UnknownScheme
from .schemes import (
    _SCHEME_COLON_RE,
    _SCHEME_RE,
    _SCHEME_SLASHES_RE,
    LOCAL_SCHEME,
    scheme_labels,
    scheme_named,
)

__all__ = [
    "LOCAL_SCHEME",
    "absolute_path",
    "check_location",
    "check_remote_location",
    "is_url",
    "local_path_of",
    "local_root_missing",
    "normalize_location",
    "split_location",
]


def split_location(location: str) -> tuple[str, str]:
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
    """`InvalidLocation` for a registered scheme's name and a colon without ``//`` after it,
    or ``//`` without the colon before it (``s3//bucket/x``, ``file//x``).

    Such a string is a legal relative path (a directory named ``s3:`` or ``s3``), but nobody
    means that: opened as a path, ``s3:/bucket/cache`` would create ``./s3:/bucket/cache``
    and every node would "share" a cache that is local to each. A path that really starts
    so can be written ``./s3:/...``. Unregistered names (``C:``, ``bogus:x``) stay paths.
    """
    if _SCHEME_RE.match(location):
        return
    m = _SCHEME_COLON_RE.match(location) or _SCHEME_SLASHES_RE.match(location)
    if m is None:
        return
    name = m.group(1).lower()
    if scheme_named(name) is None:
        return
    rest = location[m.end() :].replace("\\", "/").lstrip("/").strip()
    if name == LOCAL_SCHEME:
        meant = f"file:///{rest}" if rest else "file:///absolute/path"
    else:
        meant = f"{name}://{rest}" if rest else f"{name}://..."
    raise InvalidLocation(
        f"{location!r} is not a valid {name} URL (a URL has '://' after '{name}'); "
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
    name, rest = split_location(location)
    if is_url(location) and _has_user_information(rest):
        # Credentials in a URL end up wherever the URL is recorded (events, logs, reports);
        # every backend takes them from its environment instead (AWS_*, a profile).
        raise InvalidLocation(
            f"{name}://<user information>@...: a store URL with credentials in it is refused; "
            "give credentials through the environment (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...)"
        )
    scheme = scheme_named(name)
    if scheme is None:
        raise UnknownScheme(
            f"no store backend for scheme {name!r} in {location!r}; supported: "
            f"{scheme_labels()}"
        )
    if scheme.check is not None:
        scheme.check(location, rest)
    return location


def check_remote_location(location: str, what: str) -> str:
    """``location`` if it can name a remote tier; else `InvalidLocation` naming ``what``
    (the option or setting and its value as given, e.g. ``--to 's3//bucket'``).

    Everything `check_location` refuses (a mangled URL, with the URL probably meant), and a
    relative path: a remote tier is shared, and a relative path names a different folder
    for each process and node that resolves it (``s3//bucket/x`` or ``s3/bucket/x``
    would silently become ``./s3/bucket/x`` on each). ``~/x`` is absolute once expanded.
    """
    try:
        check_location(location)
    except ValueError as exc:
        raise InvalidLocation(f"{what}: {exc}") from None
    scheme, path = split_location(location)  # a plain path, or a file:// URL's path
    home_relative = path == "~" or path.startswith("~/")
    if scheme == LOCAL_SCHEME and not home_relative and not os.path.isabs(path):
        raise InvalidLocation(
            f"{what}: {location!r} is a relative path; a remote tier must be an absolute "
            "path or a URL (s3://bucket/prefix, /mnt/fsx/cache, file:///shared/cache)"
        )
    return location


def _has_user_information(rest: str) -> bool:
    """Whether a URL's part after ``scheme://`` starts with ``user[:password]@``: an ``@``
    before any ``/`` (``s3://KEY:SECRET@bucket``), or after a ``user:`` whose password holds
    a ``/`` (AWS secret keys often do: ``s3://KEY:ab/cd@bucket``). An ``@`` in a path
    (``s3://bucket/x@y``) is a path."""
    if "@" not in rest:
        return False
    before = rest.split("@", 1)[0]
    return "/" not in before or ("/" not in before.split(":", 1)[0] and ":" in before)


def absolute_path(path: str, home: str | None) -> str:
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
    scheme, rest = split_location(location)
    return absolute_path(rest, home) if scheme == LOCAL_SCHEME else None


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
        return absolute_path(location, home)
    if m.group(1).lower() == LOCAL_SCHEME:
        return "file://" + absolute_path(location[m.end() :], home)
    return location
