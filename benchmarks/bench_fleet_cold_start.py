"""P7 - fleet cold start: N nodes start together on one remote; the fleet compiles each graph
once (the fleet's single flight, `vllm_neuron/compile/flow/fleet.py`) vs every node compiling
(``remote_write="off"``, the node-alone design).

Every simulated node is a local tier of its own (a directory) with R ranks, each a real
process (`benchmarks/fleet_worker.py`); all nodes share one remote: a folder (with leases,
as on NFS), and S3 on a moto server on loopback (started here, as `tests/conftest.py`
does). The toolchain is a test one: a compile sleeps ``--compile-seconds`` (the compiler
runs on the node's own cores; sleeping models that without letting 64 simulated compilers
fight over this machine's cores) and writes ``--files`` x ``--file-mib`` MiB of bytes
derived from the key, so what is measured is the coordination, and every process checks
the bytes it got.

Every process imports, builds its `TwoTierCache` and opens (probes) the remote before a
barrier; the wall time runs from the barrier's release to the last process done. Compiles
are counted fleet-wide twice: the cache's events (``read_stats(node_dir).compiles``,
summed) and a marker per compile started.

Targets (fleet): compiles == unique graphs; wall <= G x (one compile + one fetch) + 2 s,
where "one compile" is the compile as measured in the run (sleep + writing the files +
checksums) and "one fetch" the mean fetch of the run. The baseline compiles once per
node; its wall is about one compile (the nodes compile in parallel, each on its own
cores), so the ratio baseline wall / fleet wall shows what the coordination costs in
time; what it saves is N - G compiles of the fleet's compute.

``--inductor`` adds a real run: 4 nodes x 2 ranks, each process
``torch.compile(model, backend="vllm_neuron")`` of a tiny MLP with its own Inductor cache
(only our cache can save a compile), fleet vs ``VLLM_NEURON_REMOTE_WRITE=off``. There the
baseline's compiles share this machine's 2 cores, unlike a real fleet's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from vllm_neuron.backends.testing import moto_s3_server

from ._harness import machine, smoke
from .fleet_worker import GO_FIFO, RESULT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLACK = 2.0  # seconds the target allows beyond G x (compile + fetch)
WORKER_TIMEOUT = 1200.0  # a hang, not a slow machine
STARTING = 4
"""Workers starting (importing, probing the remote) at once: 64 at once on 2 cores starve
the moto server in this process, and a remote that does not answer a probe within its
request timeout (10 s) is set aside, as it should be; start-up is not what is measured."""
KEY_PREFIX = "f1ee7c01d5a7"  # + 20 hex digits: the graph's index

# The cache's settings a developer may have exported; every worker starts without them.
CACHE_ENV = ("NEURON_LIBTORCH_REMOTE_CACHE", "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE",
             "VLLM_NEURON_DISABLE_WARMUP_COMPILE", "TORCHINDUCTOR_FORCE_DISABLE_CACHES",
             "VLLM_NEURON_REMOTE_WRITE", "VLLM_NEURON_REMOTE_LEASE_SECONDS",
             "VLLM_NEURON_COMPILE_RETRY_AFTER", "NEURON_LIBTORCH_COMPILATION_TIMEOUT",
             "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR")
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
S3_ENV_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL",
                "AWS_ENDPOINT_URL_S3")


def key_for(graph: int) -> str:
    return f"{KEY_PREFIX}{graph:020x}"


# ------------------------------------------------------------------------ remotes


@dataclass
class Remote:
    """Where the fleet's remote is and how a worker reaches it."""

    kind: str  # "folder" or "s3"
    url: str
    options: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)


S3_REQUESTS = itertools.count()
"""Requests the moto server has handled (`next` of it: one more than the count so far)."""


def s3_requests() -> int:
    return next(S3_REQUESTS)


def moto_server() -> AbstractContextManager[str]:
    """moto's S3 HTTP API on 127.0.0.1, in this process's threads, counting its requests.

    Its CPU time is this process's (the benchmark itself only waits meanwhile), which is
    how each group reports what the server used."""
    return moto_s3_server(on_request=lambda: next(S3_REQUESTS))


