"""What trust costs (docs/trust.md): the signature check on the fetch path, and a local hit.

**Fetch.** A serving node under ``VLLM_NEURON_CACHE_TRUST=require`` fetches a 256 MiB entry
(one file) signed by a trusted builder from a POSIX remote: `TwoTierCache.fetch_remote`,
which verifies the signature before it copies anything (`TrustPolicy.judge`: decode
``entry.sig``, rebuild the canonical payload, one Ed25519 verification), then copies and
checks every file. Judged: the signature check alone (timed in the same process, a fresh
policy each time so nothing is remembered) as a share of the fetch with trust on. Target:
<= 2 %. Beside it, the fetch with trust on over the fetch with trust off (rounds
alternate; each fetch starts from an empty local tier, dirty pages flushed).

**Local hit.** `TwoTierCache.local_tier.lookup` of fetched entries, each key once in a cache
object that has never seen it (as a new process: the record read and decoded), with the
policy ``require`` against the policy ``off``, over the same entries. A fetched entry's
local record carries the key id that verified it, so a hit judges it by a set lookup.
Target: <= 1.1x (median of per-round ratios).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from ._harness import machine, measure, paired_ratio, sized

MIB = 1 << 20
FETCH_TARGET = 0.02
HIT_TARGET = 1.1


def _policies(directory: str) -> tuple[Any, Any, Any]:
    """(builder's policy, serving node's policy, the policy off)."""
    from vllm_neuron.compile.trust.policy import TrustPolicy, load_trust_policy
    from vllm_neuron.compile.trust.signing import generate_key_pair
    from vllm_neuron.envs import load_trust_settings

    private, public, _ = generate_key_pair(os.path.join(directory, "keys"), "builder")
    builder = load_trust_policy(load_trust_settings({
        "VLLM_NEURON_CACHE_SIGNING_KEY": private, "VLLM_NEURON_CACHE_TRUSTED_KEYS": public}))
    serving_env = {"VLLM_NEURON_CACHE_TRUSTED_KEYS": public}
    return builder, lambda: load_trust_policy(load_trust_settings(serving_env)), TrustPolicy()


def bench_fetch(directory: str, mib: int, rounds: int) -> float:
    from vllm_neuron.backends import join, open_store
    from vllm_neuron.compile.entry.record import ENTRY_RECORD
    from vllm_neuron.compile.flow.cache import TwoTierCache
    from vllm_neuron.compile.trust.signing import SIGNATURE_FILE

    builder, serving, off = _policies(directory)
    key = "5eed5eed5eed5eed5eed5eed5eed5eed"
    remote = os.path.join(directory, "remote")
    block = os.urandom(16 * MIB)

    def compile_into(out: str) -> dict[str, str]:
        with open(os.path.join(out, "model.neff"), "wb") as f:
            for _ in range(mib // 16):
                f.write(block)
        return {}

    made = TwoTierCache(os.path.join(directory, "builder"), remote=remote, trust=builder)
    made.get_or_compile(key, compile_into)
    made.wait_for_upkeep(60)
    store = open_store(remote)
    prefix = store.published(key)
    assert prefix is not None
    record_bytes = store.read(join(prefix, ENTRY_RECORD)) or b""
    signature = store.read(join(prefix, SIGNATURE_FILE))
    local = os.path.join(directory, "local")

    def fetch(policy: Any) -> float:
        shutil.rmtree(local, ignore_errors=True)
        os.sync()
        cache = TwoTierCache(local, remote=remote, trust=policy)
        start = time.perf_counter()
        result = cache.fetch_remote(key)
        seconds = time.perf_counter() - start
        assert result is not None and result.source == "remote"
        return seconds

    def check() -> float:
        policy = serving()  # nothing remembered from an earlier check
        start = time.perf_counter()
        verdict = policy.judge(record_bytes, signature)
        seconds = time.perf_counter() - start
        assert verdict.trusted
        return seconds

    fetch(serving())
    fetch(off)  # warm-up: imports, the remote's pages in the page cache
    trusted, plain, checks = [], [], []
    for _ in range(rounds):
        trusted.append(fetch(serving()))
        plain.append(fetch(off))
        checks.append(min(check() for _ in range(5)))
    shutil.rmtree(local, ignore_errors=True)
    share = statistics.median(checks) / min(trusted)
    print(f" fetch of a {mib} MiB entry, best of {rounds} rounds:")
    print(f"  fetch_remote, trust require          best {min(trusted):.3f} s, median "
          f"{statistics.median(trusted):.3f} s")
    print(f"  fetch_remote, trust off              best {min(plain):.3f} s, median "
          f"{statistics.median(plain):.3f} s")
    check_us = statistics.median(checks) * 1e6
    print(f"  signature check alone                median {check_us:,.0f} us")
    slower = statistics.median(t / p for t, p in zip(trusted, plain, strict=True))
    print(f"  fetch require/off {slower:.2f}x median of per-round ratios")
    verdict = "meets" if share <= FETCH_TARGET else "MISSES"
    print(f"  signature check / fetch {share:.4%} ({share:.5f}x); {verdict} the <= 2 % target")
    return share


def bench_hit(directory: str, entries: int, rounds: int) -> float:
    from vllm_neuron.compile.flow.cache import TwoTierCache

    builder, serving, off = _policies(directory)
    remote = os.path.join(directory, "remote")
    node = os.path.join(directory, "node")
    keys = [f"{i:032x}" for i in range(entries)]

    def compile_into(out: str) -> dict[str, str]:
        with open(os.path.join(out, "graph.pt2"), "wb") as f:
            f.write(os.urandom(4096))
        return {}

    made = TwoTierCache(os.path.join(directory, "builder"), remote=remote, trust=builder)
    fetcher = TwoTierCache(node, remote=remote, trust=serving())
    for key in keys:
        made.get_or_compile(key, compile_into)
        assert fetcher.get_or_compile(key, compile_into).source == "remote"
    fresh: dict[str, list[TwoTierCache]] = {}
    # The baseline first in every round, as in the other benchmarks' pairs.
    policies = {"lookup_local, trust off": off, "lookup_local, trust require": serving()}

    def prepare(name: str, ops: int) -> None:
        # One cache object per pass over the keys, each key new to it: a new process.
        passes = max(1, ops // len(keys))
        fresh[name] = [TwoTierCache(node, trust=policies[name]) for _ in range(passes)]

    def lookups(name: str) -> Any:
        def run(ops: int) -> None:
            done = 0
            for cache in fresh[name]:
                for key in keys:
                    if done == ops:
                        return
                    assert cache.local_tier.lookup(key) is not None
                    done += 1

        return run

    timings = measure({n: lookups(n) for n in policies}, ops=len(keys) * 3, rounds=rounds,
                      prepare=prepare)  # fmt: skip
    on, base = timings["lookup_local, trust require"], timings["lookup_local, trust off"]
    print(f" local hit of a fetched entry, {entries} entries, {rounds} rounds:")
    print(on.line())
    print(base.line())
    ratio = paired_ratio(base, on)  # time ratio: off's rate over require's
    verdict = "meets" if ratio <= HIT_TARGET else "MISSES"
    print(f"  hit require/off {ratio:.2f}x median of per-round ratios (best/best "
          f"{base.best / on.best:.2f}x); {verdict} the <= 1.1x target")
    return ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks trust", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=sized(256, 16), help="entry size in MiB")
    parser.add_argument("--rounds", type=int, default=sized(5, 1))
    parser.add_argument("--entries", type=int, default=sized(300, 20))
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    args = parser.parse_args([] if argv is None else argv)
    print(machine())
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-trust-fetch-") as d:
        share = bench_fetch(d, args.mib, args.rounds)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-trust-hit-") as d:
        ratio = bench_hit(d, args.entries, max(3, args.rounds))
    return 0 if share <= FETCH_TARGET and ratio <= HIT_TARGET else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
