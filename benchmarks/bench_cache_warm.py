"""`vllm-neuron cache warm` of 32 entries x 8 MiB from a folder remote vs a parallel `cp -r`.

The warm (`compile/warm.warm_keys`, what the command runs, `--jobs 4`) does more than a
copy: per key it takes the key's local lock, checks the local tier, reads the remote's
record (once to size the progress bar, once to fetch), copies every file while checking
its size and BLAKE3 (the kernel copies, another thread hashes what has landed), writes the
record, publishes atomically and appends a ``fetch`` event. The baseline copies the same
entry directories with `cp -r`, as parallel as the warm: 4 `cp -r` processes, each given
a quarter of the entries. Target: warm throughput >= 0.9x the copy's.

Each entry is one 8 MiB file plus two small ones (a NEFF with its HLO and metadata).
Rounds alternate; before each timed operation the previous copy is deleted and dirty
pages are flushed (`os.sync`). The remote stays in the page cache, as on a node whose NFS
client cache holds it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ._harness import machine, sized
from .bench_cache_fetch import spare_core

MIB = 1 << 20


def make_remote(directory: str, entries: int, mib: int) -> tuple[str, list[str]]:
    """A folder remote of `entries` published entries of about `mib` MiB each."""
    from vllm_neuron.backends import open_store
    from vllm_neuron.compile.tiers.build import compile_and_publish

    remote = os.path.join(directory, "remote")
    store = open_store(remote)
    block = os.urandom(16 * MIB)
    keys = [f"{i:08x}" * 4 for i in range(1, entries + 1)]
    small = 64 << 10
    for i, key in enumerate(keys):
        def compile_into(out: str, i: int = i) -> dict[str, Any]:
            big = mib * MIB - small
            start = (i * 1_234_567) % (len(block) - big) if big < len(block) else 0
            with open(os.path.join(out, "graph.neff"), "wb") as f:
                left, pos = big, start
                while left:
                    chunk = block[pos:pos + left]
                    f.write(chunk)
                    left -= len(chunk)
                    pos = 0
            with open(os.path.join(out, "graph.hlo.pb"), "wb") as f:
                f.write(block[i:i + small * 3 // 4])
            with open(os.path.join(out, "graph.metaneff.pb"), "wb") as f:
                f.write(block[i + 7:i + 7 + small // 4])
            return {}

        compile_and_publish(store, key, compile_into, components={}, toolchain="neuron",
                            target="trn2", on_failure=lambda exc: None)  # fmt: skip
    return remote, keys


def _timed(prepare: Callable[[], None], op: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process and its finished children)."""
    prepare()
    os.sync()
    t0 = os.times()
    start = time.perf_counter()
    op()
    wall = time.perf_counter() - start
    t1 = os.times()
    cpu = sum(t1[:4]) - sum(t0[:4])
    return wall, cpu


def bench(directory: str, entries: int, mib: int, jobs: int, rounds: int) -> float:
    from vllm_neuron.backends import open_store
    from vllm_neuron.compile.commands.warm import warm_keys

    remote, keys = make_remote(directory, entries, mib)
    local = os.path.join(directory, "local")
    copy = os.path.join(directory, "copy")
    groups = [keys[i::jobs] for i in range(jobs)]

    def clear() -> None:
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(copy, ignore_errors=True)
        os.makedirs(copy)

    def warm() -> None:
        result = warm_keys(open_store(local), open_store(remote, create=False), keys,
                           jobs=jobs, on_total=lambda n: None)  # fmt: skip
        assert result.complete and len(result.fetched) == len(keys), result

    def cp() -> None:
        def one(group: list[str]) -> None:
            subprocess.run(["cp", "-r", *(os.path.join(remote, k) for k in group), copy],
                           check=True)

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(one, groups))

    paths = [os.path.join(dirpath, name) for key in keys
             for dirpath, _, names in os.walk(os.path.join(remote, key))
             for name in names if name != "entry.json"]

    def hash_only() -> None:
        """BLAKE3 of the same bytes alone, `jobs` files at a time: the check's own cost."""
        from blake3 import blake3

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(lambda p: blake3().update_mmap(p).digest(), paths))

    _timed(clear, warm)  # warm-up: imports, the remote in the page cache
    _timed(clear, cp)
    warm_times, cp_times, warm_cpu, cp_cpu, hash_times, hash_cpu, spare = [], [], [], [], [], [], []
    for _ in range(rounds):
        spare.append(spare_core())
        wall, cpu = _timed(clear, warm)
        warm_times.append(wall)
        warm_cpu.append(cpu)
        wall, cpu = _timed(clear, cp)
        cp_times.append(wall)
        cp_cpu.append(cpu)
        wall, cpu = _timed(clear, hash_only)
        hash_times.append(wall)
        hash_cpu.append(cpu)
    clear()
    total = entries * mib * MIB
    best_warm, best_cp = min(warm_times), min(cp_times)
    ratio = statistics.median(c / w for c, w in zip(cp_times, warm_times, strict=True))
    print(f" {entries} entries x {mib} MiB, {jobs} at a time, {rounds} rounds:")
    print(f"  {'cache warm (warm_keys)':<30} best {best_warm:.3f} s "
          f"({total / best_warm / MIB:,.0f} MiB/s), median {statistics.median(warm_times):.3f} s; "
          f"CPU {min(warm_cpu):.3f} s")
    print(f"  {f'{jobs} x cp -r':<30} best {best_cp:.3f} s "
          f"({total / best_cp / MIB:,.0f} MiB/s), median {statistics.median(cp_times):.3f} s; "
          f"CPU {min(cp_cpu):.3f} s")
    print(f"  {'BLAKE3 alone (the check)':<30} best {min(hash_times):.3f} s, "
          f"median {statistics.median(hash_times):.3f} s; CPU {min(hash_cpu):.3f} s")
    print("  spare core (2-thread speedup, per round) " + " ".join(f"{x:.2f}" for x in spare))
    print("  per-round warm/cp throughput ratios "
          + " ".join(f"{c / w:.2f}" for c, w in zip(cp_times, warm_times, strict=True)))
    verdict = "meets" if ratio >= 0.9 else "MISSES"
    print(f"  warm/cp throughput {ratio:.2f}x median of per-round ratios (best/best "
          f"{best_cp / best_warm:.2f}x); {verdict} the >= 0.9x target")
    return ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks cache_warm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=sized(32, 4))
    parser.add_argument("--mib", type=int, default=sized(8, 1), help="MiB per entry")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=sized(5, 1))
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    args = parser.parse_args([] if argv is None else argv)
    print(machine())
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-cache-warm-") as d:
        ratio = bench(d, args.entries, args.mib, args.jobs, args.rounds)
    return 0 if ratio >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
