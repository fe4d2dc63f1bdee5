"""The one mapping from cache events to the Prometheus series, against `cache stats`.

`CacheStats.apply` (what ``cache stats --json`` prints) and `SeriesTotals.apply` (what
``cache stats --prometheus`` and the live counters show) read the same events; every
number both keep must agree, for any stream of events.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vllm_neuron.backends import Record
from vllm_neuron.compile.entry import events as ev
from vllm_neuron.compile.entry.events import CACHE_EVENTS, CacheStats
from vllm_neuron.metrics import SERIES, SeriesTotals, samples_of
from vllm_neuron.metrics import series as s

KEY = "0123456789abcdef0123456789abcdef"
seconds = st.floats(min_value=0.0, max_value=1e4, allow_nan=False, allow_infinity=False)
sizes = st.integers(min_value=0, max_value=1 << 40)
at = st.just(1.7e9)
# What eviction and prune write (the label keeps the policy, not the bound's numbers).
REASONS = {"size": "size", "least recently used; tier above 1000 bytes": "size",
           "older than 3600 s": "older-than", "incompatible: torch 2.12.0": "incompatible"}

EVENTS = st.one_of(
    st.builds(ev.CacheHit, key=st.just(KEY), at=at, tier=st.sampled_from(["memory", "local"]),
              seconds=seconds, compile_seconds=seconds),
    st.builds(ev.CacheMiss, key=st.just(KEY), at=at),
    st.builds(ev.LockWaited, key=st.just(KEY), at=at, seconds=seconds),
    st.builds(ev.Compiled, key=st.just(KEY), at=at, seconds=seconds, toolchain=st.just("host"),
              size=sizes),
    st.builds(ev.CompileFailed, key=st.just(KEY), at=at, error=st.text(max_size=5)),
    st.builds(ev.Fetched, key=st.just(KEY), at=at, seconds=seconds, size=sizes,
              remote=st.just("s3://b/c"), compile_seconds=seconds),
    st.builds(ev.Promoted, key=st.just(KEY), at=at, remote=st.just("s3://b/c"),
              published=st.booleans(), size=sizes),
    st.builds(ev.VerificationFailed, key=st.just(KEY), at=at,
              tier=st.sampled_from(["local", "remote"]), reason=st.just("checksum")),
    st.builds(ev.RemoteUnavailable, at=at, remote=st.just("s3://b/c"), reason=st.just("down")),
    st.builds(ev.LeaseWaited, key=st.just(KEY), at=at, seconds=seconds,
              outcome=st.sampled_from(["fetched", "acquired", "timeout", "remote-down"])),
    st.builds(ev.LeaseTakenOver, key=st.just(KEY), at=at, previous_owner=st.just("h-1"),
              remote=st.just("s3://b/c")),
    st.builds(ev.Evicted, key=st.just(KEY), at=at, size=sizes, last_used=at,
              reason=st.sampled_from(sorted(REASONS))),
    st.builds(ev.Deferred, key=st.just(KEY), at=at,
              reason=st.sampled_from(["local-lock", "remote-lease", "no-slot"])),
)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


@given(st.lists(EVENTS, max_size=40))
def test_series_agree_with_cache_stats_for_any_stream(events: list[Record]) -> None:
    stats, totals = CacheStats(), SeriesTotals()
    for event in events:
        stats.apply(event)
        totals.apply(event)
    v = totals.values
    assert {t: int(v[(s.HITS, (t,))]) for t in ("memory", "local", "remote")} == {
        t: stats.hits_by_tier.get(t, 0) for t in ("memory", "local", "remote")}
    assert totals.total(s.HITS) == stats.hits
    counts = {s.MISSES: stats.misses, s.COMPILES: stats.compiles,
              s.COMPILE_FAILURES: stats.compile_failures, s.PROMOTIONS: stats.promotions,
              s.VERIFICATION_FAILURES: stats.verification_failures,
              s.REMOTE_OUTAGES: stats.remote_outages, s.LEASE_WAITS: stats.lease_waits,
              s.LEASE_TAKEOVERS: stats.lease_takeovers, s.EVICTIONS: stats.evictions,
              s.DEFERRED: stats.deferred,
              s.EVICTED_BYTES: stats.evicted_bytes}
    for series, want in counts.items():
        assert totals.total(series) == want, series.metric
    sums = {s.COMPILE_SECONDS: stats.compile_seconds, s.FETCH_SECONDS: stats.fetch_seconds,
            s.LOCK_WAIT_SECONDS: stats.lock_wait_seconds,
            s.LEASE_WAIT_SECONDS: stats.lease_wait_seconds,
            s.TIME_SAVED_SECONDS: stats.time_saved_seconds}
    for series, want_sum in sums.items():
        assert close(totals.total(series), want_sum), series.metric
    # What the stats do not keep: bytes fetched, and the labels.
    fetched = [e for e in events if isinstance(e, ev.Fetched)]
    assert totals.total(s.FETCH_BYTES) == sum(e.size for e in fetched)
    for outcome in ("fetched", "acquired", "timeout", "remote-down"):
        assert v[(s.LEASE_WAITS, (outcome,))] == sum(
            1 for e in events if isinstance(e, ev.LeaseWaited) and e.outcome == outcome)
    for label in ("size", "older-than", "incompatible"):
        assert v.get((s.EVICTIONS, (label,)), 0) == sum(
            1 for e in events if isinstance(e, ev.Evicted) and REASONS[e.reason] == label)


def test_every_cache_event_type_is_mapped_and_other_records_are_not() -> None:
    examples = {
        ev.CacheHit: ev.CacheHit(key=KEY, at=1.0), ev.CacheMiss: ev.CacheMiss(key=KEY, at=1.0),
        ev.LockWaited: ev.LockWaited(key=KEY, at=1.0, seconds=0.5),
        ev.Compiled: ev.Compiled(key=KEY, at=1.0, seconds=2.0, toolchain="host", size=3),
        ev.CompileFailed: ev.CompileFailed(key=KEY, at=1.0, error="x"),
        ev.Fetched: ev.Fetched(key=KEY, at=1.0, seconds=1.0, size=7, remote="r"),
        ev.Promoted: ev.Promoted(key=KEY, at=1.0, remote="r", published=True),
        ev.VerificationFailed: ev.VerificationFailed(key=KEY, at=1.0, tier="local", reason="x"),
        ev.LoadFailed: ev.LoadFailed(key=KEY, at=1.0, source="local", error="x"),
        ev.Untrusted: ev.Untrusted(key=KEY, at=1.0, tier="remote", status="unsigned",
                                   reason="x", refused=True),
        ev.RemoteUnavailable: ev.RemoteUnavailable(at=1.0, remote="r", reason="x"),
        ev.LeaseWaited: ev.LeaseWaited(key=KEY, at=1.0, seconds=1.0, outcome="fetched"),
        ev.LeaseTakenOver: ev.LeaseTakenOver(key=KEY, at=1.0, previous_owner="o", remote="r"),
        ev.Evicted: ev.Evicted(key=KEY, at=1.0, size=5, last_used=0.5),
        ev.Deferred: ev.Deferred(key=KEY, at=1.0, reason="local-lock"),
    }
    assert set(examples) == set(CACHE_EVENTS)
    for event in examples.values():
        assert samples_of(event), type(event).__name__
        for series, labels, _ in samples_of(event):
            assert series in SERIES and len(labels) == len(series.labels)
    assert samples_of(ev.Promoted(key=KEY, at=1.0, remote="r", published=False)) == ()

    class Other(Record, frozen=True, tag="not-a-cache-event"):
        at: float

    assert samples_of(Other(at=1.0)) == ()


def test_every_series_is_a_named_counter_present_at_zero() -> None:
    totals = SeriesTotals()
    names = [x.sample for x in SERIES]
    assert len(set(names)) == len(names)
    assert all(n.startswith("vllm_neuron_cache_") and n.endswith("_total") for n in names)
    for series in SERIES:
        assert series.zero and all(totals.values[(series, z)] == 0.0 for z in series.zero)
