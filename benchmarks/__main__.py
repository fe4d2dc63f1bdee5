"""Run benchmark modules: ``python -m benchmarks [--smoke] [NAME ...]`` (NAME with or without
bench_).

Every ``benchmarks/bench_*.py`` module defines ``main() -> int | None``; a non-zero return
means the benchmark missed its goal. ``--smoke`` (or ``VLLM_NEURON_BENCH_SMOKE=1``) runs each
at a tiny size: it proves the benchmark still runs and prints its ratio, nothing more
(tests/test_benchmarks_smoke.py runs it in CI).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

import benchmarks
from benchmarks._harness import SMOKE_ENV


def discover() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__)
                  if m.name.startswith("bench_"))


def main(argv: list[str]) -> int:
    if "--smoke" in argv:
        argv = [a for a in argv if a != "--smoke"]
        os.environ[SMOKE_ENV] = "1"  # before any benchmark reads it; inherited by workers
    names = discover()
    wanted = [a if a.startswith("bench_") else f"bench_{a}" for a in argv] or names
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(names)}",
              file=sys.stderr)
        return 2
    failed = []
    for name in wanted:
        print(f"== {name}", flush=True)
        module = importlib.import_module(f"benchmarks.{name}")
        if module.main():
            failed.append(name)
    if failed:
        print(f"goals missed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
