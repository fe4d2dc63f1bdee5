"""What each cold-start mechanism pays: a real ``vllm serve`` cold start with it and without it.

The plugin's CPU cold start is made of mechanisms added one by one (docs/compile-cache.md, "A
cold start in parallel" and after): the CPU probe ahead, compile workers started before the
model loads, the probe's compile of the wrapper's runtime part, the wrapper compiled in two
parts, the vector-ISA probe stopped at the first valid ISA, a share of one slot compiling in
place, host compile workers at larger shares. Each can be turned off for one start with the
internal marker ``_VLLM_NEURON_WITHOUT=<name>`` (envs/host_mode.py), which falls back to what
torch and vLLM do alone (``rank-sharing``: every rank waits for the piece another compiles,
as with ``VLLM_NEURON_DEFER_COMPILES=0``, which would also stop the head start). A
mechanism a TP size cannot use on this host is not started there (`applies`): rank sharing at
TP=1, in-place at a share above one slot, workers and early workers at a share of one. Each
round starts, one after another and in a rotating order, stock vLLM, the plugin, and the
plugin without each mechanism asked for: every start cold (fresh VLLM_CACHE_ROOT, temporary
directory and Inductor cache, as on a new node). Reported per TP: the median ready time (spawn
-> ``/v1/models``) and the CPU seconds every process of the server had used by then, per side;
for each mechanism, what it saves (its side without it, over the plugin's); a mechanism that
saves under 3 % of the plugin's cold start does not pay.

``--smoke`` starts no server.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

from vllm_neuron.envs import COLD_START_MECHANISMS, load_compile_cache_settings

from ._harness import machine, smoke
from .bench_vllm_cold_start import TP2_ENV, Run, server_setup, start, vllm_python, work_dir

PAYS = 0.03
"""A mechanism is kept when it saves at least this share of the plugin's cold start."""
MECHANISMS = COLD_START_MECHANISMS


