"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

SMOKE_ENV = "VLLM_NEURON_BENCH_SMOKE"


def smoke() -> bool:
    """A smoke run (``python -m benchmarks --smoke``, or ``VLLM_NEURON_BENCH_SMOKE=1``): every
    benchmark at a tiny size, to prove it still runs and prints its ratio; its figures and
    verdicts mean nothing."""
    return os.environ.get(SMOKE_ENV, "") not in ("", "0")


def sized(full: int, tiny: int) -> int:
    """`full` normally, `tiny` in a smoke run (see `smoke`)."""
    return tiny if smoke() else full


@dataclass(frozen=True)
class Timing:
    """Operations per second over several rounds: the best round and the median."""

    name: str
    ops: int
    best: float
    median: float
    rates: tuple[float, ...] = ()  # every round's rate, in round order

    def line(self) -> str:
        return f"  {self.name:<48} {self.best:>11,.0f} ops/s  (median {self.median:,.0f})"


def measure(
    cases: dict[str, Callable[[int], None]],
    ops: int,
    rounds: int,
    prepare: Callable[[str, int], None] | None = None,
) -> dict[str, Timing]:
    """Time `fn(ops)` for every case, `rounds` times, alternating between the cases.

    Alternating means background load on a shared machine hits every case alike; the best
    round is the least disturbed one, the median shows how noisy the run was. `prepare(name,
    ops)`, if given, runs untimed before every call of a case (the warm-up included): the
    place to build what production would hand the code fresh each time (a new cache object,
    new argument objects), so that no memo carries over from the previous round.
    """
    for name, fn in cases.items():
        if prepare is not None:
            prepare(name, max(1, ops // 10))
        fn(max(1, ops // 10))  # warm-up: imports, first open, caches
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            if prepare is not None:
                prepare(name, ops)
            gc.collect()
            start = time.perf_counter()
            fn(ops)
            rates[name].append(ops / (time.perf_counter() - start))
    return {
        name: Timing(name, ops, max(r), statistics.median(r), tuple(r)) for name, r in rates.items()
    }


def paired_ratio(ours: Timing, base: Timing) -> float:
    """The median over rounds of ours/base within a round: the cases of a round ran back to
    back, so load that slows a round slows both, and the ratio is steadier than best/best."""
    return statistics.median(o / b for o, b in zip(ours.rates, base.rates, strict=True))


def machine() -> str:
    """One line describing where the numbers came from."""
    try:
        load = "load {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())
    except OSError:  # pragma: no cover - not on Linux
        load = "load n/a"
    return (
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} cores, {platform.machine()}, {load}"
    )
