"""A process's own compiles run in compile workers while it traces on (compile_workers.py).

Real processes, real TorchInductor: each hands several graphs to the runtime under a piece
name, as vLLM's piecewise backend does, before calling any. Asserted from the events: each
was handed to a worker (`deferred`, reason ``worker``) before the first compile was done,
and the compiles ran at once; workers persist (a third job takes a worker already started)
and exit with their process, or when idle; a worker that dies (SIGKILL at a fault point) is
no failure of the graph: it is compiled in the process at its first call, and no failure
note is left. A process whose share of the node's slots is one compiles in place instead.
"""

from __future__ import annotations

import errno
import os
import posixpath
import shutil
import subprocess
import sys
import time
from typing import Any

import pytest
from cache_workers import (
    SAFETY,
    finish_workers,
    gone,
    wait_until_gone,
    worker_command,
    worker_env,
)

from vllm_neuron.backends import RecordCodec, open_store
from vllm_neuron.compile.entry.events import (
    CACHE_EVENTS,
    EVENTS_STREAM,
    Compiled,
    CompileFailed,
    Deferred,
)
from vllm_neuron.compile.entry.failure_notes import FAILURES_DIR

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
    assert len(result["worker_pids"]) == 2, (result["worker_pids"], result["workers_lost"],
                                             result["workers_retired"])
    wait_until_gone(result["worker_pids"], "a compile worker outlived its process")


@pytest.mark.timeout(2 * SAFETY)
def test_a_process_with_one_slot_compiles_its_pieces_in_place(tmp_path):
    # Its share of the node's slots is one (here the whole node's; a TP=2 rank's on a
    # 2-core node): a worker would compile one piece at a time too, after an interpreter's
    # start-up, so each piece is compiled in the tracing process, one after another.
    result, events, _ = _run(tmp_path, [16, 24, 32], VLLM_NEURON_COMPILE_WORKERS="1")

    assert result["matches"] == [True, True, True], result
    assert result["sources"] == ["compiled", "compiled", "compiled"]
    assert result["worker_pids"] == [], result  # no interpreter started
    assert not [e for e in events if isinstance(e, Deferred)], events  # nothing to wait for
    compiled = sorted((e.at - e.seconds, e.at) for e in events if isinstance(e, Compiled))
    assert len(compiled) == 3, events
    ends, starts = [end for _, end in compiled[:-1]], [start for start, _ in compiled[1:]]
    assert all(end <= start for end, start in zip(ends, starts, strict=True)), compiled


@pytest.mark.timeout(2 * SAFETY)
def test_a_worker_that_dies_is_not_the_graphs_failure(tmp_path):
    result, events, tier = _run(tmp_path, [16], VLLM_NEURON_FAULT="worker.started",
                                VLLM_NEURON_COMPILE_WORKERS="2")

    assert result["matches"] == [True], result
    assert result["sources"] == ["compiled"]  # in the process, at the first call
    assert "the compile worker exited with status -9" in result["stderr"]
    assert not [e for e in events if isinstance(e, CompileFailed)]
    assert not tier.list(FAILURES_DIR)  # nobody is told the graph failed
    assert sum(isinstance(e, Compiled) for e in events) == 1


def test_one_worker_waits_ahead_of_need_and_retires_when_idle(monkeypatch):
    from vllm_neuron.compile.workers import pool as compile_workers
    from vllm_neuron.compile.workers.pool import WorkerPool

    # However slow its start-up on a loaded machine, it is waited for, never killed: an exit
    # status of 0 says it saw its input close and left by itself.
    monkeypatch.setattr(compile_workers, "RETIRE_WAIT", float(SAFETY))
    pool = WorkerPool(idle_seconds=3600.0)
    pool.reserve(at_most=0)  # the node has no slot to give it: none started
    assert pool.started == []
    for at_most in (1, 1, 2):
        pool.reserve(at_most=at_most)  # started ahead of a job; one idle is enough
    assert len(pool.started) == 1
    assert pool.retire_idle() == [0]  # its input closed: it exited by itself, not killed
    assert gone(pool.started[0])

    quick = WorkerPool(idle_seconds=0.0)
    quick.reserve(at_most=1)  # a job that never came: the worker must not stay
    wait_until_gone(quick.started, "an idle worker did not retire")