def applies(mechanism: str, tp: int) -> str | None:
    """Why `mechanism` is never used by a TP=`tp` cold start on this host (a start without it
    would be the plugin's start again), or None. A rank's share of the node's compile slots
    (`ceil(slots / tp)`, docs/compile-cache.md) decides between workers and in place."""
    share = -(-load_compile_cache_settings().compile_workers // tp)
    if mechanism == "rank-sharing" and tp == 1:
        return "one rank shares with no one"
    if mechanism == "in-place" and share > 1:
        return f"a share of {share} slots compiles in workers, not in place"
    if mechanism in ("workers", "early-workers") and share == 1:
        return "a share of one slot compiles in place, with no workers"
    return None


def run_round(tp: int, round_: int, sides: list[str], python: str, model: str, workdir: Path,
              ready_timeout: float) -> list[Run]:  # fmt: skip
    runs = []
    shift = round_ % len(sides)  # rotated, so no side is always first (or after stock)
    for side in sides[shift:] + sides[:shift]:
        # Short: vLLM makes its sockets under TMPDIR, and a socket's path holds 107 bytes.
        root = workdir / f"tp{tp}-r{round_}-s{sides.index(side)}"
        (root / "tmp").mkdir(parents=True)
        env = {"VLLM_CACHE_ROOT": str(root / "cache"), "TMPDIR": str(root / "tmp"),
               "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
               **(TP2_ENV if tp == 2 else {})}
        if side != "stock":
            env["VLLM_NEURON_HOST_MODE"] = "1"
        if side.startswith("without "):
            env["_VLLM_NEURON_WITHOUT"] = side.removeprefix("without ")
        design = "stock cold" if side == "stock" else f"plugin cold {side}".strip()
        cache = None if side == "stock" else root / "cache" / "neuron" / "compile_cache"
        run = start(Run(tp, design), python, model, workdir, env, cache, ready_timeout)
        runs.append(run)
        shutil.rmtree(root, ignore_errors=True)  # the next start's disk, not this one's
    return runs


def report(tp: int, sides: list[str], runs: list[Run]) -> list[str]:
    """The medians per side, and what each mechanism saves; the lines for RESULTS.md."""
    by_side: dict[str, list[Run]] = {side: [] for side in sides}
    for run in runs:
        side = "stock" if run.design == "stock cold" else run.design.removeprefix(
            "plugin cold").strip()  # fmt: skip
        by_side[side].append(run)
    medians = {side: (statistics.median(r.ready for r in rs), statistics.median(r.cpu for r in rs))
               for side, rs in by_side.items()}  # fmt: skip
    lines = []
    for side, (ready, cpu) in medians.items():
        each = ", ".join(f"{r.ready:.1f}/{r.cpu:.0f}" for r in by_side[side])
        lines.append(f"  TP={tp} {side or 'plugin':<28} ready {ready:6.1f} s, CPU {cpu:6.1f} s "
                     f"(medians of {len(by_side[side])}; each ready/CPU: {each})")
    base_ready, base_cpu = medians[""]
    if "stock" in medians:
        stock_ready, stock_cpu = medians["stock"]
        lines.append(f"  TP={tp} plugin / stock: {base_ready / stock_ready:.2f}x wall, "
                     f"{base_cpu / stock_cpu:.2f}x CPU")
    for side in sides:
        if not side.startswith("without "):
            continue
        ready, cpu = medians[side]
        saves = (ready - base_ready) / base_ready
        lines.append(f"  TP={tp} {side.removeprefix('without ')}: without it {ready:.1f} s, with "
                     f"it {base_ready:.1f} s: saves {saves:+.1%} of the cold start "
                     f"({'pays' if saves >= PAYS else 'does NOT pay'}, at {PAYS:.0%}); CPU "
                     f"{cpu:.0f} s without, {base_cpu:.0f} s with")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_cold_start_ab",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--without", default="probe,early-workers",
                        help=f"mechanisms, comma-separated, or 'all': {MECHANISMS}")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-stock", action="store_true",
                        help="no stock vLLM side (a mechanism's A/B alone)")
    parser.add_argument("--dir", default=None, help="where the runs' roots and logs go")
    parser.add_argument("--keep", action="store_true", help="keep the server logs")
    parser.add_argument("--ready-timeout", type=float, default=1800.0)
    args = parser.parse_args([] if argv is None else argv)
    wanted = (list(MECHANISMS) if args.without == "all"
              else [m for m in args.without.split(",") if m])  # fmt: skip
    unknown = sorted(set(wanted) - set(MECHANISMS))
    if unknown:
        parser.error(f"--without: {', '.join(unknown)} is not one of {MECHANISMS}")
    print(machine())
    tps = [int(t) for t in args.tp.split(",") if t]
    sides_of: dict[int, list[str]] = {}
    for tp in tps:
        for mechanism in wanted:
            if (why := applies(mechanism, tp)) is not None:
                print(f"TP={tp}: without {mechanism}: not started ({why})")
        sides_of[tp] = [*([] if args.no_stock else ["stock"]), "",
                        *(f"without {m}" for m in wanted if applies(m, tp) is None)]
    if smoke():
        print(f"smoke run: no server started; sides {sides_of}; vLLM python: "
              f"{vllm_python(build=False) or 'not built'}")
        print(f"cold-start A/B: setup checked (smoke run); a mechanism pays at {1 + PAYS:.2f}x "
              "(its side without it over the plugin's)")
        return 0
    python, model = server_setup()
    workdir = work_dir("bench-cold-ab-", args.dir)
    lines: list[str] = []
    try:
        for tp in tps:
            sides = sides_of[tp]
            runs = []
            for round_ in range(args.rounds):
                print(f"TP={tp} round {round_ + 1} of {args.rounds}", flush=True)
                runs += run_round(tp, round_, sides, python, model, workdir, args.ready_timeout)
            answers = {r.answer for r in runs}
            if len(answers) != 1:
                raise RuntimeError(f"tp{tp}: the starts answered differently: {answers}")
            lines += report(tp, sides, runs)
    finally:
        if args.keep:
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print("\n".join(lines))
    print(f"cold-start A/B: done ({machine()})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
