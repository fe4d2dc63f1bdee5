"""The primitives every settings group parses with, and the registry of cached groups.

Why shared: the conventions of :mod:`vllm_neuron.envs` (blank means unset, strict booleans,
errors quoting the variable exactly as set) only hold if every group reads through the same
few functions. Whether a value names a URL or a local directory is asked of the storage
layer (`is_url`, `local_path_of`, `normalize_location`), so a setting is never read as a
directory that `open_store` would open as a URL, or the other way round.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from vllm_neuron.backends import (
    check_remote_location,
    local_path_of,
    normalize_location,
)

from .secrets import has_url_credentials, redact_text

__all__ = [
    "ConfigError",
    "EnvVar",
    "bool_var",
    "choice_var",
    "environ_or_default",
    "expand_path",
    "forget_parsed_groups",
    "location_var",
    "normalize_location_var",
    "parse_bool",
    "parse_positive_float",
    "parsed_once",
    "raw",
    "remote_location_var",
    "require_directory",
    "require_local_directory",
]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting has a malformed value; the message names the setting and the value."""


@dataclass(frozen=True)
class EnvVar:
    """Documentation record of one variable, so the CLI and docs can list them all."""

    name: str
    default: str
    feature: str
    description: str


def environ_or_default(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    """``environ``, or the process's environment when None: every loader takes a mapping
    so that tests feed it dictionaries instead of patching the process."""
    return os.environ if environ is None else environ


def raw(environ: Mapping[str, str], name: str) -> str | None:
    """The stripped value of ``name``, or None when it is unset or blank.

    Blank counts as unset because ``export VAR=`` is how many launch scripts unset one.
    """
    value = environ.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def pid_marker(environ: Mapping[str, str], name: str) -> int | None:
    """An internal marker naming a process (its id), or None when unset; a value that is
    no ASCII number is no marker (None), never an error: it is no setting of the user's."""
    value = raw(environ, name)
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


def parse_bool(name: str, raw_value: str) -> bool:
    """Parse a boolean setting strictly: a typo must not silently mean False."""
    lowered = raw_value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(
        f"{name}={raw_value!r} is not a boolean; use one of 0/1, true/false, yes/no, on/off"
    )


def parse_positive_float(name: str, raw_value: str) -> float:
    """Parse a finite number > 0 (a timeout of 0, NaN or infinity is a configuration bug)."""
    try:
        value = float(raw_value)
    except ValueError:
        raise ConfigError(f"{name}={raw_value!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={raw_value!r} must be a finite number greater than 0")
    return value


def choice_var(
    environ: Mapping[str, str], name: str, choices: tuple[str, ...], default: str
) -> str:
    """One of ``choices`` (compared lower-cased), ``default`` when unset or blank; anything
    else is a ConfigError naming the variable, the value as set and the choices."""
    value = raw(environ, name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered not in choices:
        raise ConfigError(f"{name}={environ[name]!r} is not one of {', '.join(choices)}")
    return lowered


def bool_var(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """A strict boolean variable, ``default`` when unset or blank."""
    # Errors quote the value exactly as set: a stray "\r" from a CRLF env file must show.
    return default if raw(environ, name) is None else parse_bool(name, environ[name])


def expand_path(path: str, environ: Mapping[str, str]) -> str:
    """``~`` expanded with the HOME of ``environ`` (not only os.environ), made absolute.

    Absolute because worker processes may change directory after start-up.
    """
    home = raw(environ, "HOME")
    if home is not None and (path == "~" or path.startswith("~/")):
        path = home + path[1:]
    return os.path.abspath(os.path.expanduser(path))


# Path-or-URL settings ------------------------------------------------------------------------


def location_var(environ: Mapping[str, str], name: str) -> str | None:
    """The stripped value of a path-or-URL variable, or None when unset or blank.

    A NUL byte is refused here, naming the variable: the storage layer would refuse it
    too, but only at the first write, with a message that names no setting. So is a URL
    with credentials (``s3://KEY:SECRET@bucket``): no backend reads them from the URL (S3
    takes them from the AWS variables and files), and a store's URL is recorded in events
    and messages, where a secret must never be (`secrets`); the error shows it redacted.
    """
    value = raw(environ, name)
    if value is not None and "\x00" in value:
        raise ConfigError(f"{name}={value!r} contains a NUL byte")
    if value is not None and has_url_credentials(value):
        raise ConfigError(
            f"{name}={redact_text(value)!r}: a store URL must not carry credentials "
            "(user:password@); give them to the backend instead (S3: the AWS_* variables, "
            "~/.aws or an instance role)"
        )
    return value


def remote_location_var(environ: Mapping[str, str], name: str) -> str | None:
    """A remote tier's variable, as set (stripped), or None: checked as every remote tier
    given anywhere is (`check_remote_location`: a mangled URL such as ``s3//bucket/x`` with
    the URL probably meant, and a relative path, which each process would resolve against
    its own directory), a ConfigError naming the variable and the value."""
    value = location_var(environ, name)
    if value is not None:
        try:
            check_remote_location(value, f"{name}={environ[name]!r}")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return value


def normalize_location_var(environ: Mapping[str, str], name: str) -> str | None:
    """A path-or-URL variable as a setting keeps it: a local path made absolute (``~``
    expanded with the HOME of ``environ``), a URL as given. A mangled URL (``s3:/bucket``)
    is a ConfigError naming the variable."""
    value = location_var(environ, name)
    if value is None:
        return None
    try:
        return normalize_location(value, home=raw(environ, "HOME"))
    except ValueError as exc:
        raise ConfigError(f"{name}={environ[name]!r}: {exc}") from None


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
            if os.path.isdir(probe):
                continue  # another process (a rank starting beside this one) made it meanwhile
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


def require_local_directory(
    location: str, environ: Mapping[str, str], *, setting: str, purpose: str
) -> str:
    """``location`` (a path or URL), its local directory checked with `require_directory`
    when it has one; a store URL (``s3://``, ``memory://``) has none to look at."""
    try:
        path = local_path_of(location, home=raw(environ, "HOME"))
    except ValueError as exc:  # a mangled URL, which is no directory
        raise ConfigError(f"{setting}: {exc}") from None
    if path is not None:
        require_directory(path, setting=setting, purpose=purpose)
    return location


# Cached groups -------------------------------------------------------------------------------

_PARSED_ONCE: list[functools._lru_cache_wrapper[Any]] = []


def parsed_once(loader: Callable[[], T]) -> functools._lru_cache_wrapper[T]:
    """Cache a group's accessor for the process and register it with
    :func:`forget_parsed_groups`.

    Why a registry: ``reset_for_tests`` must forget every group, and a group added later
    must not depend on someone remembering to list it there.
    """
    cached = functools.lru_cache(maxsize=1)(loader)
    _PARSED_ONCE.append(cached)
    return cached


def forget_parsed_groups() -> None:
    """Forget every group cached by :func:`parsed_once`; the next access re-reads."""
    for accessor in _PARSED_ONCE:
        accessor.cache_clear()