def test_a_node_with_an_empty_local_tier_starts_a_worker_before_any_graph(tmp_path, compile_fn,
                                                                         monkeypatch):
    from vllm_neuron.compile.flow.cache import TwoTierCache
    from vllm_neuron.compile.runtime import CompileRuntime
    from vllm_neuron.compile.toolchains.host import HostToolchain
    from vllm_neuron.compile.workers import pool as compile_workers
    from vllm_neuron.compile.workers.pool import WorkerPool

    monkeypatch.setattr(compile_workers, "RETIRE_WAIT", float(SAFETY))

    def started(cache: TwoTierCache) -> int:
        pool = WorkerPool(idle_seconds=3600.0)
        runtime = CompileRuntime(cache, HostToolchain())
        assert runtime.start_compile_worker_if_cold(pool) == bool(pool.started)
        assert runtime.start_compile_worker_if_cold(pool) is False  # one idle is enough
        assert pool.retire_idle() == [0] * len(pool.started)
        return len(pool.started)

    local = str(tmp_path / "local")
    assert started(TwoTierCache(local, compile_workers=2)) == 2  # a new node: its share ...
    assert started(TwoTierCache(local, compile_workers=8)) == 2  # ... up to two ahead
    # A share of one slot: its pieces are compiled in place (runtime.compiles_in_background).
    assert started(TwoTierCache(local, compile_workers=1)) == 0
    # Nothing to gain: waiting in place, or no graph compiled here.
    assert started(TwoTierCache(local, compile_workers=2, defer_compiles=False)) == 0
    assert started(TwoTierCache(local, compile_workers=2, precompiled_only=True)) == 0
    assert started(TwoTierCache(local, disabled=True)) == 0
    # A node with an entry is likely warm: its start must not pay for an idle worker.
    warm = TwoTierCache(local, compile_workers=2)
    warm.get_or_compile("ab" * 16, compile_fn("ab" * 16))
    assert started(warm) == 0