def new_remote(kind: str, root: str, endpoint: str | None) -> Remote:
    if kind == "folder":
        path = os.path.join(root, "remote")
        os.makedirs(path)
        # Leases, not kernel locks: nodes share no kernel on NFS or FSx.
        return Remote(kind, path, {"lock": "lease"})
    import boto3

    assert endpoint is not None
    bucket = f"fleet-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing",
                 ).create_bucket(Bucket=bucket)
    return Remote(kind, f"s3://{bucket}/compile-cache", {},
                  {**S3_ENV, "AWS_ENDPOINT_URL": endpoint})


def worker_env(remote: Remote, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for name in CACHE_ENV + S3_ENV_UNSET:
        env.pop(name, None)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(remote.env)
    env.update(extra or {})
    return env


# ------------------------------------------------------------------------ one group


@dataclass
class Group:
    """One fleet started together and what it did."""

    remote: str
    nodes: int
    ranks: int
    graphs: int
    design: str  # "fleet" or "baseline"
    wall: float = 0.0
    compiles: int = 0  # from the events, summed over the nodes
    started: int = 0  # compile markers (fake toolchain only)
    wrong: list[str] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)
    compile_seconds: float = 0.0  # mean of the compiles (events)
    fetch_seconds: float = 0.0  # mean of the fetches (events)
    fetches: int = 0
    lease_waits: int = 0
    outages: int = 0  # the remote set aside by a process (a failed or timed-out request)
    release_lag: float = 0.0  # the last process to wake after the release
    first_compiled: float = 0.0  # the first process whose result was a compile, done at
    start_up: float = 0.0  # from the first spawn to the barrier's release
    cpu: float = 0.0  # CPU seconds of the workers from the release to their results
    server_cpu: float = 0.0  # CPU seconds of this process meanwhile: the moto server's
    requests: int = -1  # S3 requests from the release to the last result (-1: no S3)

    @property
    def label(self) -> str:
        return f"{self.nodes}x{self.ranks}"

    @property
    def budget(self) -> float:
        return self.graphs * (self.compile_seconds + self.fetch_seconds) + SLACK


