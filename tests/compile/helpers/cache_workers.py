"""Helpers for the compile-cache tests: deterministic fake compiles, and the worker
processes the multi-process tests start (``python cache_workers.py MODE JSON``).

A fake compile writes files whose bytes are derived from the key, so any process can tell
a right artifact from a wrong one without a registry of what was compiled. It can be slow
(a window for a racing reader), can fail on purpose, and can stop half-way until the test
lets it go on (``hold_dir``: a SIGKILL then lands mid-compile by handshake, not by timing).
It leaves a marker file per call in ``marker_dir``, so a test counts how many compiles
*started* (the cache's events only count the ones that finished).

Every wait here is a handshake on files (a barrier, a hold, a marker the test polls for),
never a moment on the clock: a loaded machine only makes a test slower, never red.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import socket
import sys
import time
import traceback
from collections.abc import Mapping
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT_PREFIX = "CACHE_WORKER_RESULT "
FILE_NAMES = ("graph.bin", "weights/w0.bin", "weights/w1.bin", "meta.txt")


def content_for(key: str, name: str, size: int = 4096) -> bytes:
    """The bytes a fake compile of `key` writes to `name`: a function of both, nothing else."""
    seed = hashlib.sha256(f"{key}/{name}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def expected_files(key: str) -> dict[str, bytes]:
    return {name: content_for(key, name) for name in FILE_NAMES}


HELD = "held"  # in a hold_dir: the held compile's pid
RESUME = "resume"  # in a hold_dir: created by the test to let the held compile go on
WAITING = "waiting-"  # in a waiting_dir: waiting-<pid>, written just before a lock wait
COMPILING = "compiling-"  # in a rendezvous_dir: compiling-<key>, one per running compile
FLEET_WAITING = "fleet-waiting-"  # in a fleet_wait_dir: a process polling the remote
SAFETY = 600.0  # seconds; a handshake that takes this long is a hang, not a slow machine


def _poll(done: Any, what: str, timeout: float = SAFETY) -> None:
    """Poll `done()` until it is true; `timeout` only catches a real hang."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker {os.getpid()}: gave up waiting for {what}")
        time.sleep(0.01)


def _touch(path: str, text: str = "") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _hold_once(hold_dir: str) -> None:
    """The first caller (across processes) writes ``held`` (its pid) and waits for
    ``resume``; any later caller goes straight on."""
    os.makedirs(hold_dir, exist_ok=True)
    mine = os.path.join(hold_dir, f".held-{os.getpid()}-{time.time_ns()}")
    _touch(mine, str(os.getpid()))
    try:
        os.link(mine, os.path.join(hold_dir, HELD))  # atomic and exclusive, pid inside
    except FileExistsError:
        return
    finally:
        os.unlink(mine)
    _poll(lambda: os.path.exists(os.path.join(hold_dir, RESUME)), "the test to resume")


