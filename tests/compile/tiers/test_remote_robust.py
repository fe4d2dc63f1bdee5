"""The remote tier never stalls a node or fails silently.

- An endpoint that accepts connections and never answers: the node goes on locally after
  one bounded request (it was 378 s), with one warning, and does not pay it again for the
  next graph while the remote is set aside.
- The set-aside grows (60 s doubling to 10 min), so a long warm-up against a dead remote
  pays its timeout a handful of times; one warning per outage, a log line when it is back.
- A missing bucket is one warning naming the URL and S3's error, not silent misses.
- A refused write makes the tier read-only for the process, with one warning.

The silent endpoint is a real socket (tests/blackhole.py), the buckets moto's S3 API on
loopback; the set-aside arithmetic runs on a fake clock against a scheme whose probe the
test switches between failing and answering.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from blackhole import BlackHole  # tests/blackhole.py
from cache_workers import entry_is_right

from vllm_neuron.backends import (
    Record,
    StoreAccessDenied,
    StoreUnavailable,
    register_scheme,
    unregister_scheme,
)
from vllm_neuron.backends._memory import MemoryStore
from vllm_neuron.compile import save_cache
from vllm_neuron.compile.entry.events import RemoteUnavailable, read_stats
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.remote import REMOTE_RETRY_AFTER, REMOTE_RETRY_MAX, RemoteTier
from vllm_neuron.compile.upkeep.owed import owed_keys

BOUND = 40.0  # seconds; the default request bound is 10 s, this is room for a loaded machine
VARIABLE = "NEURON_LIBTORCH_REMOTE_CACHE"


def _keys(n: int) -> list[str]:
    return [uuid.uuid5(uuid.NAMESPACE_URL, f"robust-{i}").hex for i in range(n)]


# ------------------------------------------------------------------ a silent endpoint


def test_a_silent_remote_costs_one_bounded_wait_and_one_warning(
    tmp_path, compile_fn, cache_warnings, s3_server
):
    remote = f"s3://bucket-{uuid.uuid4().hex[:8]}/cache"
    with BlackHole() as hole:
        node = TwoTierCache(str(tmp_path / "node"), remote=remote,
                            remote_options={"endpoint_url": hole.url})  # fmt: skip
        first, *others = _keys(3)
        start = time.monotonic()
        result = node.get_or_compile(first, compile_fn(first))
        elapsed = time.monotonic() - start
        assert result.source == "compiled" and entry_is_right(result.path, first) is None
        assert elapsed < BOUND, elapsed
        reached = hole.connections()
        assert reached >= 1  # the wait was the remote's, not a fast unrelated error

        for key in others:  # the next graphs: the remote is set aside, nothing is asked
            assert node.get_or_compile(key, compile_fn(key)).source == "compiled"
        assert node.remote is None
        assert hole.connections() == reached

    warnings = cache_warnings()
    assert len(warnings) == 1, warnings
    assert remote in warnings[0] and VARIABLE in warnings[0] and "no answer" in warnings[0]
    stats = read_stats(node.local_dir)
    assert stats.compiles == 3 and stats.remote_outages == 1


# ------------------------------------------------------------------ the set-aside


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Flaky:
    """A scheme whose stores answer the probe only while `up`; counts the probes."""

    def __init__(self) -> None:
        self.up = False
        self.probes = 0
        self.name = f"flaky{uuid.uuid4().hex[:8]}"

    def open(self, url: str, location: str, options: dict[str, Any], *, create: bool) -> Any:
        return MemoryStore(url, location)

    def probe(self, store: Any) -> None:
        self.probes += 1
        if not self.up:
            raise StoreUnavailable(f"store {store.url}: no answer")


@pytest.fixture
def flaky() -> Iterator[Flaky]:
    scheme = Flaky()
    register_scheme(scheme.name, scheme.open, probe=scheme.probe)
    try:
        yield scheme
    finally:
        unregister_scheme(scheme.name)


def test_the_set_aside_doubles_to_ten_minutes_with_one_warning_per_outage(
    flaky: Flaky, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vllm_neuron.compile")
    clock, events = Clock(), []
    url = f"{flaky.name}://remote"
    tier = RemoteTier(url, {}, events.append, clock=clock)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    assert tier.store() is None and flaky.probes == 1
    assert tier.set_aside_seconds == REMOTE_RETRY_AFTER == 60
    assert len(warnings()) == 1 and url in warnings()[0] and VARIABLE in warnings()[0]
    assert [type(e) for e in events] == [RemoteUnavailable]

    clock.now += 59  # set aside: no request at all
    assert tier.store() is None and flaky.probes == 1
    tier.failed(StoreUnavailable("another thread's operation failed meanwhile"))
    assert tier.set_aside_seconds == 60  # a failure inside the set-aside changes nothing

    expected = [120, 240, 480, 600, 600]
    for step in expected:
        clock.now += tier.set_aside_seconds + 1
        assert tier.store() is None  # the retry's probe fails: twice as long, no warning
        assert tier.set_aside_seconds == step
    assert flaky.probes == 1 + len(expected)
    assert REMOTE_RETRY_MAX == 600
    assert len(warnings()) == 1 and len(events) == 1  # still the one outage

    flaky.up = True
    clock.now += 601
    store = tier.store()
    assert store is not None and store.url == url
    assert tier.set_aside_seconds == 0
    back = [r.getMessage() for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(back) == 1 and url in back[0]
    probes = flaky.probes
    assert tier.store() is store and flaky.probes == probes  # up: no probe per call

    tier.failed(StoreUnavailable("a fetch failed"))  # a new outage: warned again, from 60 s
    assert tier.store() is None
    assert tier.set_aside_seconds == 60
    assert len(warnings()) == 2 and len(events) == 2


def test_a_remote_that_cannot_open_is_retried_after_the_set_aside(tmp_path) -> None:
    clock, events = Clock(), []
    missing = tmp_path / "remote"
    tier = RemoteTier(str(missing), {"create": False}, events.append, clock=clock)
    assert tier.store() is None  # the reader's probe: no directory there
    assert "no directory" in events[0].reason and str(missing) in events[0].reason
    missing.mkdir()
    assert tier.store() is None  # still set aside
    clock.now += REMOTE_RETRY_AFTER + 1
    assert tier.store() is not None


def test_what_was_owed_during_an_outage_is_promoted_when_the_remote_is_back(
    flaky: Flaky, tmp_path, compile_fn
) -> None:
    """A server compiling while the remote is down owes it those entries; it settles them
    when the remote answers again, not at its next start (a server runs for weeks)."""
    cache = TwoTierCache(str(tmp_path / "node"), remote=f"{flaky.name}://remote")
    clock = Clock()
    cache._remote._clock = clock  # the set-aside on a clock the test moves
    first, second = _keys(2)
    for key in (first, second):
        assert cache.get_or_compile(key, compile_fn(key)).source == "compiled"
    assert cache.wait_for_upkeep()  # the first use's pass: the remote was down, nothing settled
    assert sorted(owed_keys(cache.local)) == sorted([first, second])

    flaky.up = True
    clock.now += REMOTE_RETRY_AFTER + 1
    remote = cache.remote  # the next remote request finds it back: the settling starts
    assert remote is not None
    assert cache.wait_for_upkeep()
    assert owed_keys(cache.local) == []
    for key in (first, second):
        assert remote.published(key) is not None
    assert read_stats(cache.local_dir).promotions == 2


# ------------------------------------------------------------------ a missing bucket


def test_a_missing_bucket_is_one_warning_naming_it(
    tmp_path, compile_fn, cache_warnings, s3_server
):
    bucket = f"nosuchbucket-{uuid.uuid4().hex[:8]}"
    remote = f"s3://{bucket}/c"
    node = TwoTierCache(str(tmp_path / "node"), remote=remote,
                        remote_options={"endpoint_url": s3_server})  # fmt: skip
    for key in _keys(3):
        assert node.get_or_compile(key, compile_fn(key)).source == "compiled"
    warnings = cache_warnings()
    assert len(warnings) == 1, warnings
    assert remote in warnings[0] and VARIABLE in warnings[0]
    assert "NoSuchBucket" in warnings[0] and bucket in warnings[0]
    assert read_stats(node.local_dir).remote_outages == 1


# ------------------------------------------------------------------ a refused write


def _reader(endpoint: str, bucket: str) -> dict[str, str]:
    import json

    import boto3

    iam = boto3.client("iam", endpoint_url=endpoint)
    name = f"reader-{uuid.uuid4().hex[:8]}"
    iam.create_user(UserName=name)
    iam.put_user_policy(UserName=name, PolicyName="read", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{
            "Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"],
            "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]}]}))  # fmt: skip
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}


def test_a_refused_write_degrades_the_tier_to_read_only_with_one_warning(
    tmp_path, compile_fn, cache_warnings, s3_server, s3_bucket
):
    from moto.core.authorization import enable_iam_authentication

    remote = f"s3://{s3_bucket}/cache"
    key = _keys(1)[0]
    builder = str(tmp_path / "builder")
    TwoTierCache(builder).get_or_compile(key, compile_fn(key))
    assert save_cache(builder, remote, key, remote_options={"endpoint_url": s3_server})
    options = {"endpoint_url": s3_server, **_reader(s3_server, s3_bucket)}
    records: list[Record] = []

    with enable_iam_authentication():
        tier = RemoteTier(remote, options, records.append)
        store = tier.store()
        assert store is not None and not tier.read_only  # the probe only reads
        with pytest.raises(PermissionError) as info:
            store.write("x", b"1")
        assert isinstance(info.value, StoreAccessDenied)
        tier.write_denied(info.value)
        tier.write_denied(info.value)  # the next refusal: already read-only, no warning
        assert tier.read_only
        assert tier.store() is store  # reads go on: a refusal is not an outage
        # A node with the same credentials fetches what others promoted.
        node = TwoTierCache(str(tmp_path / "node"), remote=remote, remote_options=options)
        result = node.get_or_compile(key, compile_fn(key, fail="must not compile"))
        assert result.source == "remote" and entry_is_right(result.path, key) is None

    warnings = cache_warnings()
    assert len(warnings) == 1, warnings
    assert remote in warnings[0] and "VLLM_NEURON_REMOTE_WRITE=off" in warnings[0]
    assert "AccessDenied" in warnings[0]
    assert records == []  # not an outage


def test_remote_write_off_is_read_only_from_the_start_without_a_warning(cache_warnings):
    tier = RemoteTier("memory://ro", {}, lambda record: None, write="off")
    assert tier.read_only and tier.store() is not None
    tier.write_denied(PermissionError("refused"))
    assert cache_warnings() == []
    assert not RemoteTier("memory://rw", {}, lambda record: None).read_only
    with pytest.raises(ValueError, match="VLLM_NEURON_REMOTE_WRITE"):
        RemoteTier("memory://x", {}, lambda record: None, write="on")  # type: ignore[arg-type]
