"""Many processes, one node: one compile per graph, crashes that heal, failures that
reach the waiters at once, and no partial entry ever visible.

The first two tests compile real graphs with TorchInductor through
``torch.compile(backend="vllm_neuron")`` (each process with a fresh Inductor cache, so
only our cache can save a compile); the others drive `TwoTierCache.get_or_compile` in real
processes with a fake compile (cache_workers.fake_compile) that a test holds half-way, so a
SIGKILL lands mid-compile.

Every "meanwhile" here is a handshake, never a pause or a deadline: the workers line up at
a file barrier, say by a file when they are queued on the key's lock, and the held compile
says by a file where it stopped; the only time limits catch hangs. A loaded machine makes
these tests slower, never red.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from typing import Any

import pytest
from cache_workers import (
    COMPILING,
    HELD,
    RESUME,
    SAFETY,
    WAITING,
    entry_is_right,
    finish_workers,
    release_barrier,
    wait_for,
    worker_command,
    worker_env,
)

from vllm_neuron.backends import open_store
from vllm_neuron.backends.digests import file_digest
from vllm_neuron.compile.entry.events import Compiled, read_stats
from vllm_neuron.compile.entry.record import ENTRY_RECORD, decode_record

KEY = "5ca1ab1e5ca1ab1e5ca1ab1e5ca1ab1e"


class EntryPoller(threading.Thread):
    """Watches an entry directory for the whole test: whenever it exists, it must be whole."""

    def __init__(self, entry_dir: str, key: str) -> None:
        super().__init__(daemon=True)
        self.entry_dir, self.key = entry_dir, key
        self.stop = threading.Event()
        self.observations = 0
        self.problems: list[str] = []

    def check_once(self) -> None:
        if not os.path.isdir(self.entry_dir):
            return
        self.observations += 1
        try:
            with open(os.path.join(self.entry_dir, ENTRY_RECORD), "rb") as f:
                record = decode_record(f.read())
        except Exception as exc:  # noqa: BLE001 - a visible entry without a record
            self.problems.append(f"visible entry without a readable record: {exc}")
            return
        for rel, digest in record.files.items():
            path = os.path.join(self.entry_dir, rel)
            if os.path.getsize(path) != digest.size or file_digest(path).sha256 != digest.sha256:
                self.problems.append(f"{rel} does not match its record")
        wrong = entry_is_right(self.entry_dir, self.key)
        if wrong is not None:
            self.problems.append(wrong)

    def run(self) -> None:
        while not self.stop.is_set():
            self.check_once()
            time.sleep(0.005)

    def __enter__(self) -> EntryPoller:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join(SAFETY)
        assert not self.is_alive()
        self.check_once()


def _compile_intervals(cache_dir: str) -> dict[str, list[tuple[float, float]]]:
    log = open_store(cache_dir, create=False).log(".events")
    out: dict[str, list[tuple[float, float]]] = {}
    for event in log.read([Compiled]).records:
        assert isinstance(event, Compiled)
        out.setdefault(event.key, []).append((event.at - event.seconds, event.at))
    return out


# ------------------------------------------------------------ real compiles (slow)


@pytest.mark.slow
@pytest.mark.timeout(2 * SAFETY)
def test_eight_processes_compile_one_graph_exactly_once(tmp_path):
    root = tmp_path / "vllm-cache"
    barrier = str(tmp_path / "barrier")
    procs = [
        subprocess.Popen(
            worker_command("torch", {"model": "mlp_a", "barrier_dir": barrier}),
            env=worker_env(VLLM_CACHE_ROOT=str(root), VLLM_NEURON_TOOLCHAIN="host"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(8)
    ]
    release_barrier(barrier, 8, procs)
    results = finish_workers(procs)

    cache_dir = str(root / "neuron" / "compile_cache")
    assert read_stats(cache_dir).compiles == 1
    assert all(r["matches"] for r in results), results
    sources = sorted(s for r in results for s in r["sources"])
    assert sources.count("compiled") == 1, sources
    assert set(sources) <= {"compiled", "local", "local-after-wait"}
    assert len({k for r in results for k in r["keys"]}) == 1  # every rank: the same key
    (key,) = {k for r in results for k in r["keys"]}
    assert open_store(cache_dir).published(key) == key


@pytest.mark.slow
@pytest.mark.timeout(2 * SAFETY)
def test_two_graphs_compile_once_each_and_in_parallel(tmp_path):
    root = tmp_path / "vllm-cache"
    barrier = str(tmp_path / "barrier")
    rendezvous = str(tmp_path / "rendezvous")
    models = ["mlp_a", "mlp_a", "mlp_b", "mlp_b"]
    procs = [
        subprocess.Popen(
            # A compile waits until the other graph's compile is running too: if different
            # keys contended for one lock, the first would wait forever (and fail).
            worker_command("torch", {"model": model, "barrier_dir": barrier,
                                     "rendezvous_dir": rendezvous, "rendezvous": 2}),
            env=worker_env(VLLM_CACHE_ROOT=str(root), VLLM_NEURON_TOOLCHAIN="host"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for model in models
    ]
    release_barrier(barrier, len(procs), procs)
    results = finish_workers(procs)

    assert all(r["matches"] for r in results), results
    keys = {model: {k for r, m in zip(results, models, strict=True) if m == model
                    for k in r["keys"]} for model in set(models)}
    assert len(keys["mlp_a"]) == 1 and len(keys["mlp_b"]) == 1
    assert keys["mlp_a"] != keys["mlp_b"]

    cache_dir = str(root / "neuron" / "compile_cache")
    assert read_stats(cache_dir).compiles == 2
    # Different keys never contend: both compiles were running at once (each waited at the
    # rendezvous for the other to start), so their recorded intervals overlap.
    assert sorted(os.listdir(rendezvous)) == sorted(
        f"{COMPILING}{k}" for k in keys["mlp_a"] | keys["mlp_b"])
    intervals = _compile_intervals(cache_dir)
    (a,) = intervals[next(iter(keys["mlp_a"]))]
    (b,) = intervals[next(iter(keys["mlp_b"]))]
    assert min(a[1], b[1]) > max(a[0], b[0]), (a, b)


# --------------------------------------------------- crashes and failures (fake)


def _spawn_getters(tmp_path: Any, n: int, **args: Any) -> tuple[list[Any], str, str, str]:
    cache_dir = str(tmp_path / "cache")
    markers = str(tmp_path / "markers")
    barrier = str(tmp_path / "barrier")
    base = {"cache_dir": cache_dir, "key": KEY, "marker_dir": markers,
            "barrier_dir": barrier, "hold_dir": str(tmp_path / "hold"),
            "waiting_dir": str(tmp_path / "waiting"), **args}
    procs = [
        subprocess.Popen(worker_command("get", base), env=worker_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    return procs, cache_dir, markers, barrier


def _started(markers: str) -> list[int]:
    if not os.path.isdir(markers):
        return []
    return [int(n.split("-")[1]) for n in sorted(os.listdir(markers))]


def _hold_everyone(tmp_path: Any, procs: list[Any]) -> int:
    """Wait until one compile is held half-way and every worker is queued on the key's lock
    (the holder wrote its marker before it took the lock); returns the held worker's pid."""
    held = os.path.join(str(tmp_path / "hold"), HELD)
    waiting = str(tmp_path / "waiting")
    pid = wait_for(lambda: _read_pid(held), "a compile to be held half-way", procs)
    wait_for(lambda: len(_names(waiting, WAITING)) == len(procs),
              "every worker to queue on the lock", procs)
    return int(pid)