def fake_compile(
    out_dir: str,
    *,
    key: str,
    delay: float = 0.0,
    marker_dir: str | None = None,
    fail: str | None = None,
    hold_dir: str | None = None,
) -> dict[str, Any]:
    """Write the key's files into `out_dir`, one at a time over `delay` seconds.

    With `hold_dir`, the first compile to get half-way (one per `hold_dir`, across
    processes) stops there, with two of its four files being written (the first whole, the
    second half), until the test creates ``<hold_dir>/resume`` (see `_hold_once`).
    """
    if marker_dir is not None:
        _touch(os.path.join(marker_dir, f"started-{os.getpid()}-{time.time_ns()}"),
               str(os.getpid()))
    step = delay / len(FILE_NAMES)
    for i, (name, data) in enumerate(expected_files(key).items()):
        path = os.path.join(out_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            half = len(data) // 2
            f.write(data[:half])  # half a file exists for a while: a reader must never see it
            f.flush()
            if i == 1 and hold_dir is not None:
                _hold_once(hold_dir)
            time.sleep(step)
            f.write(data[half:])
        if fail is not None and name == FILE_NAMES[1]:
            raise ValueError(fail)
    return {"fake": True, "key": key}


def entry_is_right(path: str, key: str) -> str | None:
    """None if the entry directory at `path` holds exactly the key's files, else why not."""
    for name, data in expected_files(key).items():
        try:
            with open(os.path.join(path, name), "rb") as f:
                actual = f.read()
        except OSError as exc:
            return f"{name}: {exc}"
        if actual != data:
            return f"{name}: wrong bytes"
    return None


def _wait_for_go(barrier_dir: str | None) -> None:
    """Line up with the other workers at a file barrier: write ``ready-<pid>``, wait for
    ``go`` (see `release_barrier`)."""
    if barrier_dir is None:
        return
    _touch(os.path.join(barrier_dir, f"ready-{os.getpid()}"))
    _poll(lambda: os.path.exists(os.path.join(barrier_dir, "go")), "the barrier")


def _announce_lock_waits(store: Any, waiting_dir: str) -> None:
    """Make `store`'s locks write ``<waiting_dir>/waiting-<pid>`` just before they block, so
    a test knows by a file (not by a pause) that this process is queued on a key's lock."""
    real_lock = store.lock

    def lock(name: str, **kwargs: Any) -> Any:
        inner = real_lock(name, **kwargs)
        real_acquire = inner.acquire

        def acquire(timeout: float | None = None) -> None:
            _touch(os.path.join(waiting_dir, f"{WAITING}{os.getpid()}"))
            real_acquire(timeout)

        inner.acquire = acquire
        return inner

    store.lock = lock


def _announce_fleet_waits(cache: Any, fleet_wait_dir: str) -> None:
    """Write ``<fleet_wait_dir>/fleet-waiting-<pid>`` when this process looks at the remote
    for the second time on one miss: the first look is the plain fetch, every later one is
    a poll while another node holds the key's remote lease. A test then knows by a file
    that this process is waiting on the fleet."""
    real_fetch = cache.fetch_remote
    looks = {"n": 0}

    def fetch_remote(key: str) -> Any:
        looks["n"] += 1
        if looks["n"] == 2:
            _touch(os.path.join(fleet_wait_dir, f"{FLEET_WAITING}{os.getpid()}"))
        return real_fetch(key)

    cache.fetch_remote = fetch_remote


def _rendezvous(rendezvous_dir: str, key: str, parties: int) -> None:
    """Announce a compile of `key`, then wait until compiles of `parties` different keys
    are running at once: if different keys contended, this would never return."""
    _touch(os.path.join(rendezvous_dir, f"{COMPILING}{key}"))
    _poll(lambda: len([n for n in os.listdir(rendezvous_dir) if n.startswith(COMPILING)])
          >= parties, f"compiles of {parties} keys at once", timeout=SAFETY / 2)


def wait_for(predicate: Any, what: str, procs: Any = ()) -> Any:
    """Poll until `predicate()` is true and return its value; a worker exiting first (other
    than one the test SIGKILLed), or a hang (`SAFETY`), fails the test."""
    import signal

    deadline = time.monotonic() + SAFETY
    while True:
        value = predicate()
        if value:
            return value
        for p in procs:
            if p.poll() is not None and p.returncode != -signal.SIGKILL:
                out, err = p.communicate()
                raise AssertionError(f"a worker exited while waiting for {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def release_barrier(
    barrier_dir: str, parties: int, procs: list[Any], timeout: float = SAFETY
) -> float:
    """Wait until `parties` workers are ready (failing if one died first), then let them go.

    `timeout` only catches a hang: a worker that cannot start is found dead, not late.
    """
    deadline = time.monotonic() + timeout
    while True:
        ready = [n for n in os.listdir(barrier_dir) if n.startswith("ready-")] if (
            os.path.isdir(barrier_dir)) else []
        if len(ready) >= parties:
            break
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            out, err = dead[0].communicate()
            raise AssertionError(f"a worker exited before the barrier:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"only {len(ready)} of {parties} workers reached the barrier")
        time.sleep(0.02)
    _touch(os.path.join(barrier_dir, "go"))
    return time.time()


def run_get(args: Mapping[str, Any]) -> dict[str, Any]:
    """One "rank": get the key's entry through the cache, check it, report what happened."""
    from vllm_neuron.backends import open_store
    from vllm_neuron.compile.flow.cache import TwoTierCache

    local = open_store(args["cache_dir"], lock=args.get("lock", "auto"))
    if args.get("waiting_dir"):
        _announce_lock_waits(local, args["waiting_dir"])
    cache = TwoTierCache(
        local,
        remote=args.get("remote"),
        timeout=float(args.get("timeout", 120)),
        lease_duration=float(args.get("lease_duration", 30)),
        precompiled_only=bool(args.get("precompiled_only", False)),
        remote_options=args.get("remote_options"),
        remote_write=args.get("remote_write", "auto"),
        remote_lease_seconds=float(args.get("remote_lease_seconds", 30)),
        compile_retry_after=float(args.get("compile_retry_after", 300)),
    )
    if args.get("fleet_wait_dir"):
        _announce_fleet_waits(cache, args["fleet_wait_dir"])
    key = args["key"]
    _wait_for_go(args.get("barrier_dir"))
    t0 = time.time()

    def compile_fn(out: str) -> dict[str, Any]:
        if args.get("rendezvous_dir"):
            _rendezvous(args["rendezvous_dir"], key, int(args["rendezvous"]))
        return fake_compile(
            out,
            key=key,
            delay=float(args.get("delay", 0)),
            marker_dir=args.get("marker_dir"),
            fail=args.get("fail"),
            hold_dir=args.get("hold_dir"),
        )

    # ``retry_for``: a node asked for the graph again after each failure (vLLM restarted on
    # it), for that many seconds at most; ``refused``: how many asks failed, and for how long
    # (monotonic seconds from the first failure to the last).
    retry_until = time.monotonic() + float(args.get("retry_for", 0))
    refused: list[float] = []
    while True:
        try:
            result = cache.get_or_compile(key, compile_fn)
            break
        except Exception as exc:  # reported to the test, which asserts on it
            refused.append(time.monotonic())
            if time.monotonic() < retry_until:
                time.sleep(0.05)
                continue
            return {"ok": False, "error_type": type(exc).__name__, "error": str(exc),
                    "started": t0, "finished": time.time(), "pid": os.getpid(),
                    "local_dir": cache.local_dir, "refused": len(refused)}
    assert result.path is not None
    return {
        "refused": len(refused),
        "refused_for": refused[-1] - refused[0] if refused else 0.0,
        "ok": True,
        "source": result.source,
        "local_dir": cache.local_dir,
        "path": result.path,
        "wrong": entry_is_right(result.path, key),
        "started": t0,
        "finished": time.time(),
        "pid": os.getpid(),
    }


def run_trace(args: Mapping[str, Any]) -> dict[str, Any]:
    """One "rank" tracing a model of several graphs, as vLLM's piecewise backend does: every
    graph is handed to the cache (`TwoTierCache.begin`) before any runs, then each is
    "called" in order (a deferred one is waited for then) and its entry checked.

    ``keys``: the graphs, traced in this order by every rank; ``fail_key``: the graph
    whose compile fails; ``hold_key`` + ``hold_dir``: the graph whose first compile stops
    half-way until the test resumes it (or SIGKILLs it). ``compile_workers``: the node's
    compile slots (None: unbounded); ``defer``: VLLM_NEURON_DEFER_COMPILES."""
    from vllm_neuron.backends import open_store
    from vllm_neuron.compile.entry.outcomes import PendingCompile
    from vllm_neuron.compile.flow.cache import TwoTierCache

    workers = args.get("compile_workers")
    cache = TwoTierCache(
        open_store(args["cache_dir"]),
        remote=args.get("remote"),
        timeout=float(args.get("timeout", 120)),
        remote_options=args.get("remote_options"),
        remote_lease_seconds=float(args.get("remote_lease_seconds", 30)),
        compile_workers=None if workers is None else int(workers),
        defer_compiles=bool(args.get("defer", True)),
    )

    def compile_fn(key: str) -> Any:
        def compile_into(out: str) -> dict[str, Any]:
            if args.get("rendezvous_dir"):
                _rendezvous(args["rendezvous_dir"], key, int(args["rendezvous"]))
            return fake_compile(
                out, key=key, delay=float(args.get("delay", 0)),
                marker_dir=args.get("marker_dir"),
                fail="the compiler rejects this graph" if key == args.get("fail_key") else None,
                hold_dir=args.get("hold_dir") if key == args.get("hold_key") else None)
        return compile_into

    _wait_for_go(args.get("barrier_dir"))
    outcomes: list[Any] = []
    for i, key in enumerate(args["keys"]):
        try:
            outcomes.append(cache.begin(key, compile_fn(key), piece=f"graph {i}"))
        except Exception as exc:  # reported to the test, which asserts on it
            outcomes.append(exc)
    traced = time.time()
    graphs: dict[str, Any] = {}
    for key, outcome in zip(args["keys"], outcomes, strict=True):
        try:
            if isinstance(outcome, Exception):
                raise outcome
            deferred = isinstance(outcome, PendingCompile)
            result = outcome.result() if deferred else outcome
        except Exception as exc:  # reported to the test, which asserts on it
            graphs[key] = {"ok": False, "error_type": type(exc).__name__, "error": str(exc)}
            continue
        assert result.path is not None
        graphs[key] = {"ok": True, "deferred": deferred, "source": result.source,
                       "wrong": entry_is_right(result.path, key)}
    return {"ok": True, "graphs": graphs, "traced": traced, "pid": os.getpid(),
            "writer": f"{socket.gethostname()}-{os.getpid()}"}


def run_pieces(args: Mapping[str, Any]) -> dict[str, Any]:
    """One process handing several real graphs to the runtime as vLLM's piecewise backend
    does (a piece name each, every graph before any call), then calling each and checking
    it against eager PyTorch. The cache settings come from the environment."""
    import torch

    from vllm_neuron.assembly import get_runtime

    runtime = get_runtime()
    graphs = []
    for width in args["widths"]:
        torch.manual_seed(width)
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                    torch.nn.Linear(width, 8)).eval()
        x = torch.randn(4, width)
        fn, traced = runtime.compile(torch.fx.symbolic_trace(model), [x],
                                     piece=f"piece {width}")
        graphs.append((fn, model, x, traced.key))
    matches = []
    with torch.no_grad():
        for fn, model, x, _ in graphs:
            out = fn(x)
            out = out[0] if isinstance(out, (tuple, list)) else out
            matches.append(bool(torch.allclose(out, model(x), rtol=1e-4, atol=1e-5)))
    from vllm_neuron.compile.workers.pool import POOL

    return {"ok": True, "matches": matches, "keys": [g[3] for g in graphs],
            "sources": [g.result.source for g in runtime.history],
            "writer": f"{socket.gethostname()}-{os.getpid()}", "worker_pids": POOL.started,
            "workers_lost": POOL.lost, "workers_retired": POOL.retired}


def run_promote(args: Mapping[str, Any]) -> dict[str, Any]:
    """One "node": promote its local entry with `save_cache` once the barrier opens."""
    from vllm_neuron.compile import save_cache

    _wait_for_go(args.get("barrier_dir"))
    try:
        published = save_cache(args["cache_dir"], args["remote"], args["key"])
    except Exception as exc:
        return {"ok": False, "error_type": type(exc).__name__, "error": str(exc),
                "traceback": traceback.format_exc()}
    return {"ok": True, "published": published}


def build_model(name: str) -> Any:
    """Tiny models for real compiles; two names give two different graphs."""
    import torch

    torch.manual_seed(0)
    width = {"mlp_a": 16, "mlp_b": 24}[name]
    layers: list[Any] = [torch.nn.Linear(width, width), torch.nn.ReLU(),
                         torch.nn.Linear(width, 8)]
    if name == "mlp_b":
        layers.insert(2, torch.nn.Tanh())
    return torch.nn.Sequential(*layers).eval(), torch.randn(4, width)


def run_torch(args: Mapping[str, Any]) -> dict[str, Any]:
    """One rank compiling a real model through ``torch.compile(backend="vllm_neuron")``.

    With ``rendezvous_dir``, a compile that this rank runs waits until compiles of
    ``rendezvous`` different keys are running at once (see `_rendezvous`).
    """
    import torch

    import vllm_neuron  # noqa: F401 - registers the backend
    from vllm_neuron.assembly import get_runtime

    if args.get("rendezvous_dir"):
        cache = get_runtime().cache
        real_begin = cache.begin  # what the runtime calls

        def begin(key: str, compile_fn: Any, **kwargs: Any) -> Any:
            def compile_after_rendezvous(out_dir: str) -> Any:
                _rendezvous(args["rendezvous_dir"], key, int(args["rendezvous"]))
                return compile_fn(out_dir)

            return real_begin(key, compile_after_rendezvous, **kwargs)

        cache.begin = begin

    model, x = build_model(args["model"])
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model, backend="vllm_neuron", dynamic=False)
        _wait_for_go(args.get("barrier_dir"))
        t0 = time.time()
        actual = compiled(x)
        t1 = time.time()
        again = compiled(x)
    history = get_runtime().history
    return {
        "ok": True,
        "sources": [g.result.source for g in history],
        "keys": [g.key for g in history],
        "matches": bool(torch.allclose(actual, expected, rtol=1e-4, atol=1e-5))
        and bool(torch.allclose(again, expected, rtol=1e-4, atol=1e-5)),
        "started": t0,
        "finished": t1,
        "pid": os.getpid(),
    }


