"""Text a tier's writer chose (a note's error, a record's key, a signature's key id), as a
message or a log line may quote it: capped and escaped (`printable`). No imports of the
wing, so every module of it - and every wing above - can use it."""

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
