"""The Prometheus series of the compile cache, and the one mapping from events to them.

Every series is a counter named ``vllm_neuron_cache_*_total``. Both outputs go through
:func:`samples_of`, the single mapping from an event record (``compile/entry/events.py``) to
counter increments: the live series a vLLM process writes as it records each event
(:mod:`vllm_neuron.metrics.live`) and ``cache stats --prometheus``, which folds the same
event segments ``read_stats`` folds (:func:`fold_events`). One mapping is why the two carry
the same names, labels and meaning; a reader of both never has to translate.

Labels take a handful of values (tiers, lease outcomes, eviction reasons), never a key or
a URL, so a fleet's series stay few. Every series is present from the start at 0 (with the
label values listed in :attr:`Series.zero`): a dashboard sees "no compiles", not "no data".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm_neuron.backends import Record, open_store
from vllm_neuron.compile.entry.events import (
    CACHE_EVENTS,
    EVENTS_STREAM,
    CacheHit,
    CacheMiss,
    Compiled,
    CompileFailed,
    Deferred,
    Evicted,
    Fetched,
    LeaseTakenOver,
    LeaseWaited,
    LoadFailed,
    LockWaited,
    Promoted,
    RemoteUnavailable,
    Untrusted,
    VerificationFailed,
)

__all__ = [
    "SERIES",
    "Series",
    "SeriesTotals",
    "eviction_reason",
    "fold_events",
    "samples_of",
]

PREFIX = "vllm_neuron_cache_"


@dataclass(frozen=True, eq=False)
class Series:
    """One counter family: ``metric`` is the family name, samples are ``metric + "_total"``.

    Compared and hashed by identity (each is one module constant): the live counters look
    one up per event, and a field-wise hash would cost more than the lookup.
    """

    metric: str
    help: str
    labels: tuple[str, ...] = ()
    zero: tuple[tuple[str, ...], ...] = ((),)  # label values exported at 0 from the start

    @property
    def sample(self) -> str:
        return self.metric + "_total"


def _series(name: str, help: str, labels: tuple[str, ...] = (),
            zero: tuple[tuple[str, ...], ...] = ((),)) -> Series:
    return Series(PREFIX + name, help, labels, zero)


_TIERS = (("memory",), ("local",), ("baked",), ("remote",))
_LEASE_OUTCOMES = tuple((o,) for o in ("fetched", "acquired", "failed-elsewhere",
                                         "remote-down", "read-only", "timeout",
                                         "alone"))

HITS = _series("hits", "Graphs served without compiling here, by tier: memory (already "
               "loaded in the process), local, baked (a read-only tier), remote (fetched).",
               ("tier",), _TIERS)
MISSES = _series("misses", "Graphs no tier held when this process looked (it compiled "
                 "them, or failed).")
COMPILES = _series("compiles", "Graphs compiled and published to the local tier.")
COMPILE_SECONDS = _series("compile_seconds", "Seconds spent compiling the graphs counted "
                          "by vllm_neuron_cache_compiles_total.")
COMPILE_FAILURES = _series("compile_failures", "Compiles that failed.")
FETCH_BYTES = _series("fetch_bytes", "Bytes fetched from the remote tier (verified and "
                      "published locally).")
FETCH_SECONDS = _series("fetch_seconds", "Seconds spent fetching from the remote tier.")
LOCK_WAIT_SECONDS = _series("lock_wait_seconds", "Seconds waited on a key's local lock "
                            "while another process compiled it (waits above 50 ms).")
LEASE_WAITS = _series("lease_waits", "Waits on the fleet: another node held the key's "
                      "remote lease, by how the wait ended.", ("outcome",), _LEASE_OUTCOMES)
LEASE_WAIT_SECONDS = _series("lease_wait_seconds", "Seconds waited on the fleet's remote "
                             "leases, by how the wait ended.", ("outcome",), _LEASE_OUTCOMES)
LEASE_TAKEOVERS = _series("lease_takeovers", "Remote leases taken over from a holder whose "
                          "lease had expired.")
VERIFICATION_FAILURES = _series("verification_failures", "Entries that failed verification "
                                "(checksum, size, record) and were quarantined, by tier.",
                                ("tier",), (("local",), ("remote",)))
LOAD_FAILURES = _series("load_failures", "Entries that passed their checksums but did not "
                        "load in this process, withdrawn locally and compiled again.")
UNTRUSTED = _series("untrusted", "Entries not signed by a trusted key, by tier and whether "
                    "they were refused (VLLM_NEURON_CACHE_TRUST=require) or used (warn).",
                    ("tier", "refused"), (("remote", "true"), ("local", "true")))
EVICTIONS = _series("evictions", "Local entries withdrawn, by reason: size (the tier's "
                    "bound, or prune --max-size), older-than, incompatible (prune).",
                    ("reason",), (("size",),))
EVICTED_BYTES = _series("evicted_bytes", "Bytes of the entries counted by "
                        "vllm_neuron_cache_evictions_total.", ("reason",), (("size",),))
DEFERRED = _series("deferred", "Graphs not waited for at trace time (loaded at their first "
                   "call), by why: another rank (local-lock), another node (remote-lease), "
                   "no free compile slot (no-slot).", ("reason",),
                   (("local-lock",), ("remote-lease",), ("no-slot",)))
PROMOTIONS = _series("promotions", "Entries this node published to the remote tier.")
REMOTE_OUTAGES = _series("remote_outages", "Times the remote tier failed and the node "
                         "carried on alone.")
TIME_SAVED_SECONDS = _series("time_saved_seconds", "Compile seconds saved: each hit's "
                             "compile time, each fetch's compile time minus fetch time.")

SERIES: tuple[Series, ...] = (
    HITS, MISSES, COMPILES, COMPILE_SECONDS, COMPILE_FAILURES, FETCH_BYTES, FETCH_SECONDS,
    LOCK_WAIT_SECONDS, LEASE_WAITS, LEASE_WAIT_SECONDS, LEASE_TAKEOVERS,
    VERIFICATION_FAILURES, LOAD_FAILURES, UNTRUSTED, EVICTIONS, EVICTED_BYTES, PROMOTIONS,
    REMOTE_OUTAGES, TIME_SAVED_SECONDS, DEFERRED,
)

Sample = tuple[Series, tuple[str, ...], float]
"""A counter increment: the series, its label values (in ``Series.labels`` order), amount."""


def _hit(e: CacheHit) -> tuple[Sample, ...]:
    return (HITS, (e.tier,), 1.0), (TIME_SAVED_SECONDS, (), e.compile_seconds)


def _fetch(e: Fetched) -> tuple[Sample, ...]:
    return ((HITS, ("remote",), 1.0), (FETCH_BYTES, (), float(e.size)),
            (FETCH_SECONDS, (), e.seconds),
            (TIME_SAVED_SECONDS, (), max(0.0, e.compile_seconds - e.seconds)))


def _compile(e: Compiled) -> tuple[Sample, ...]:
    return (COMPILES, (), 1.0), (COMPILE_SECONDS, (), e.seconds)


def _lease_wait(e: LeaseWaited) -> tuple[Sample, ...]:
    return (LEASE_WAITS, (e.outcome,), 1.0), (LEASE_WAIT_SECONDS, (e.outcome,), e.seconds)


def eviction_reason(reason: str) -> str:
    """The label of an ``evict`` event's reason, one of a few values.

    The event keeps prune's own sentence ("least recently used; tier above 1000 bytes",
    "older than 3600 s", "incompatible: ..."): as a label that would be a new series per
    bound or per detail.
    """
    if reason == "size" or reason.startswith("least recently used"):
        return "size"
    if reason.startswith("older than"):
        return "older-than"
    if reason.startswith("incompatible"):
        return "incompatible"
    return "other"


def _evict(e: Evicted) -> tuple[Sample, ...]:
    reason = eviction_reason(e.reason)
    return (EVICTIONS, (reason,), 1.0), (EVICTED_BYTES, (reason,), float(e.size))


def _promote(e: Promoted) -> tuple[Sample, ...]:
    return ((PROMOTIONS, (), 1.0),) if e.published else ()


_MISS: tuple[Sample, ...] = ((MISSES, (), 1.0),)
_FAILED: tuple[Sample, ...] = ((COMPILE_FAILURES, (), 1.0),)
_TAKEOVER: tuple[Sample, ...] = ((LEASE_TAKEOVERS, (), 1.0),)
_OUTAGE: tuple[Sample, ...] = ((REMOTE_OUTAGES, (), 1.0),)
_LOAD_FAILED: tuple[Sample, ...] = ((LOAD_FAILURES, (), 1.0),)

# By exact record type: one dict lookup per event on the hot path (a hit in memory).
_MAPPING: dict[type[Record], Callable[[Any], tuple[Sample, ...]]] = {
    CacheHit: _hit,
    CacheMiss: lambda e: _MISS,
    Compiled: _compile,
    CompileFailed: lambda e: _FAILED,
    Fetched: _fetch,
    LockWaited: lambda e: ((LOCK_WAIT_SECONDS, (), e.seconds),),
    Promoted: _promote,
    VerificationFailed: lambda e: ((VERIFICATION_FAILURES, (e.tier,), 1.0),),
    LoadFailed: lambda e: _LOAD_FAILED,
    Untrusted: lambda e: ((UNTRUSTED, (e.tier, "true" if e.refused else "false"), 1.0),),
    RemoteUnavailable: lambda e: _OUTAGE,
    LeaseWaited: _lease_wait,
    LeaseTakenOver: lambda e: _TAKEOVER,
    Evicted: _evict,
    Deferred: lambda e: ((DEFERRED, (e.reason,), 1.0),),
}


def samples_of(event: Record) -> tuple[Sample, ...]:
    """The counter increments one event makes; none for a record that is not a cache event."""
    step = _MAPPING.get(type(event))
    return step(event) if step is not None else ()


@dataclass
class SeriesTotals:
    """Counter values folded from events: ``values[(series, label values)]``."""

    values: dict[tuple[Series, tuple[str, ...]], float] = field(default_factory=dict)
    skipped_lines: int = 0

    def __post_init__(self) -> None:
        for series in SERIES:
            for labels in series.zero:
                self.values.setdefault((series, labels), 0.0)

    def apply(self, event: Record) -> SeriesTotals:
        for series, labels, amount in samples_of(event):
            if not amount:  # as the live counters: a label value appears once it counts
                continue
            key = (series, labels)
            self.values[key] = self.values.get(key, 0.0) + amount
        return self

    def total(self, series: Series) -> float:
        """The series summed over its labels."""
        return sum(v for (s, _), v in self.values.items() if s is series)

    def by_series(self) -> Iterable[tuple[Series, list[tuple[tuple[str, ...], float]]]]:
        """Each series (in :data:`SERIES` order) with its (label values, value), sorted."""
        for series in SERIES:
            yield series, sorted((labels, v) for (s, labels), v in self.values.items()
                                 if s is series)


def fold_events(cache_dir: str) -> SeriesTotals:
    """Fold every process's event segment of the local cache at `cache_dir` into series.

    The same segments and decoder as ``compile.events.read_stats``: what `cache stats`
    counts, these series count (plus fetch bytes, and labels the stats do not keep).
    """
    log = open_store(cache_dir, create=False).log(EVENTS_STREAM)
    totals, skipped = log.fold(CACHE_EVENTS, lambda t, e: t.apply(e), SeriesTotals())
    totals.skipped_lines = skipped
    return totals
