"""`vllm-neuron cache stats --prometheus`: the live series' text, from the event logs.

Parsed with prometheus_client's own text parser, every number equals what
``cache stats --json`` says of the same cache. The events come from real caches: a node
compiles and hits, promotes to a folder remote, a second node fetches from it, a corrupt
remote copy is caught, and ``cache prune --max-size`` evicts. The fleet's rarer events
(lease waits and takeovers, an outage) are appended to the event log as the cache's own
fleet code appends them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from metrics_worker import small_compile
from prometheus_client.parser import text_string_to_metric_families

from vllm_neuron.backends import open_store
from vllm_neuron.cli import main
from vllm_neuron.compile.entry.events import (
    EVENTS_STREAM,
    LeaseTakenOver,
    LeaseWaited,
    LockWaited,
    RemoteUnavailable,
)
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.metrics import SERIES

KEYS = [f"{i:031x}a" for i in range(1, 4)]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a text exposition: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        assert family.type == "counter", family.name
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def total(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in found.items() if n == name)


@pytest.fixture
def busy_cache(tmp_path: Path) -> str:
    """Node B's local cache after fetching, hitting, a corrupt fetch and an eviction."""
    remote = str(tmp_path / "remote")
    node_a = TwoTierCache(str(tmp_path / "a"), remote=remote)
    for key in KEYS:
        node_a.get_or_compile(key, small_compile)  # compile + promote to the folder remote
    local = str(tmp_path / "b")
    node_b = TwoTierCache(local, remote=remote)
    node_b.get_or_compile(KEYS[0], small_compile)  # fetch
    node_b.get_or_compile(KEYS[0], small_compile)  # memory hit
    TwoTierCache(local, remote=remote).get_or_compile(KEYS[0], small_compile)  # local hit
    with open(os.path.join(remote, KEYS[1], "graph.pt2"), "r+b") as f:
        f.write(b"X")  # the remote copy no longer matches its checksum
    node_b.get_or_compile(KEYS[1], small_compile)  # verification failure, then a compile
    node_b.get_or_compile(KEYS[2], small_compile)  # fetch
    log = open_store(local).log(EVENTS_STREAM, writer=f"{socket.gethostname()}-fleet")
    now = time.time()
    for event in (LeaseWaited(key=KEYS[2], at=now, seconds=1.5, outcome="fetched"),
                  LeaseWaited(key=KEYS[1], at=now, seconds=0.25, outcome="acquired"),
                  LeaseTakenOver(key=KEYS[1], at=now, previous_owner="h-1", remote=remote),
                  LockWaited(key=KEYS[1], at=now, seconds=0.75),
                  RemoteUnavailable(at=now, remote=remote, reason="connection refused")):
        log.append(event)
    assert main(["cache", "--cache-dir", local, "prune", "--max-size", "1"]) == 0  # evicts
    return local


def test_prometheus_text_equals_the_json_stats(busy_cache: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cache", "--cache-dir", busy_cache, "stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert main(["cache", "--cache-dir", busy_cache, "stats", "--prometheus"]) == 0
    found = samples(capsys.readouterr().out)
    p = "vllm_neuron_cache_"
    hits = {labels[0][1]: v for (n, labels), v in found.items() if n == p + "hits_total"}
    assert hits == {"memory": 1, "local": 1, "remote": 2, "baked": 0}  # every tier a series
    assert hits == {t: stats["hits_by_tier"].get(t, 0) for t in hits}
    for name, field in [("misses", "misses"), ("compiles", "compiles"),
                        ("compile_failures", "compile_failures"), ("promotions", "promotions"),
                        ("verification_failures", "verification_failures"),
                        ("remote_outages", "remote_outages"), ("lease_waits", "lease_waits"),
                        ("lease_takeovers", "lease_takeovers"), ("evictions", "evictions"),
                        ("evicted_bytes", "evicted_bytes")]:
        assert total(found, f"{p}{name}_total") == stats[field], name
    for name, field in [("compile_seconds", "compile_seconds"),
                        ("fetch_seconds", "fetch_seconds"),
                        ("lock_wait_seconds", "lock_wait_seconds"),
                        ("lease_wait_seconds", "lease_wait_seconds"),
                        ("time_saved_seconds", "time_saved_seconds")]:
        assert total(found, f"{p}{name}_total") == pytest.approx(stats[field], rel=1e-12), name
    # What happened, independently of both: B compiled the key whose copy was corrupt,
    # fetched two (their bytes), waited on two leases, and withdrew its entries to fit 1 byte.
    assert stats["compiles"] == 1 and stats["verification_failures"] == 1
    assert found[(p + "verification_failures_total", (("tier", "remote"),))] == 1
    assert found[(p + "fetch_bytes_total", ())] == 2 * len(b"artifact" * 64)
    assert found[(p + "lease_waits_total", (("outcome", "acquired"),))] == 1
    assert found[(p + "lease_wait_seconds_total", (("outcome", "fetched"),))] == 1.5
    assert found[(p + "lock_wait_seconds_total", ())] == 0.75
    assert stats["evictions"] == 3
    assert found[(p + "evictions_total", (("reason", "size"),))] == 3
    # Every series is there (at 0 when nothing happened), and nothing else.
    assert {n for n, _ in found} == {x.sample for x in SERIES}


def test_prometheus_of_an_empty_cache_lists_every_series_at_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    TwoTierCache(str(tmp_path / "c"))
    assert main(["cache", "--cache-dir", str(tmp_path / "c"), "stats", "--prometheus"]) == 0
    found = samples(capsys.readouterr().out)
    assert {n for n, _ in found} == {x.sample for x in SERIES}
    assert set(found.values()) == {0.0}


def test_prometheus_and_json_are_exclusive_and_installed_command_prints_it(
    busy_cache: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["cache", "--cache-dir", busy_cache, "stats", "--json", "--prometheus"])
    assert exc.value.code == 2
    capsys.readouterr()
    done = subprocess.run(
        [str(Path(sys.executable).parent / "vllm-neuron"), "cache", "--cache-dir", busy_cache,
         "stats", "--prometheus"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert main(["cache", "--cache-dir", busy_cache, "stats", "--prometheus"]) == 0
    assert done.stdout == capsys.readouterr().out