def test_job_directories_of_dead_processes_are_swept(tmp_path, monkeypatch):
    from vllm_neuron.compile.workers import job_dirs

    monkeypatch.setattr(job_dirs.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(job_dirs, "_swept", False)
    live, owner = job_dirs.owned_job_dir()  # this process's, its owner file locked
    # An exited process's: its owner file is there, its lock went with it.
    killed = subprocess.run(
        [sys.executable, "-c", "import sys, tempfile; tempfile.tempdir = sys.argv[1]; "
         "from vllm_neuron.compile.workers.job_dirs import owned_job_dir; "
         "print(owned_job_dir()[0])", str(tmp_path)],
        check=True, capture_output=True, text=True).stdout.strip()
    assert os.path.isdir(killed)
    recent = tmp_path / f"{job_dirs.JOB_PREFIX}1_recent"  # no owner file yet: young
    old = tmp_path / f"{job_dirs.JOB_PREFIX}2_old"  # no owner file, an hour old
    other = tmp_path / "unrelated_dir"
    for directory in (recent, old, other):
        directory.mkdir()
    os.utime(old, (time.time() - 2 * job_dirs.ORPHAN_AGE,) * 2)
    job_dirs.sweep_dead_jobs()
    try:
        assert not os.path.exists(killed) and not old.exists()
        assert os.path.isdir(live) and recent.exists() and other.exists()
    finally:
        owner.close()


def test_a_warm_start_that_prepares_no_job_sweeps_them_too(tmp_path, monkeypatch, compile_fn):
    from vllm_neuron.compile.flow.cache import TwoTierCache
    from vllm_neuron.compile.workers import job_dirs

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(job_dirs.tempfile, "tempdir", str(temp))
    killed = subprocess.run(
        [sys.executable, "-c", "import sys, tempfile; tempfile.tempdir = sys.argv[1]; "
         "from vllm_neuron.compile.workers.job_dirs import owned_job_dir; "
         "print(owned_job_dir()[0])", str(temp)],
        check=True, capture_output=True, text=True).stdout.strip()
    key = "ab" * 16
    monkeypatch.setattr(job_dirs, "_swept", True)  # the process that compiled, long ago
    first = TwoTierCache(str(tmp_path / "local"))
    first.get_or_compile(key, compile_fn(key))
    assert first.wait_for_upkeep(timeout=SAFETY) and os.path.isdir(killed)
    monkeypatch.setattr(job_dirs, "_swept", False)  # a new process: only hits from here
    cache = TwoTierCache(str(tmp_path / "local"))
    assert cache.get_or_compile(key, lambda out: pytest.fail("compiled")).source == "local"
    assert cache.wait_for_upkeep(timeout=SAFETY)  # its background pass, at the first use
    assert not os.path.exists(killed)


def test_a_temporary_directory_near_full_takes_no_more_jobs(tmpfs, monkeypatch, caplog):
    """Every deferred graph's job waits in the temporary directory until a slot comes; below
    a tenth of the file system free, no job is written there and the graph is compiled in
    place - the node's temporary space is never filled by deferral."""
    import logging

    import torch

    from vllm_neuron.compile.toolchains.host import HostToolchain
    from vllm_neuron.compile.workers import job_dirs
    from vllm_neuron.compile.workers.pool import WorkerPool, prepare_job

    monkeypatch.setattr(job_dirs.tempfile, "tempdir", str(tmpfs))
    total = os.statvfs(tmpfs).f_blocks * os.statvfs(tmpfs).f_frsize
    ballast = tmpfs / "ballast"
    with open(ballast, "wb") as f:  # leaves 5% free: above ENOSPC, below the floor
        f.write(b"\0" * int(total * 0.95 - (total - shutil.disk_usage(tmpfs).free)))
    with pytest.raises(OSError, match="below the .* GiB that compile jobs leave free") as raised:
        job_dirs.owned_job_dir()
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmpfs)
    model = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    pool = WorkerPool(idle_seconds=3600.0)
    monkeypatch.setattr(job_dirs, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="vllm_neuron.compile"):
        assert prepare_job(HostToolchain(), model, [torch.randn(2, 4)], workers=0,
                           pool=pool) is None  # fmt: skip
    assert "compile jobs leave free" in caplog.text and "compiled in the tracing" in caplog.text
    assert [p.name for p in tmpfs.iterdir()] == ["ballast"]  # nothing written
    ballast.unlink()  # room again: jobs are written
    job = prepare_job(HostToolchain(), model, [torch.randn(2, 4)], workers=0, pool=pool)
    assert job is not None and os.path.isdir(job.job_dir)
    job.discard()


@pytest.mark.parametrize(("error", "status", "errno_"), [
    (OSError(28, "No space left on device", "{tmp}/elsewhere/x"), 4, 28),  # anywhere
    (OSError(13, "Permission denied", "{tmp}/staging/out/graph.pt2"), 4, 13),  # in the tier
    (OSError(13, "Permission denied", "/compiler/work/x.o"), 3, None),  # the compiler's own
])  # fmt: skip
def test_a_workers_disk_fault_comes_back_as_the_oserror_it_was(tmp_path, monkeypatch, error,
                                                                status, errno_):
    from vllm_neuron.compile.toolchains import host_jobs
    from vllm_neuron.compile.toolchains.base import ToolchainError
    from vllm_neuron.compile.workers import pool as compile_workers
    from vllm_neuron.compile.workers import process as worker_process

    error.filename = error.filename.format(tmp=tmp_path)

    def failing_compile(job_dir, out_dir):  # as AOTInductor's failure reaches the worker
        raise ToolchainError("AOTInductor failed to compile the graph") from error

    monkeypatch.setattr(host_jobs, "compile_job", failing_compile)
    job_dir, out_dir = tmp_path / "job", tmp_path / "staging" / "out"
    job_dir.mkdir()
    assert worker_process._compile_one(str(job_dir), str(out_dir)) == status
    recorded = (job_dir / compile_workers.ERROR).read_text()
    if errno_ is None:  # the graph's failure: the compiler's message for the note
        assert "AOTInductor failed" in recorded
        return
    fault = compile_workers._disk_fault(recorded)
    assert (fault.errno, fault.filename) == (errno_, error.filename)
