"""Every benchmark runs at a tiny size and prints its ratio line (no timing is checked).

``python -m benchmarks --smoke NAME`` shrinks each benchmark to seconds; this proves it
still imports, runs the code it measures, checks what it checks (the benchmarks assert that
the real work was done) and reports. Whether a smoke-sized run meets its target means
nothing: a missed goal (exit 1 with "goals missed") passes here, a crash does not.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The modules `python -m benchmarks` discovers (benchmarks/ is not an installed package).
NAMES = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))

RATIO = r"\d+\.\d+x"
# What each benchmark prints as its result; a benchmark not named here must print a ratio.
RATIO_LINES: dict[str, list[str]] = {
    "bench_atomic_write": [rf"store/bare {RATIO} by median"],
    "bench_cache_compile": [
        rf"wall / single: median of per-round ratios {RATIO} \(best/best {RATIO}",
        r"compiles == 1 in every group: yes",
    ],
    "bench_cache_fetch": [rf"fetch/copytree throughput {RATIO} best-of"],
    "bench_cache_hit": [
        rf"first lookup/bare {RATIO} median of per-round ratios",
        rf"repeated lookup/bare {RATIO} median of per-round ratios",
        r"compute_cache_key, \d+-node dynamo graph",
    ],
    "bench_eventlog": [rf"ratio \(best/best\) {RATIO}"],
    "bench_hit_load": [
        rf"hit / aoti_load_package, fresh processes: {RATIO} median of per-round ratios",
        rf"one-time costs warmed \(not judged\): hit / aoti_load_package {RATIO}",
        r"aotinductor_\* left by the hits: 0",
    ],
    "bench_gc": [rf"folder: gc plan / listing {RATIO} wall",
                 rf"S3: gc plan / listing {RATIO} wall .* requests \d+ vs \d+"],
    "bench_fleet_cold_start": [
        rf"baseline wall / fleet wall {RATIO} \(",
        r"compiles == unique graphs in every fleet: met",
    ],
    "bench_parallel_cold_start": [rf"deferred / in place {RATIO} \(",
                                  r"compiles \d+ == \d+: (met|NOT MET)"],
    "bench_manifest_emit": [rf"ratio: median of per-round ratios {RATIO}"],
    "bench_manifest_ledger": [rf"ratio: median of per-round ratios {RATIO}"],
    "bench_snapshot_overhead": [r"capture off .* overhead [+-]\d+ ns/call"],
    "bench_snapshot_write": [rf"snapshot bundle \(npy\) .* paired median {RATIO}"],
    # Starts no server in a smoke run (a start costs minutes): it checks the setup, or says
    # it skipped because the vLLM environment is not built.
    "bench_vllm_cold_start": [
        r"P8 vLLM cold start: setup (checked, no server started|skipped: vLLM environment "
        r"not built)"],
    "bench_baked_hit": [rf"baked / local, fresh processes: {RATIO} median of per-round ratios",
                        r"baked tier unchanged by the hits: yes"],
    "bench_march": [rf"explicit/native time per call {RATIO} median of per-round ratios"],
    "bench_trust": [rf"signature check / fetch .* \({RATIO}\)",
                    rf"hit require/off {RATIO} median of per-round ratios"],
}
# Real Inductor compiles (and fresh processes).
SLOW = {"bench_baked_hit", "bench_cache_compile", "bench_hit_load", "bench_march"}


def _params() -> list[object]:
    return [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [])
            for name in NAMES]


@pytest.mark.parametrize("name", _params())
def test_benchmark_smoke(name: str, tmp_path: Path) -> None:
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--smoke", name],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    output = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    # 0: goals met; 1 with the summary line: goals missed (meaningless at this size);
    # anything else, or 1 without it (an exception's exit status), is a broken benchmark.
    missed = f"goals missed: {name}" in proc.stdout
    assert proc.returncode == 0 or (proc.returncode == 1 and missed), output
    assert "Traceback" not in proc.stderr, output
    assert f"== {name}" in proc.stdout, output
    for pattern in RATIO_LINES.get(name, [RATIO]):
        assert re.search(pattern, proc.stdout), f"no line matching {pattern!r}\n{output}"