def run_assembled(args: Mapping[str, Any]) -> dict[str, Any]:
    """One process whose cache is built from its environment, as a server's is
    (`vllm_neuron.assembly`: the settings decide the tiers), getting ``keys`` with the fake
    compile; reports each key's source, where its entry is, and what the package logged."""
    import logging

    from vllm_neuron.assembly import build_runtime

    said: list[str] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(f"{record.levelname} {record.getMessage()}")

    logger = logging.getLogger("vllm_neuron")
    logger.setLevel(logging.INFO)
    logger.addHandler(Said(logging.INFO))
    try:
        cache = build_runtime().cache
    except Exception as exc:  # reported to the test, which asserts on it
        return {"ok": False, "error_type": type(exc).__name__, "error": str(exc), "said": said}
    out: dict[str, Any] = {"ok": True, "local_dir": cache.local_dir, "said": said,
                           "sources": {}, "wrong": {}, "paths": {}, "errors": {}}
    for key in args["keys"]:
        try:
            result = cache.get_or_compile(key, lambda d, key=key: fake_compile(
                d, key=key, marker_dir=args.get("marker_dir")))
        except Exception as exc:  # noqa: BLE001 - reported per key
            out["errors"][key] = f"{type(exc).__name__}: {exc}"
            continue
        out["sources"][key] = result.source
        out["paths"][key] = result.path
        out["wrong"][key] = entry_is_right(str(result.path), key)
    cache.wait_for_upkeep(60)
    return out


