"""P9 - parallel cold start: N nodes x R ranks trace the same G graphs in the same order; with
deferred compiles (`TwoTierCache.begin`) they share the graphs out, instead of every process
moving from graph to graph together while one of them compiles each (``get_or_compile`` in
order: VLLM_NEURON_DEFER_COMPILES=0, the baseline, run first in the same process).

The fleet machinery is P7's (`bench_fleet_cold_start.run_group`): every rank a real process
(`benchmarks/fleet_worker.py`, test toolchain: a compile sleeps ``--compile-seconds`` C, as a
compiler running on the node's own cores would take, then writes its files), every node a
local tier of its own, one remote shared (a folder with leases, and S3 on moto), a barrier,
wall time from its release to the last process done; compiles counted from the events and
from a marker per compile started; every process checks every graph's bytes.

Target: wall <= ceil(G / min(N*R, workers)) * C + G x one fetch + 2 s, where workers is the
node's compile slots times N (unbounded here: the test toolchain's compile is a sleep), and
compiles == G. The baseline's wall is about G * C.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile

from ._harness import machine, smoke
from .bench_fleet_cold_start import SLACK, Group, _nothing, moto_server, parse_config, run_group


def budget(g: Group, compile_seconds: float, workers: int | None) -> float:
    parallel = g.nodes * g.ranks if workers is None else min(g.nodes * g.ranks,
                                                             workers * g.nodes)
    return math.ceil(g.graphs / parallel) * compile_seconds + g.graphs * g.fetch_seconds + SLACK


def main(argv: list[str] | None = None) -> int:
    tiny = smoke()
    parser = argparse.ArgumentParser(prog="python -m benchmarks parallel_cold_start",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1x4x8" if tiny else "1x4x8,4x2x8,16x1x16",
                        help="NODESxRANKSxGRAPHS, comma-separated")
    parser.add_argument("--remotes", default="folder" if tiny else "folder,s3")
    parser.add_argument("--compile-seconds", type=float, default=0.3 if tiny else 5.0)
    parser.add_argument("--workers", type=int, default=None,
                        help="VLLM_NEURON_COMPILE_WORKERS per node (default: unbounded)")
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--file-mib", type=float, default=0.25)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args([] if argv is None else argv)
    cases = []
    for case in args.cases.split(","):
        fleet, _, graphs = case.lower().rpartition("x")
        cases.append((*parse_config(fleet), int(graphs)))
    remotes = [r for r in args.remotes.split(",") if r]

    print(machine())
    print(f"parallel cold start: compile = sleep {args.compile_seconds:g} s; cases {args.cases}; "
          f"remotes {', '.join(remotes)}; compile slots per node "
          f"{args.workers or 'unbounded'}" + ("; smoke run (figures mean nothing)" if tiny
                                               else ""), flush=True)
    met = True
    lines = []
    s3 = moto_server() if "s3" in remotes else _nothing()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-parallel-") as workdir, \
            s3 as endpoint:
        for remote in remotes:
            for nodes, ranks, graphs in cases:
                runs = {}
                for design, defer in (("in place", False), ("deferred", True)):
                    runs[design] = g = run_group(
                        workdir, remote, endpoint, nodes=nodes, ranks=ranks, graphs=graphs,
                        design=f"{design} fleet", mode="fake", args=args,
                        worker_extra={"defer": defer, "compile_workers": args.workers})
                    print(f" {remote} {nodes}x{ranks}x{graphs} {design:<8}: wall {g.wall:6.2f} s,"
                          f" compiles {g.compiles} (markers {g.started}), fetches {g.fetches} "
                          f"(mean {g.fetch_seconds:.3f} s), sources {g.sources}, bytes "
                          f"{'ok' if not g.wrong else 'WRONG'}", flush=True)
                base, new = runs["in place"], runs["deferred"]
                limit = budget(new, args.compile_seconds, args.workers)
                once = new.compiles == graphs == new.started and not (new.wrong or base.wrong)
                ok = once and new.wall <= limit
                met &= ok
                lines.append(
                    f"  {remote} {nodes}x{ranks}x{graphs}: deferred / in place "
                    f"{new.wall / base.wall:.2f}x ({new.wall:.2f} s / {base.wall:.2f} s); "
                    f"budget ceil({graphs}/{min(nodes * ranks, (args.workers or 10**9) * nodes)})"
                    f" x {args.compile_seconds:g} + {graphs} x {new.fetch_seconds:.3f} + "
                    f"{SLACK:g} = {limit:.2f} s; compiles {new.compiles} == {graphs}: "
                    f"{'met' if ok else 'NOT MET'}")
    print()
    print("\n".join(lines))
    print(f"P9 parallel cold start: {'met' if met else 'NOT MET'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
