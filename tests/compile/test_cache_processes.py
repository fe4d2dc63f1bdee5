"""Many processes, one node: one compile per graph, crashes that heal, failures that
reach the waiters at once, and no partial entry ever visible.

The first two tests compile real graphs with TorchInductor through
``torch.compile(backend="vllm_neuron")`` (each process with a fresh Inductor cache, so
only our cache can save a compile); the others drive `TwoTierCache.get_or_compile` in real
processes with a slow fake compile (cache_workers.fake_compile) so a SIGKILL lands mid-way.
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
from cache_workers import entry_is_right, parse_result, release_barrier, worker_command

from vllm_neuron.backends import open_store
from vllm_neuron.compile.entry import ENTRY_RECORD, decode_record, sha256_file
from vllm_neuron.compile.events import Compiled, read_stats

KEY = "5ca1ab1e5ca1ab1e5ca1ab1e5ca1ab1e"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("NEURON_LIBTORCH_REMOTE_CACHE", "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE",
                 "VLLM_NEURON_DISABLE_WARMUP_COMPILE", "TORCHINDUCTOR_FORCE_DISABLE_CACHES"):
        env.pop(name, None)
    env.update(extra)
    return env


def _finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[dict[str, Any]]:
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"worker exited {p.returncode}:\n{out}\n{err}"
        results.append(parse_result(out))
    return results


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
            if os.path.getsize(path) != digest.size or sha256_file(path) != digest.sha256:
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
        self.join(5)
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
@pytest.mark.timeout(600)
def test_eight_processes_compile_one_graph_exactly_once(tmp_path):
    root = tmp_path / "vllm-cache"
    barrier = str(tmp_path / "barrier")
    procs = [
        subprocess.Popen(
            worker_command("torch", {"model": "mlp_a", "barrier_dir": barrier}),
            env=_env(VLLM_CACHE_ROOT=str(root), VLLM_NEURON_TOOLCHAIN="host",
                     TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{i}")),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(8)
    ]
    release_barrier(barrier, 8, procs, timeout=240)
    results = _finish(procs, timeout=500)

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
@pytest.mark.timeout(600)
def test_two_graphs_compile_once_each_and_in_parallel(tmp_path):
    root = tmp_path / "vllm-cache"
    barrier = str(tmp_path / "barrier")
    models = ["mlp_a", "mlp_a", "mlp_b", "mlp_b"]
    procs = [
        subprocess.Popen(
            worker_command("torch", {"model": model, "barrier_dir": barrier}),
            env=_env(VLLM_CACHE_ROOT=str(root), VLLM_NEURON_TOOLCHAIN="host",
                     TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{i}")),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i, model in enumerate(models)
    ]
    release_barrier(barrier, len(procs), procs, timeout=240)
    results = _finish(procs, timeout=500)

    assert all(r["matches"] for r in results), results
    keys = {model: {k for r, m in zip(results, models, strict=True) if m == model
                    for k in r["keys"]} for model in set(models)}
    assert len(keys["mlp_a"]) == 1 and len(keys["mlp_b"]) == 1
    assert keys["mlp_a"] != keys["mlp_b"]

    cache_dir = str(root / "neuron" / "compile_cache")
    intervals = _compile_intervals(cache_dir)
    assert read_stats(cache_dir).compiles == 2
    (a,) = intervals[next(iter(keys["mlp_a"]))]
    (b,) = intervals[next(iter(keys["mlp_b"]))]
    overlap = min(a[1], b[1]) - max(a[0], b[0])
    # Different keys never contend: the two compiles ran at the same time.
    assert overlap > 0.5 * min(a[1] - a[0], b[1] - b[0]), (a, b)


# --------------------------------------------------- crashes and failures (fake)


def _spawn_getters(tmp_path: Any, n: int, **args: Any) -> tuple[list[Any], str, str, str]:
    cache_dir = str(tmp_path / "cache")
    markers = str(tmp_path / "markers")
    barrier = str(tmp_path / "barrier")
    base = {"cache_dir": cache_dir, "key": KEY, "marker_dir": markers,
            "barrier_dir": barrier, **args}
    procs = [
        subprocess.Popen(worker_command("get", base), env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    return procs, cache_dir, markers, barrier


def _started(markers: str) -> list[int]:
    if not os.path.isdir(markers):
        return []
    return [int(n.split("-")[1]) for n in sorted(os.listdir(markers))]


def _wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("lock", ["kernel", "lease"])
def test_sigkill_of_the_compiling_process_heals_itself(tmp_path, lock):
    lease = 1.5
    procs, cache_dir, markers, barrier = _spawn_getters(
        tmp_path, 4, delay=4.0, lock=lock, lease_duration=lease, timeout=60)
    entry = os.path.join(cache_dir, KEY)
    with EntryPoller(entry, KEY) as poller:
        release_barrier(barrier, 4, procs, timeout=60)
        (victim,) = _wait_for(lambda: _started(markers), 30, "the first compile")
        time.sleep(1.0)  # mid-compile: two of its four files are being written
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        survivors = [p for p in procs if p.pid != victim]
        results = _finish(survivors, timeout=60)
        healed_in = time.monotonic() - killed_at
        dead = next(p for p in procs if p.pid == victim)
        dead.wait(10)
        assert dead.returncode == -signal.SIGKILL

    assert poller.problems == []
    assert poller.observations > 0
    assert all(r["ok"] and r["wrong"] is None for r in results), results
    assert sorted(r["source"] for r in results) == ["compiled", "local-after-wait",
                                                     "local-after-wait"]
    assert len(_started(markers)) == 2  # the killed compile, and one taking over
    assert read_stats(cache_dir).compiles == 1
    # No manual step, no waiting for the compile timeout: a kernel lock is dropped at
    # once, a lease after its duration; then one 4 s compile.
    assert healed_in < 4.0 + (lease if lock == "lease" else 0) + 6.0, healed_in
    # The dead process's half-built staging is never published (and is collected later).
    assert open_store(cache_dir).published(KEY) == KEY


def test_a_failing_compile_reaches_every_waiter_promptly(tmp_path):
    procs, cache_dir, markers, barrier = _spawn_getters(
        tmp_path, 4, delay=3.0, fail="the compiler said no", timeout=120)
    entry = os.path.join(cache_dir, KEY)
    with EntryPoller(entry, KEY) as poller:
        go = release_barrier(barrier, 4, procs, timeout=60)
        results = _finish(procs, timeout=60)
    assert poller.observations == 0 and poller.problems == []
    assert len(_started(markers)) == 1  # the waiters did not retry the failing compile
    errors = sorted((r["error_type"], "the compiler said no" in r["error"]) for r in results)
    assert errors == [("CompileError", True)] * 3 + [("ValueError", True)]
    # Well under the 120 s timeout: the waiters learn of the failure when the lock drops.
    assert max(r["finished"] for r in results) - go < 10, json.dumps(results)
    assert not os.path.exists(entry)
    assert read_stats(cache_dir).compile_failures == 1