def main(argv: list[str]) -> int:
    mode, raw = argv[0], argv[1]
    args = json.loads(raw)
    result = {"get": run_get, "promote": run_promote, "torch": run_torch,
              "assembled": run_assembled,
              "trace": run_trace, "pieces": run_pieces}[mode](args)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


def parse_result(stdout: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return dict(json.loads(line[len(RESULT_PREFIX):]))
    raise AssertionError(f"no result line in worker output:\n{stdout}")


def worker_env(**extra: str) -> dict[str, str]:
    """The test's environment without the cache settings a developer may have exported."""
    env = dict(os.environ)
    for name in ("NEURON_LIBTORCH_REMOTE_CACHE", "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE",
                 "VLLM_NEURON_DISABLE_WARMUP_COMPILE", "TORCHINDUCTOR_FORCE_DISABLE_CACHES",
                 "VLLM_NEURON_REMOTE_WRITE", "VLLM_NEURON_CACHE_SIGNING_KEY",
                 "VLLM_NEURON_CACHE_TRUSTED_KEYS", "VLLM_NEURON_CACHE_TRUST"):
        env.pop(name, None)
    env.update(extra)
    return env


def finish_workers(procs: list[Any], timeout: float = SAFETY) -> list[dict[str, Any]]:
    """Every worker's result, in order; a worker that exits non-zero fails the test."""
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"worker exited {p.returncode}:\n{out}\n{err}"
        result = parse_result(out)
        result["stderr"] = err
        results.append(result)
    return results


def gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie counts: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True


def wait_until_gone(pids: list[int], what: str) -> None:
    """Wait on each process's exit itself (a pidfd turns readable when it exits), bounded."""
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # gone (and reaped) already
        try:
            poller = select.poll()  # not select(): a busy process's fd numbers pass 1024
            poller.register(fd, select.POLLIN)
            ready = poller.poll(SAFETY * 1000)
        finally:
            os.close(fd)
        assert ready or gone(pid), f"{what}: {pid}"


def worker_command(mode: str, args: Mapping[str, Any]) -> list[str]:
    return [sys.executable, os.path.join(HERE, "cache_workers.py"), mode, json.dumps(dict(args))]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
