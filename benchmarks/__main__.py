"""Run benchmark modules: ``python -m benchmarks [NAME ...]`` (NAME with or without bench_).

Every ``benchmarks/bench_*.py`` module defines ``main() -> int | None``; a non-zero return
means the benchmark missed its goal.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import benchmarks


def discover() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__)
                  if m.name.startswith("bench_"))


def main(argv: list[str]) -> int:
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
