"""Canonical compiler flags: the form the ``compiler_args`` component of a key hashes.

Why: the same compile is often configured differently on different ranks and hosts - the
flags come from an environment variable, a config file and defaults, assembled in an
arbitrary order, and some of them only choose where outputs and logs go, usually with a
per-process path. Hashing them as given would split the cache per rank. So ``--flag value``
becomes ``--flag=value``, output-location flags (:data:`OUTPUT_LOCATION_FLAGS`) are
dropped, and the result is sorted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["OUTPUT_LOCATION_FLAGS", "canonicalize_compiler_args"]

# Flags that only choose where outputs and logs go; they never change the compiled code,
# and they usually hold per-process paths, so keeping them would split the cache per rank.
# Compared after mapping "_" to "-".
OUTPUT_LOCATION_FLAGS = frozenset(
    {"--output", "--logfile", "--log-file", "--workdir", "--work-dir", "--cache-dir"}
)

_NUMERIC_TOKEN_RE = re.compile(r"^-\.?\d")


def _is_flag(token: str) -> bool:
    return token.startswith("-") and token != "-" and not _NUMERIC_TOKEN_RE.match(token)


def canonicalize_compiler_args(args: Sequence[str]) -> list[str]:
    """Canonical compiler flags: ``--flag value`` -> ``--flag=value``, output-only flags
    dropped, sorted.

    Sorting makes the key independent of the order flags were assembled in (env var,
    config file, defaults), which is arbitrary for the compilers we drive. A token that
    does not start with ``-`` (or is a negative number) after a flag is that flag's value.
    """
    canon: list[str] = []
    tokens = [str(t) for t in args]
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not _is_flag(token):
            canon.append(token)
            continue
        if "=" in token:
            flag = token.split("=", 1)[0]
            item = token
        elif i < len(tokens) and not _is_flag(tokens[i]):
            flag = token
            item = f"{token}={tokens[i]}"
            i += 1
        else:
            flag = item = token
        if flag.replace("_", "-") not in OUTPUT_LOCATION_FLAGS:
            canon.append(item)
    return sorted(canon)
