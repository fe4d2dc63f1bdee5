"""Text a tier's writer chose (a note's error, a record's key, a signature's key id), as a
message or a log line may quote it: capped and escaped (`printable`); and sizes and ages as
every message, command and report page writes them (`human_size`, `human_age`: the only
copies). No imports of the wing, so every module of it - and every wing above (upkeep's
messages) and layer above (the CLI, the report) - can use it."""

from __future__ import annotations

NOTE_TEXT_LIMIT = 2000
"""Characters of a note's text (its error, its host) that reach a message or a note."""


def printable(text: str, limit: int = NOTE_TEXT_LIMIT) -> str:
    """`text` as a message may quote it: every character that is not printable (control
    characters, line breaks, bidirectional overrides) escaped as Python would write it, and
    at most `limit` characters of it kept (the rest counted)."""
    kept = text[:limit]
    if not kept.isprintable():
        kept = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                       for c in kept)  # fmt: skip
    cut = len(text) - limit
    return kept if cut <= 0 else f"{kept}... ({cut} more characters)"


def human_size(n: float | None) -> str:
    """``512 B``, ``1.5 KiB`` ... ``2.0 TiB`` (powers of 1024, as `parse_size` reads them);
    ``-`` for an unknown size. The one size formatter of the package: the CLI, the report
    and the upkeep messages all write sizes through it, so a size reads the same everywhere."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(seconds: float) -> str:
    """``42s``, ``3.5m``, ``2.0h``, ``9.1d``; a negative age (a clock a little ahead of this
    one) reads ``0s``. The one age and duration formatter of the package (see `human_size`)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{max(0.0, seconds):.0f}s"