def run_group(workdir: str, remote_kind: str, endpoint: str | None, *, nodes: int, ranks: int,
              graphs: int, design: str, mode: str, args: argparse.Namespace,
              worker_extra: dict[str, Any] | None = None) -> Group:
    """Start nodes x ranks workers, release them together, wait for the last; collect.
    `worker_extra` goes into every fake worker's arguments (``defer``, ``compile_workers``)."""
    from vllm_neuron.compile.entry.events import read_stats

    name = f"{remote_kind}-{nodes}x{ranks}-{design.replace(' ', '-')}-"
    root = tempfile.mkdtemp(dir=workdir, prefix=name)
    barrier, markers, logs = (os.path.join(root, d) for d in ("barrier", "markers", "logs"))
    for d in (barrier, markers, logs):
        os.makedirs(d)
    os.mkfifo(os.path.join(barrier, GO_FIFO))
    remote = new_remote(remote_kind, root, endpoint)
    remote_write = "auto" if design.endswith("fleet") else "off"
    procs: list[tuple[subprocess.Popen[bytes], str]] = []
    node_dirs: list[str] = []
    spawned = time.time()
    try:  # every worker is killed if anything fails: one left would wait at the barrier
        for node in range(nodes):
            if mode == "fake":
                node_dir = os.path.join(root, f"node{node:02d}")
            else:  # the runtime's local tier under VLLM_CACHE_ROOT
                node_dir = os.path.join(root, f"node{node:02d}", "neuron", "compile_cache")
            node_dirs.append(node_dir)
            for rank in range(ranks):
                if mode == "fake":
                    worker_args: dict[str, Any] = {
                        "node_dir": node_dir, "remote": remote.url,
                        "remote_options": remote.options, "remote_write": remote_write,
                        "keys": [key_for(g) for g in range(graphs)],
                        "compile_seconds": args.compile_seconds, "files": args.files,
                        "file_mib": args.file_mib, "marker_dir": markers, "barrier_dir": barrier,
                        "timeout": WORKER_TIMEOUT, **(worker_extra or {}),
                    }
                    env = worker_env(remote)
                else:
                    worker_args = {"barrier_dir": barrier, "remote_write": remote_write}
                    env = worker_env(remote, {
                        "VLLM_CACHE_ROOT": os.path.join(root, f"node{node:02d}"),
                        "NEURON_LIBTORCH_REMOTE_CACHE": remote.url,
                        "VLLM_NEURON_TOOLCHAIN": "host",
                        "VLLM_NEURON_REMOTE_WRITE": remote_write,
                        "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, f"inductor-{node}-{rank}"),
                        "NEURON_LIBTORCH_COMPILATION_TIMEOUT": str(int(WORKER_TIMEOUT)),
                    })
                _wait_ready(barrier, procs, len(procs) - STARTING + 1)
                log = os.path.join(logs, f"node{node:02d}-rank{rank}")
                # Output to files, not pipes: a full pipe would stall a worker we are not
                # reading at that moment, and stretch the wall time.
                with open(log + ".out", "wb") as out, open(log + ".err", "wb") as err:
                    procs.append((subprocess.Popen(
                        [sys.executable, "-m", "benchmarks.fleet_worker", mode,
                         json.dumps(worker_args)],
                        cwd=ROOT, env=env, stdout=out, stderr=err), log))
        _wait_ready(barrier, procs, len(procs))
        requests, server_cpu = s3_requests(), time.process_time()
        go = time.time()
        go_fd = os.open(os.path.join(barrier, GO_FIFO), os.O_RDWR)  # wakes every worker
        try:
            results = _finish(procs)
        finally:
            os.close(go_fd)
        requests, server_cpu = s3_requests() - requests - 1, time.process_time() - server_cpu
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    group = Group(remote_kind, nodes, ranks, graphs, design)
    group.start_up = go - spawned
    group.cpu = sum(r["cpu"] for r in results)
    if remote_kind == "s3":
        group.requests, group.server_cpu = requests, server_cpu
    group.wall = max(r["finished"] for r in results) - go
    group.release_lag = max(r["released"] for r in results) - go
    done_compiling = [r["finished"] for r in results if "compiled" in r["sources"]]
    group.first_compiled = (min(done_compiling) - go) if done_compiling else 0.0
    for r in results:
        group.wrong += r["wrong"]
        for s in r["sources"]:
            group.sources[s] = group.sources.get(s, 0) + 1
    group.started = len(os.listdir(markers))
    compile_seconds = fetch_seconds = 0.0
    for node_dir in node_dirs:
        stats = read_stats(node_dir)
        group.compiles += stats.compiles
        group.fetches += stats.fetches
        group.lease_waits += stats.lease_waits
        group.outages += stats.remote_outages
        compile_seconds += stats.compile_seconds
        fetch_seconds += stats.fetch_seconds
    group.compile_seconds = compile_seconds / max(1, group.compiles)
    group.fetch_seconds = fetch_seconds / max(1, group.fetches)
    shutil.rmtree(root, ignore_errors=True)
    return group


def _wait_ready(barrier: str, procs: list[tuple[subprocess.Popen[bytes], str]],
                count: int) -> None:
    """Wait until `count` workers are ready, failing if one died first.

    Once all are, the caller opens the FIFO, and every worker blocked in its ``open``
    wakes; the descriptor stays open until all are done, so a worker that said ready but
    had not reached ``open`` yet passes straight through."""
    deadline = time.monotonic() + WORKER_TIMEOUT
    while len([n for n in os.listdir(barrier) if n.startswith("ready-")]) < count:
        for p, log in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a worker exited before the barrier ({p.returncode}):\n"
                                   + _tail(log))
        if time.monotonic() > deadline:
            raise RuntimeError("the workers did not all reach the barrier")
        time.sleep(0.05)


def _finish(procs: list[tuple[subprocess.Popen[bytes], str]]) -> list[dict[str, Any]]:
    results = []
    for p, log in procs:
        p.wait(timeout=WORKER_TIMEOUT)
        with open(log + ".out") as f:
            line = next((ln for ln in f if ln.startswith(RESULT)), None)
        if p.returncode != 0 or line is None:
            raise RuntimeError(f"a worker failed ({p.returncode}):\n" + _tail(log))
        results.append(json.loads(line[len(RESULT):]))
    return results


