"""What the contract tests feed a store: records shaped like real ones, keys and prefixes
that must be refused, and bytes any text handling on the way would corrupt.

Shared by several contract modules, so each sample is defined once.
"""

from __future__ import annotations

from ..records import Record
from ..store import Store


class ContractEvent(Record, tag="contract-event", frozen=True):
    """A small event record, shaped like the ones the domain code logs."""

    key: str
    rank: int
    shape: tuple[int, ...] = ()


class OtherEvent(Record, tag="contract-other", frozen=True):
    """A second record kind, so streams mix tags as real ones do."""

    note: str


BAD_KEYS = (
    "../escape",
    "a/../../escape",
    "a/./b",
    ".",
    "/etc/passwd",
    "a//b",
    "",
    "a\x00b",
    "a/",
    "a\\b",
    "s3://bucket/key",
)
"""Keys every key-taking operation must refuse with `InvalidKey`."""

BAD_PREFIXES = ("../escape", "/abs", "a//", "a//b", "a\x00b", "a/../b")
"""Prefixes (where "" and one trailing '/' are fine) that must be refused."""

BINARY = bytes(range(256)) * 4 + b"\x00\xff\n\r\n"
"""Every byte value, NUL, and line endings a text mode would rewrite."""


def all_files(store: Store) -> dict[str, bytes]:
    """Every file in the store with its content."""
    return {k: store.read(k) or b"" for k in store.list("")}
