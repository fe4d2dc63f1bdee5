"""P11 - a new node of a known deployment starts like a warm restart.

A fleet's remote tier holds every graph of a deployment; a node that joins it (a new pod:
empty VLLM_CACHE_ROOT, empty temporary directory and Inductor cache) should be ready about
as fast as the node that compiled them is on a restart. Target: new node / warm restart <=
1.05x, wall (spawn -> ``/v1/models`` answers) and CPU seconds (every process of the server,
by then), on medians of three starts per side, alternating, at TP=1 and TP=2.

Per TP, with the tiny Llama of ``.ci/tiny_model.py`` in host mode and a folder remote:

* the builder's cold start (not judged): compiles every piece and publishes it to the
  remote, with its deployment's records and vLLM's model information (without which a new
  node's API server inspects the model's class in a subprocess of its own, 12-15 s on 2
  cores, that a restart does not: docs/compile-cache.md);
* then, three rounds, alternating: the builder restarted (its VLLM_CACHE_ROOT, temporary
  directory and Inductor cache kept, as a restarted process finds them: vLLM's own
  ``torch_compile_cache`` included, so vLLM calls our ``load()``), and a new node (all of
  those fresh, the same remote: vLLM calls ``compile()``, which fetches).

Every start must answer one chat request with the builder's text, and the new node must
compile nothing. ``--smoke`` starts no server: it checks the vLLM python resolves.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

from ._harness import machine, smoke
from .bench_vllm_cold_start import TP2_ENV, Run, server_setup, start, vllm_python, work_dir

TARGET = 1.05
ROUNDS = 3


def run_tp(tp: int, python: str, model: str, workdir: Path, rounds: int,
           ready_timeout: float) -> tuple[list[Run], list[Run]]:
    """The builder's cold start, then `rounds` alternating rounds of (warm restart, new
    node)."""
    extra = TP2_ENV if tp == 2 else {}
    remote = workdir / f"remote-tp{tp}"
    remote.mkdir(parents=True)
    builder = workdir / f"builder-tp{tp}"
    (builder / "tmp").mkdir(parents=True)
    builder_env = {"VLLM_NEURON_HOST_MODE": "1", "VLLM_CACHE_ROOT": str(builder / "cache"),
                   "TMPDIR": str(builder / "tmp"),
                   "TORCHINDUCTOR_CACHE_DIR": str(builder / "inductor"),
                   "NEURON_LIBTORCH_REMOTE_CACHE": str(remote), **extra}
    cold = start(Run(tp, "plugin builder cold"), python, model, workdir, builder_env,
                 builder / "cache" / "neuron" / "compile_cache", ready_timeout)
    if not cold.cache.get("compiles"):
        raise RuntimeError(f"tp{tp}: the builder's cold start compiled nothing ({cold.cache})")
    if not any((remote / ".modelinfos").glob("*/*.json")):
        raise RuntimeError(f"tp{tp}: the builder left no model information on the remote")
    warm: list[Run] = []
    new: list[Run] = []
    for round_ in range(rounds):
        warm.append(start(Run(tp, f"plugin warm restart {round_ + 1}"), python, model, workdir,
                          builder_env, builder / "cache" / "neuron" / "compile_cache",
                          ready_timeout))  # fmt: skip
        node = workdir / f"new-tp{tp}-{round_ + 1}"
        (node / "tmp").mkdir(parents=True)
        node_env = {**builder_env, "VLLM_CACHE_ROOT": str(node / "cache"),
                    "TMPDIR": str(node / "tmp"), "TORCHINDUCTOR_CACHE_DIR": str(node / "inductor")}
        run = start(Run(tp, f"plugin new node {round_ + 1}"), python, model, workdir, node_env,
                    node / "cache" / "neuron" / "compile_cache", ready_timeout)
        if run.cache.get("compiles"):
            raise RuntimeError(f"{run.name} compiled {run.cache['compiles']} graphs: the "
                               "remote should have held every one")
        new.append(run)
    answers = {r.answer for r in (cold, *warm, *new)}
    if len(answers) != 1:
        raise RuntimeError(f"tp{tp}: the starts answered differently: {answers}")
    return warm, new


def verdict(tp: int, warm: list[Run], new: list[Run]) -> bool:
    met = True
    for what in ("ready", "cpu"):
        ours = statistics.median(getattr(r, what) for r in new)
        base = statistics.median(getattr(r, what) for r in warm)
        ratio = ours / base
        ok = ratio <= TARGET
        met &= ok
        unit = "wall" if what == "ready" else "CPU"
        print(f"  TP={tp} new node / warm restart, {unit}: {ratio:.2f}x (medians {ours:.1f} s / "
              f"{base:.1f} s; new {[round(getattr(r, what), 1) for r in new]}, warm "
              f"{[round(getattr(r, what), 1) for r in warm]}); target <= {TARGET:.2f}x: "
              f"{'met' if ok else 'NOT MET'}")
    return met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks new_node", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--dir", default=None, help="where the runs' roots and logs go")
    parser.add_argument("--keep", action="store_true", help="keep the roots and server logs")
    parser.add_argument("--ready-timeout", type=float, default=1800.0)
    args = parser.parse_args([] if argv is None else argv)
    print(machine())
    if smoke():
        python = vllm_python(build=False)
        print(f"smoke run: no server started; vLLM python: {python or 'not built'}")
        print(f"P11 new node: setup checked (smoke run); target <= {TARGET:.2f}x")
        return 0
    python, model = server_setup()
    workdir = work_dir("bench-new-node-", args.dir)
    met = True
    try:
        for tp in (int(t) for t in args.tp.split(",") if t):
            print(f"TP={tp}: the builder's cold start, then {args.rounds} rounds of (warm "
                  "restart, new node)", flush=True)
            warm, new = run_tp(tp, python, model, workdir, args.rounds, args.ready_timeout)
            met &= verdict(tp, warm, new)
    finally:
        if args.keep:
            print(f"roots and logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"P11 new node: {'met' if met else 'NOT MET'}  ({machine()})")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