def _tail(log: str) -> str:
    text = ""
    for ext in (".out", ".err"):
        try:
            with open(log + ext, errors="replace") as f:
                text += f"--- {ext[1:]}\n" + f.read()[-4000:] + "\n"
        except OSError:
            pass
    return text


# ------------------------------------------------------------------------ report

HEADER = ("| remote | nodes x ranks | graphs | design | processes | wall | compiles (events / "
          "markers) | mean compile | mean fetch | fetches | lease waits | remote outages "
          "| first compile done "
          "| release lag | CPU after release: workers / S3 server | S3 requests | start-up "
          "| bytes ok |")


def row(g: Group) -> str:
    markers = "-" if g.design.startswith("inductor") else str(g.started)
    return (f"| {g.remote} | {g.label} | {g.graphs} | {g.design} | {g.nodes * g.ranks} "
            f"| {g.wall:.2f} s | {g.compiles} / {markers} | {g.compile_seconds:.2f} s "
            f"| {g.fetch_seconds:.3f} s | {g.fetches} | {g.lease_waits} | {g.outages} "
            f"| {g.first_compiled:.2f} s | {g.release_lag:.3f} s | {g.cpu:.1f} s / "
            + (f"{g.server_cpu:.1f} s | {g.requests}" if g.requests >= 0 else "- | -")
            + f" | {g.start_up:.0f} s "
            f"| {'yes' if not g.wrong else 'NO: ' + '; '.join(g.wrong[:3])} |")


def verdict(fleet: Group, base: Group) -> tuple[bool, bool, str]:
    """(compiles met, wall met, the line)."""
    once = fleet.compiles == fleet.graphs and fleet.started == fleet.graphs and not (
        fleet.wrong or base.wrong)
    on_time = fleet.wall <= fleet.budget
    over = fleet.wall - fleet.budget
    line = (f"  {fleet.remote} {fleet.label}, {fleet.graphs} graph(s): baseline wall / fleet "
            f"wall {base.wall / fleet.wall:.2f}x ({base.wall:.2f} s / {fleet.wall:.2f} s); "
            f"compiles fleet {fleet.compiles} vs baseline {base.compiles}, == unique graphs "
            f"({fleet.graphs}): {'met' if once else 'NOT MET'}; wall {fleet.wall:.2f} s vs "
            f"budget {fleet.budget:.2f} s ({fleet.graphs} x (compile {fleet.compile_seconds:.2f}"
            f" + fetch {fleet.fetch_seconds:.3f}) + {SLACK:g} s): "
            + ("met" if on_time else f"NOT MET by {over:.2f} s"))
    return once, on_time, line


def parse_config(text: str) -> tuple[int, int]:
    nodes, _, ranks = text.lower().partition("x")
    return int(nodes), int(ranks)


def run_all(workdir: str, endpoint: str | None, remotes: list[str],
            configs: list[tuple[int, int]], graph_counts: list[int],
            args: argparse.Namespace) -> tuple[list[tuple[Group, Group]], list[Group]]:
    """Every (fleet, baseline) pair, the baseline first; then the Inductor groups."""
    pairs: list[tuple[Group, Group]] = []
    inductor: list[Group] = []
    for remote in remotes:
        for nodes, ranks in configs:
            for graphs in graph_counts:
                both = {}
                for design in ("baseline", "fleet"):
                    both[design] = g = run_group(
                        workdir, remote, endpoint, nodes=nodes, ranks=ranks, graphs=graphs,
                        design=design, mode="fake", args=args)
                    print(f" {g.remote} {g.label} {g.graphs} graph(s) {design:<8}: wall "
                          f"{g.wall:6.2f} s, first compile done {g.first_compiled:.2f} s, CPU "
                          f"{g.cpu:.1f} s, compiles {g.compiles} (markers {g.started}), "
                          f"outages {g.outages}, sources {g.sources}, bytes "
                          f"{'ok' if not g.wrong else 'WRONG'}  "
                          f"({machine().rsplit(', ', 1)[-1]})", flush=True)
                pairs.append((both["fleet"], both["baseline"]))
        if args.inductor:
            nodes, ranks = parse_config(args.inductor_config)
            for design in ("inductor baseline", "inductor fleet"):
                g = run_group(workdir, remote, endpoint, nodes=nodes, ranks=ranks, graphs=1,
                              design=design, mode="torch", args=args)
                inductor.append(g)
                print(f" {g.remote} {g.label} {design}: wall {g.wall:6.2f} s, compiles "
                      f"{g.compiles}, sources {g.sources}, outputs "
                      f"{'match eager' if not g.wrong else 'WRONG'}  "
                      f"({machine().rsplit(', ', 1)[-1]})", flush=True)
    return pairs, inductor


