"""Checking one published entry of a tier: its record, its sizes or every checksum.

Below the tiers and the trust policy, which both judge entries by it; a check collects the
problem (with the publication it judged) instead of raising it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_neuron.backends import Store, join
from vllm_neuron.backends.records import RECORD_MAX_BYTES

from .record import ENTRY_RECORD, EntryProblem, check_checksums, check_sizes, decode_record
from .text import printable

KEY_RE = re.compile(r"[0-9a-f]{32}")
"""What a cache key looks like: 32 lowercase hex digits (an entry's directory name)."""


@dataclass(frozen=True)
class VerifyResult:
    key: str
    ok: bool
    problem: str | None
    version: str | None = None  # the publication judged: what a quarantine withdraws


def check_entry(store: Store, key: str, *, full: bool = True) -> VerifyResult:
    """The published entry `key` of `store` checked, with the version that was judged."""
    found = store.publication(key)
    try:
        if found.state == "absent":
            raise EntryProblem(f"{store.url}/{key} was withdrawn while verifying")
        if found.problem is not None or found.prefix is None:
            raise EntryProblem(str(found.problem))
        data = store.read(join(found.prefix, ENTRY_RECORD), max_size=RECORD_MAX_BYTES)
        if data is None:
            raise EntryProblem(f"{store.url}/{key}: {ENTRY_RECORD} is missing")
        record = decode_record(data)
        if record.key != key:
            raise EntryProblem(f"{store.url}/{key}: record names key {printable(record.key, 100)}")
        (check_checksums if full else check_sizes)(store, found.prefix, record)
    except Exception as exc:  # noqa: BLE001 - collected, not raised
        return VerifyResult(key, False, str(exc), found.version)
    return VerifyResult(key, True, None, found.version)


def verify_entry(store: Store, key: str, *, full: bool = True) -> str | None:
    """The problem with the published entry `key` of `store`, or None if it is sound."""
    return check_entry(store, key, full=full).problem
