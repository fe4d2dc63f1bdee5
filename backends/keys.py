"""Key validation: the only gate between a caller's string and a filesystem path.

Keys are relative, '/'-separated paths. Anything that could escape the store root
(``..``, absolute paths), alias another key (empty or ``.`` segments) or be truncated
by the OS (NUL) is refused before it is joined to a root.
"""

from __future__ import annotations

import functools
import re

from .errors import InvalidKey

_HEX_RE = re.compile(r"[0-9a-f]+")
_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def validate_key(key: str, *, allow_empty: bool = False) -> str:
    """Return `key` unchanged if it is a safe relative key, else raise `InvalidKey`.

    `allow_empty` admits "" (the store root) for prefix-style arguments such as `list`.
    """
    if not isinstance(key, str):
        raise InvalidKey(f"store key must be a str, got {type(key).__name__}: {key!r}")
    _check(key, allow_empty)  # cached: the same keys are checked on every operation
    return key


@functools.lru_cache(maxsize=16384)
def _check(key: str, allow_empty: bool) -> None:
    """Raise `InvalidKey` for a bad key; returns (and is cached) only for good ones."""
    if key == "":
        if allow_empty:
            return
        raise InvalidKey("store key must not be empty")
    if "\x00" in key:
        raise InvalidKey(f"store key must not contain NUL: {key!r}")
    if "\\" in key:
        raise InvalidKey(f"store key must use '/' separators, not '\\': {key!r}")
    if key.startswith("/"):
        raise InvalidKey(f"store key must be relative, not absolute: {key!r}")
    if _URL_RE.match(key):
        raise InvalidKey(f"store key must be a relative path, not a URL: {key!r}")
    for segment in key.split("/"):
        if segment == "":
            raise InvalidKey(f"store key has an empty segment (leading/trailing or '//'): {key!r}")
        if segment in (".", ".."):
            raise InvalidKey(f"store key must not contain '{segment}' segments: {key!r}")


GOOD_KEYS: set[str] = set()
"""Keys `remember_good` has checked: the hot paths test membership here (one set lookup on
a string whose hash is cached) before paying for a call to the checker."""
_GOOD_KEYS_MAX = 1 << 16


def remember_good(key: str) -> None:
    """`validate_key(key)`, and remember it in `GOOD_KEYS` (raises `InvalidKey` if bad)."""
    validate_key(key)
    if len(GOOD_KEYS) >= _GOOD_KEYS_MAX:
        GOOD_KEYS.clear()  # bounded, like the checker's own cache
    GOOD_KEYS.add(key)


def validate_prefix(prefix: str) -> str:
    """Like `validate_key` but accepts "" (the root) and a single trailing '/'.

    Returns the prefix without its trailing '/'. ``"a//"`` and ``"/"`` are refused (an
    empty segment, an absolute path), as they are for keys.
    """
    if isinstance(prefix, str) and prefix.endswith("/") and prefix != "/":
        try:
            return validate_key(prefix[:-1], allow_empty=True)
        except InvalidKey as exc:
            raise InvalidKey(f"{exc} (in {prefix!r})") from None
    return validate_key(prefix, allow_empty=True)


def validate_hex(value: str, *, length: int | None = None, what: str = "hash") -> str:
    """Refuse a hash that is not lower-case hex (of `length` chars when given)."""
    if not isinstance(value, str) or not _HEX_RE.fullmatch(value):
        raise InvalidKey(f"{what} must be lower-case hex, got {value!r}")
    if length is not None and len(value) != length:
        raise InvalidKey(f"{what} must be {length} hex characters, got {len(value)}: {value!r}")
    return value


def join(*parts: str) -> str:
    """Join key parts with '/', skipping empty parts (the root)."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))