def main(argv: list[str] | None = None) -> int:
    tiny = smoke()
    parser = argparse.ArgumentParser(prog="python -m benchmarks fleet_cold_start",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="2x2" if tiny else "16x4,64x1",
                        help="fleets as NODESxRANKS, comma-separated")
    parser.add_argument("--graphs", default="1", help="graph counts, comma-separated (e.g. 1,2)")
    parser.add_argument("--remotes", default="folder,s3", help="folder and/or s3 (moto)")
    parser.add_argument("--compile-seconds", type=float, default=0.2 if tiny else 5.0)
    parser.add_argument("--files", type=int, default=4, help="files per entry")
    parser.add_argument("--file-mib", type=float, default=0.25 if tiny else 1.0)
    parser.add_argument("--inductor", action="store_true",
                        help="also the real-Inductor fleet, 4 nodes x 2 ranks (slow)")
    parser.add_argument("--inductor-config", default="4x2")
    parser.add_argument("--dir", default=None, help="where the nodes' and remote's files go")
    args = parser.parse_args([] if argv is None else argv)
    configs = [parse_config(c) for c in args.configs.split(",") if c]
    graph_counts = [int(g) for g in args.graphs.split(",") if g]
    remotes = [r for r in args.remotes.split(",") if r]
    unknown = set(remotes) - {"folder", "s3"}
    if unknown:
        parser.error(f"unknown remote(s): {', '.join(sorted(unknown))}")

    print(machine())
    print(f"fleet cold start: compile = sleep {args.compile_seconds:g} s + {args.files} x "
          f"{args.file_mib:g} MiB; remotes {', '.join(remotes)}; fleets {args.configs}; "
          f"graphs {args.graphs}" + ("; smoke run (figures mean nothing)" if tiny else ""),
          flush=True)
    s3 = moto_server() if "s3" in remotes else _nothing()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-fleet-") as workdir, \
            s3 as endpoint:
        pairs, inductor = run_all(workdir, endpoint, remotes, configs, graph_counts, args)
    print()
    print(HEADER)
    print("|" + " --- |" * HEADER.count(" | ") + " --- |")
    for fleet, base in pairs:
        print(row(base))
        print(row(fleet))
    for g in inductor:
        print(row(g))
    print()
    all_once = all_on_time = True
    for fleet, base in pairs:
        once, on_time, line = verdict(fleet, base)
        all_once &= once
        all_on_time &= on_time
        print(line)
    for base, fleet in zip(inductor[::2], inductor[1::2], strict=True):
        ok = fleet.compiles == 1 and not (fleet.wrong or base.wrong)
        all_once &= ok
        print(f"  {fleet.remote} {fleet.label} real Inductor: baseline wall / fleet wall "
              f"{base.wall / fleet.wall:.2f}x ({base.wall:.2f} s / {fleet.wall:.2f} s); "
              f"compiles fleet {fleet.compiles} vs baseline {base.compiles}, == 1: "
              f"{'met' if ok else 'NOT MET'}; outputs match eager: "
              f"{'yes' if not (fleet.wrong or base.wrong) else 'NO'}; wall vs compile "
              f"{fleet.compile_seconds:.2f} + fetch {fleet.fetch_seconds:.3f} + {SLACK:g} s = "
              f"{fleet.budget:.2f} s: {'within' if fleet.wall <= fleet.budget else 'over'} "
              "(informational)")
    print(f"compiles == unique graphs in every fleet: {'met' if all_once else 'NOT MET'}; "
          f"wall <= G x (compile + fetch) + {SLACK:g} s in every fleet: "
          f"{'met' if all_on_time else 'NOT MET'}")
    return 0 if all_once and all_on_time else 1


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
