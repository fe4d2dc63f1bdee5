"""Inspecting and maintaining a cache tier: list, verify, explain, prune.

The CLI is a thin shell over these functions. Inspection returns frozen records, corrupt
entries are collected rather than raised, and deletion is plan-then-execute (so
`prune --dry-run` shows exactly what `prune` would do).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_neuron.backends import Store, join
from vllm_neuron.backends.records import RECORD_MAX_BYTES
from vllm_neuron.envs.compile_cache import parse_size as parse_size_setting

from ..entry.check import KEY_RE, VerifyResult, check_entry
from ..entry.record import (
    ENTRY_RECORD,
    EntryProblem,
    EntryRecord,
    check_sizes,
    decode_record,
)


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

    @property
    def known_age(self) -> float | None:
        """The age, or None when the record does not read (no creation time to go by)."""
        return None if self.created <= 0 else self.age_seconds


def list_entries(store: Store, *, sizes: bool = False) -> list[EntryInfo]:
    """Every published entry of `store`, oldest first; unreadable ones carry a `problem`.

    So do broken publications (a commit record that does not read or names a version
    without files) and, alike on every backend, entries whose record is missing or does
    not read: a listing never leaves out what a fetch would find defective. With `sizes`,
    every file is also checked against its recorded size (a stat each on local disk, a
    listing per entry on S3), the check every local hit makes: an entry that would miss
    for a short or missing file says so in the listing (`cache ls`).
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
            try:  # bounded, regular files only (a FIFO or an oversized record: its problem)
                data = store.read(join(found.prefix, ENTRY_RECORD), max_size=RECORD_MAX_BYTES)
                record = None if data is None else decode_record(data)
                if data is None:
                    problem = f"{ENTRY_RECORD} is missing"
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                problem = f"unreadable record: {exc}"
        if record is None:
            out.append(EntryInfo(key, 0, 0, 0.0, "?", "?", 0.0, problem, found.version))
            continue
        if sizes and found.prefix is not None:
            try:
                check_sizes(store, found.prefix, record)
            except EntryProblem as exc:
                problem = str(exc)
        out.append(
            EntryInfo(
                key=key,
                size=record.total_size,
                files=len(record.files),
                created=record.created,
                toolchain=record.toolchain,
                target=record.target,
                compile_seconds=record.compile_seconds,
                problem=problem,
                version=found.version,
            )
        )
    return sorted(out, key=lambda e: (e.created, e.key))


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


def _read_record(store: Store, key: str) -> EntryRecord:
    prefix = store.published(key)
    data = (None if prefix is None
            else store.read(join(prefix, ENTRY_RECORD), max_size=RECORD_MAX_BYTES))
    if data is None:
        raise KeyError(f"no entry {key} in {store.url}")
    return decode_record(data)


def explain_keys(store: Store, key_a: str, key_b: str) -> dict[str, tuple[str, str]]:
    """Which key components differ between two entries: {component: (hash_a, hash_b)}."""
    return {d.name: (d.hash_a, d.hash_b) for d in explain_entries(store, key_a, key_b)}


@dataclass(frozen=True)
class ComponentDiff:
    """One key component that differs between two entries: its hashes, and the values it
    was hashed from where both entries' records carry them (else None)."""

    name: str
    hash_a: str
    hash_b: str
    values: dict[str, tuple[Any, Any]] = field(default_factory=dict)


def key_inputs(record: EntryRecord) -> dict[str, dict[str, Any]]:
    """What each key component of `record` was computed from, as far as the record says.

    A hash alone answers "did it change", not "what changed". The record keeps the
    target (``target``) and the toolchain's artifact metadata in ``meta`` (output shapes,
    input count: `CompiledArtifact`); a writer that records more puts it in ``meta``
    under ``key_inputs`` ({component: value}) or under the component's own name
    (``versions``, ``compiler_args``, ``input_shapes``, ``replica_groups``). Components
    with nothing recorded are left out.
    """
    meta = record.meta if isinstance(record.meta, dict) else {}
    recorded = meta.get("key_inputs")
    recorded = recorded if isinstance(recorded, dict) else {}
    out: dict[str, dict[str, Any]] = {}

    def put(component: str, label: str, value: Any) -> None:
        if value is not None:
            out.setdefault(component, {})[label] = value

    for component, value in recorded.items():
        put(str(component), str(component), value)
    put("target", "target", record.target)
    put("target", "toolchain", record.toolchain)
    for name in ("versions", "compiler_args", "replica_groups"):
        put(name, name, meta.get(name))
    put("inputs", "input_shapes", meta.get("input_shapes"))
    put("inputs", "num_inputs", meta.get("num_inputs"))
    shapes = meta.get("output_shapes")
    put("graph", "output_shapes", None if shapes is None else list(shapes))
    return out


def explain_entries(store: Store, key_a: str, key_b: str) -> list[ComponentDiff]:
    """The key components that differ between two entries, with the recorded values
    behind them where both entries carry them (`key_inputs`); `KeyError` for a key the
    tier lacks. Ordered as the key hashes them (`key.COMPONENTS`), unknown names after."""
    from ..key.cache_key import explain_key_difference  # lazy: the key imports torch

    rec_a, rec_b = _read_record(store, key_a), _read_record(store, key_b)
    a, b = rec_a.components, rec_b.components
    inputs_a, inputs_b = key_inputs(rec_a), key_inputs(rec_b)
    out = []
    for name in explain_key_difference(a, b):
        va, vb = inputs_a.get(name, {}), inputs_b.get(name, {})
        both = {label: (va[label], vb[label]) for label in va if label in vb}
        out.append(ComponentDiff(
            name=name, hash_a=a.get(name, "-"), hash_b=b.get(name, "-"),
            values={k: v for k, v in both.items() if v[0] != v[1]} or both,
        ))
    return out


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