def _read_pid(path: str) -> int:
    """The pid in `path`, 0 while it does not exist (it appears whole: see _hold_once)."""
    try:
        with open(path) as f:
            return int(f.read())
    except FileNotFoundError:
        return 0


def _names(directory: str, prefix: str) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(prefix)] if (
        os.path.isdir(directory)) else []


@pytest.mark.parametrize("lock", ["kernel", "lease"])
def test_sigkill_of_the_compiling_process_heals_itself(tmp_path, lock):
    # The survivors' lock timeout is long: each of them succeeding proves the lock healed
    # (the kernel lock dropped at once, the lease expired) without anyone waiting it out.
    procs, cache_dir, markers, barrier = _spawn_getters(
        tmp_path, 4, delay=2.0, lock=lock, lease_duration=5.0, timeout=SAFETY)
    entry = os.path.join(cache_dir, KEY)
    with EntryPoller(entry, KEY) as poller:
        release_barrier(barrier, 4, procs)
        # Mid-compile: two of its four files are being written, the others queue.
        victim = _hold_everyone(tmp_path, procs)
        assert _started(markers) == [victim]
        os.kill(victim, signal.SIGKILL)
        survivors = [p for p in procs if p.pid != victim]
        results = finish_workers(survivors)
        dead = next(p for p in procs if p.pid == victim)
        dead.wait(SAFETY)
        assert dead.returncode == -signal.SIGKILL

    assert poller.problems == []
    assert poller.observations > 0
    assert all(r["ok"] and r["wrong"] is None for r in results), results
    assert sorted(r["source"] for r in results) == ["compiled", "local-after-wait",
                                                     "local-after-wait"]
    assert len(_started(markers)) == 2  # the killed compile, and one taking over
    assert read_stats(cache_dir).compiles == 1
    # The dead process's half-built staging is never published (and is collected later).
    assert open_store(cache_dir).published(KEY) == KEY


def test_a_failing_compile_reaches_every_waiter_promptly(tmp_path):
    # "Promptly": the waiters learn of the failure when the lock drops, so each raises
    # CompileError; one that had to wait out its timeout would raise TimeoutError instead.
    procs, cache_dir, markers, barrier = _spawn_getters(
        tmp_path, 4, delay=1.0, fail="the compiler said no", timeout=SAFETY)
    entry = os.path.join(cache_dir, KEY)
    with EntryPoller(entry, KEY) as poller:
        release_barrier(barrier, 4, procs)
        # Every waiter is queued before the compile fails: each started waiting first.
        _hold_everyone(tmp_path, procs)
        open(os.path.join(str(tmp_path / "hold"), RESUME), "w").close()
        results = finish_workers(procs)
    assert poller.observations == 0 and poller.problems == []
    assert len(_started(markers)) == 1  # the waiters did not retry the failing compile
    errors = sorted((r["error_type"], "the compiler said no" in r["error"]) for r in results)
    assert errors == [("CompileError", True)] * 3 + [("ValueError", True)], json.dumps(results)
    assert not os.path.exists(entry)
    assert read_stats(cache_dir).compile_failures == 1
