"""A process's own compiles run in compile workers while it traces on (compile_workers.py).

Real processes, real TorchInductor: each hands several graphs to the runtime under a piece
name, as vLLM's piecewise backend does, before calling any. Asserted from the events: each
was handed to a worker (`deferred`, reason ``worker``) before the first compile was done,
and the compiles ran at once; workers persist (a third job takes a worker already started)
and exit with their process, or when idle; a worker that dies (SIGKILL at a fault point) is
no failure of the graph: it is compiled in the process at its first call, and no failure
note is left.
"""

from __future__ import annotations

import os
import posixpath
import subprocess
import time
from typing import Any

import pytest
from cache_workers import SAFETY, finish_workers, worker_command, worker_env

from vllm_neuron.backends import RecordCodec, open_store
from vllm_neuron.compile.events import (
    CACHE_EVENTS,
    EVENTS_STREAM,
    Compiled,
    CompileFailed,
    Deferred,
)
from vllm_neuron.compile.failures import FAILURES_DIR

_EVENTS = RecordCodec(CACHE_EVENTS)


def _run(tmp_path: Any, widths: list[int], **env: str) -> tuple[dict[str, Any], list[Any], Any]:
    root = tmp_path / "root"
    proc = subprocess.Popen(
        worker_command("pieces", {"widths": widths}),
        env=worker_env(VLLM_CACHE_ROOT=str(root), VLLM_NEURON_TOOLCHAIN="host", **env),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (result,) = finish_workers([proc], timeout=SAFETY)
    tier = open_store(str(root / "neuron" / "compile_cache"), create=False)
    events = []
    for segment, data in tier.log(EVENTS_STREAM).segment_data():
        if posixpath.basename(segment).removesuffix(".jsonl") == result["writer"]:
            events.extend(_EVENTS.decode_lines(data).records)
    return result, events, tier


@pytest.mark.timeout(2 * SAFETY)
def test_a_process_compiles_its_own_pieces_in_workers_at_once(tmp_path):
    result, events, _ = _run(tmp_path, [16, 24, 32], VLLM_NEURON_COMPILE_WORKERS="2")

    assert result["matches"] == [True, True, True], result
    assert result["sources"] == ["compiled", "compiled", "compiled"]
    handed = {e.key: e.at for e in events if isinstance(e, Deferred) and e.reason == "worker"}
    compiled = {e.key: (e.at - e.seconds, e.at) for e in events if isinstance(e, Compiled)}
    assert set(handed) == set(compiled) == set(result["keys"]), events
    first, second, _ = result["keys"]
    assert handed[second] < compiled[first][1]  # traced on while the first one compiled
    (a0, a1), (b0, b1) = compiled[first], compiled[second]
    assert a0 < b1 and b0 < a1, compiled  # the two compiles ran at once
    # Two slots, three jobs: the third took a worker the others had used (its imports
    # paid), not a new interpreter; and once the process exited, its workers did too.
    assert len(result["worker_pids"]) == 2, result
    _wait_until_gone(result["worker_pids"], "a compile worker outlived its process")


@pytest.mark.timeout(2 * SAFETY)
def test_a_worker_that_dies_is_not_the_graphs_failure(tmp_path):
    result, events, tier = _run(tmp_path, [16], VLLM_NEURON_FAULT="worker.started")

    assert result["matches"] == [True], result
    assert result["sources"] == ["compiled"]  # in the process, at the first call
    assert "the compile worker exited with status -9" in result["stderr"]
    assert not [e for e in events if isinstance(e, CompileFailed)]
    assert not tier.list(FAILURES_DIR)  # nobody is told the graph failed
    assert sum(isinstance(e, Compiled) for e in events) == 1


def _gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie counts: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True


def _wait_until_gone(pids: list[int], what: str) -> None:
    deadline = time.monotonic() + SAFETY
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, f"{what}: {[p for p in pids if not _gone(p)]}"
        time.sleep(0.05)


def test_one_worker_waits_ahead_of_need_and_retires_when_idle():
    from vllm_neuron.compile.compile_workers import WorkerPool

    pool = WorkerPool(idle_seconds=3600.0)
    pool.reserve(at_most=0)  # the node has no slot to give it: none started
    assert pool.started == []
    for at_most in (1, 1, 2):
        pool.reserve(at_most=at_most)  # started ahead of a job; one idle is enough
    assert len(pool.started) == 1
    pool.retire_idle()
    assert _gone(pool.started[0])

    quick = WorkerPool(idle_seconds=0.0)
    quick.reserve(at_most=1)  # a job that never came: the worker must not stay
    _wait_until_gone(quick.started, "an idle worker did not retire")


def test_job_directories_of_dead_processes_are_swept(tmp_path, monkeypatch):
    from vllm_neuron.compile import compile_workers

    gone = subprocess.Popen(["true"])
    gone.wait()  # a process of this host that has exited
    monkeypatch.setattr(compile_workers.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(compile_workers, "_swept", False)
    dead = tmp_path / f"{compile_workers.JOB_PREFIX}{gone.pid}_abc"
    live = tmp_path / f"{compile_workers.JOB_PREFIX}{os.getpid()}_def"
    other = tmp_path / "unrelated_123_x"
    for directory in (dead, live, other):
        (directory / "program.pt2").parent.mkdir()
        (directory / "program.pt2").write_bytes(b"x")
    compile_workers._sweep_dead_jobs()
    assert not dead.exists() and live.exists() and other.exists()
