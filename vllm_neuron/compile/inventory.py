"""Inspecting and maintaining a cache tier: list, verify, explain, prune.

The CLI is a thin shell over these functions. Inspection returns frozen records, corrupt
entries are collected rather than raised, and deletion is plan-then-execute (so
`prune --dry-run` shows exactly what `prune` would do).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_neuron.backends import Store, join
from vllm_neuron.envs.compile_cache import parse_size as parse_size_setting

from .entry import ENTRY_RECORD, EntryProblem, check_checksums, check_sizes, decode_record

KEY_RE = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class EntryInfo:
    """One published entry of a tier."""

    key: str
    size: int
    files: int
    created: float
    toolchain: str
    target: str
    compile_seconds: float
    problem: str | None = None
    version: str | None = None  # the publication listed (`Publication.version`)

    @property
    def age_seconds(self) -> float:
        return max(0.0, time.time() - self.created)


def list_entries(store: Store) -> list[EntryInfo]:
    """Every published entry of `store`, oldest first; unreadable ones carry a `problem`.

    So do broken publications (a commit record that does not read or names a version
    without files) and, alike on every backend, entries whose record is missing or does
    not read: a listing never leaves out what a fetch would find defective.
    """
    out = []
    for key in store.published_children(""):
        if not KEY_RE.fullmatch(key):
            continue
        found = store.publication(key)
        if found.state == "absent":  # withdrawn since it was listed
            continue
        problem, record = found.problem, None
        if found.prefix is not None and problem is None:
            data = store.read(join(found.prefix, ENTRY_RECORD))
            if data is None:
                problem = f"{ENTRY_RECORD} is missing"
            else:
                try:
                    record = decode_record(data)
                except Exception as exc:  # noqa: BLE001 - reported, not raised
                    problem = f"unreadable record: {exc}"
        if record is None:
            out.append(EntryInfo(key, 0, 0, 0.0, "?", "?", 0.0, problem, found.version))
            continue
        out.append(
            EntryInfo(
                key=key,
                size=record.total_size,
                files=len(record.files),
                created=record.created,
                toolchain=record.toolchain,
                target=record.target,
                compile_seconds=record.compile_seconds,
                version=found.version,
            )
        )
    return sorted(out, key=lambda e: (e.created, e.key))


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
        data = store.read(join(found.prefix, ENTRY_RECORD))
        if data is None:
            raise EntryProblem(f"{store.url}/{key}: {ENTRY_RECORD} is missing")
        record = decode_record(data)
        if record.key != key:
            raise EntryProblem(f"{store.url}/{key}: record names key {record.key}")
        (check_checksums if full else check_sizes)(store, found.prefix, record)
    except Exception as exc:  # noqa: BLE001 - collected, not raised
        return VerifyResult(key, False, str(exc), found.version)
    return VerifyResult(key, True, None, found.version)


def verify_entry(store: Store, key: str, *, full: bool = True) -> str | None:
    """The problem with the published entry `key` of `store`, or None if it is sound."""
    return check_entry(store, key, full=full).problem


def verify_entries(
    store: Store,
    *,
    full: bool = True,
    quarantine: Callable[[str, str, str | None], None] | None = None,
) -> list[VerifyResult]:
    """Check every entry (all checksums when `full`, sizes otherwise), broken ones too.

    `quarantine(key, problem, version)` is called for every entry that fails; `version`
    is the publication judged, for `quarantine_entry(..., version=version)`.
    """
    results = []
    for info in list_entries(store):
        if info.problem is not None:
            result = VerifyResult(info.key, False, info.problem, info.version)
        else:
            result = check_entry(store, info.key, full=full)
        if result.problem is not None and quarantine is not None:
            quarantine(result.key, result.problem, result.version)
        results.append(result)
    return results


def explain_keys(store: Store, key_a: str, key_b: str) -> dict[str, tuple[str, str]]:
    """Which key components differ between two entries: {component: (hash_a, hash_b)}."""
    records = {}
    for key in (key_a, key_b):
        prefix = store.published(key)
        data = None if prefix is None else store.read(join(prefix, ENTRY_RECORD))
        if data is None:
            raise KeyError(f"no entry {key} in {store.url}")
        records[key] = decode_record(data)
    a, b = records[key_a].components, records[key_b].components
    return {
        name: (a.get(name, "-"), b.get(name, "-"))
        for name in sorted(set(a) | set(b))
        if a.get(name) != b.get(name)
    }


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def parse_duration(text: str) -> float:
    """'90', '90s', '30m', '12h', '7d', '2w' -> seconds."""
    match = _DURATION.match(text.lower())
    if not match:
        raise ValueError(f"--older-than: cannot parse duration {text!r} (e.g. 30m, 12h, 7d)")
    scale = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[match.group(2)]
    return float(match.group(1)) * scale


def parse_size(text: str) -> int:
    """'500', '500M', '10G', '1.5GiB' -> bytes (powers of 1024): the rules of
    VLLM_NEURON_CACHE_MAX_SIZE (`vllm_neuron.envs.compile_cache.parse_size`)."""
    return parse_size_setting(text, what="--max-size")
