"""Compile workers: a process's own compiles run in child processes, while it traces on.

vLLM's piecewise backend hands over every piece of a model before it calls any. A process
that compiled each piece in place would compile them one after another; instead the piece is
exported here (the tracer's part, `CompileJob.prepare`), and its compile - the toolchain's
long part - runs in a worker process, from a background thread of the cache
(`TwoTierCache.begin`) inside one of the node's compile slots. Processes, not threads:
Inductor's compiles are not thread-safe.

Workers persist (`WorkerPool`): ``python -m vllm_neuron.compile.workers.process --serve PID``
imports torch and the kernel libraries once, then compiles one job after another, each
named on its standard input and answered with a status line. A worker is started when a
job is being prepared and none is idle, so its imports overlap the export; an idle worker
exits when idle for `WorkerPool.idle_seconds` (a server keeps no compiler in memory once its
graphs are done). A process whose share of the node's slots is one has none: it compiles
in place (`CompileRuntime.compiles_in_background`).
On a host where a graph compiles in seconds, a fresh interpreter per graph cost as much as
the compile; on Trainium (minutes per graph) it is noise either way.

What can go wrong, and what it costs:

* the graph does not compile (status `GRAPH_FAILED`, the compiler's message in
  ``error.txt``): a `ToolchainError`, a failure like an in-place compile's (failure note,
  every waiter raises it);
* a write fails for want of room or permission (status `NO_ROOM`): the `OSError` itself, which
  the cache's disk handling serves from scratch;
* the worker cannot run (an import that fails, a signal, an exit without a status):
  `CompileWorkerLost`, which is not the graph's fault - no failure note - and the graph is
  compiled in place at its first call instead;
* the serving process dies: the worker's standard input closes, or - mid-compile - Linux's
  parent-death signal (elsewhere its watchdog) tells it, and it kills its process group (a
  new session of its own: itself and every compiler it started) and exits, leaving a
  staging directory that `cache gc` collects like any killed compile's. A worker this
  process stops is killed by group too (`_Worker.kill`).

Only the host toolchain (AOTInductor: the exported program travels as a file) has workers.
The Neuron toolchain needs none: its compiler, ``neuronx-cc``, is a process of its own. Its
graph is lowered to HLO in the tracing thread (`Toolchain.lower`, a `job_dirs.LoweredJob`), and the
cache's thread runs the compiler on it within a slot, the same way.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

import msgspec

from ..entry.outcomes import CompileWorkerLost
from ..toolchains.base import ARTIFACTS, CompiledArtifact, Toolchain, ToolchainError
from ..toolchains.op_libraries import loaded_vllm_kernel_library
from .job_dirs import PreparedJob, lowered_job, owned_job_dir, sweep_dead_jobs, warn_once

__all__ = ["ARTIFACT", "ERROR", "GRAPH_FAILED", "NO_ROOM", "OUTPUT", "POOL", "CompileJob",
           "WorkerPool", "prepare_job", "start_worker_early"]

logger = logging.getLogger("vllm_neuron.compile")

GRAPH_FAILED = 3
"""The worker's exit status when the compiler rejected the graph (its message in ERROR)."""
NO_ROOM = 4
"""The worker's exit status when a write failed for want of room or permission (a full or
read-only disk: the place's fault, not the graph's); the error's record in ERROR."""
ARTIFACT = "artifact.json"
ERROR = "error.txt"
OUTPUT = "output.txt"  # what the worker printed during the job
RETIRE_WAIT = 30.0  # seconds an idle worker is given to exit before it is killed
EARLY_WORKERS = 2  # at most this many workers started ahead of a cold start's first graph
EARLY_IDLE_SECONDS = 120.0  # how long those wait for their first job before they retire


class CompileJob(PreparedJob):
    """One exported graph waiting for a worker."""

    def __init__(self, job_dir: str, pool: WorkerPool, owner: IO[bytes] | None = None) -> None:
        super().__init__(job_dir, owner)
        self.pool = pool

    def compile(self, out_dir: str) -> CompiledArtifact:
        """Have a worker compile the job, writing the artifact's files into `out_dir`."""
        status = self.pool.run(self.job_dir, out_dir)
        if status == GRAPH_FAILED:
            raise ToolchainError(_read(os.path.join(self.job_dir, ERROR))
                                 or _tail(os.path.join(self.job_dir, OUTPUT)))  # fmt: skip
        if status == NO_ROOM:  # the cache's disk handling sees the OSError itself
            raise _disk_fault(_read(os.path.join(self.job_dir, ERROR)))
        artifact = os.path.join(self.job_dir, ARTIFACT)
        if status != 0 or not os.path.exists(artifact):
            raise CompileWorkerLost(f"the compile worker answered {status} without a result: "
                                    f"{_tail(os.path.join(self.job_dir, OUTPUT))}")
        with open(artifact, "rb") as f:
            return ARTIFACTS.decode(f.read(), source=artifact)


class _Worker:
    """One worker process: jobs go in on its standard input, a status line comes back on its
    standard output; what it prints goes to its start-up log, then to each job's own."""

    def __init__(self, preload: Sequence[str]) -> None:
        # Nameless: nothing is left in the temporary directory by a server that is killed.
        self.log = tempfile.TemporaryFile(prefix="vllm_neuron_compile_worker_")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vllm_neuron.compile.workers.process", "--serve",
             str(os.getpid()), *preload],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            start_new_session=True)  # a group of its own: see process.py
        self.idle_since = 0.0

    def run(self, job_dir: str, out_dir: str) -> int:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(f"{job_dir}\0{out_dir}\n")
            self.process.stdin.flush()
            answer = self.process.stdout.readline()
        except (OSError, ValueError):  # its end of the pipe is gone: it died
            answer = ""
        if answer.strip().lstrip("-").isdigit():
            return int(answer)
        try:  # it closed its answers: it is exiting, or it is in a state to be stopped
            code = self.process.wait(timeout=RETIRE_WAIT)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.process.wait()
        self.log.seek(0)
        said = self.log.read()[-2000:].decode(errors="replace").strip()
        job_said = _tail(os.path.join(job_dir, OUTPUT))
        self.close()
        raise CompileWorkerLost(f"the compile worker exited with status {code} without a "
                                f"result: {job_said or said or '(no output)'}")  # fmt: skip

    def close(self, wait: float = 0.0) -> int | None:
        """Its standard input closed: the worker exits (at once when idle); waited for up
        to `wait` seconds (then killed), so no exited worker lingers as a zombie. Its exit
        status when waited for."""
        with contextlib.suppress(OSError, ValueError):
            assert self.process.stdin is not None
            self.process.stdin.close()
        self.log.close()
        if not wait:
            return None
        try:
            return self.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.wait()

    def kill(self) -> None:
        """SIGKILL the worker's process group: the worker and every compiler it started
        (the group is the worker's own until it is reaped, so its id names no other)."""
        with contextlib.suppress(OSError):
            os.killpg(self.process.pid, signal.SIGKILL)


class WorkerPool:
    """This process's compile workers. How many compile at once is the node's slots' say
    (a job reaches `run` only inside a slot); the pool keeps idle ones warm, starts no more
    than that many ahead of need, and retires one idle for `idle_seconds`."""

    def __init__(self, idle_seconds: float = 30.0) -> None:
        self.idle_seconds = idle_seconds
        self._idle: list[_Worker] = []
        self._live = 0  # idle or compiling
        self._lock = threading.Lock()
        self.started: list[int] = []  # the process ids of the workers it started
        self.lost: list[int] = []  # ... of those that died or could not answer
        self.retired: list[int] = []  # ... of those retired when idle
        # The op namespaces a new worker loads before its first job: those of the jobs so
        # far, and vLLM's kernels when this process has them (its graphs call them).
        self.namespaces: set[str] = set()

    def reserve(self, at_most: int) -> bool:
        """Start a worker now if none is idle and fewer than `at_most` live (the node's
        slots), so its imports run while a job is prepared; True when one was started."""
        return self._start_one(lambda: not self._idle and self._live < at_most,
                               self.idle_seconds)  # fmt: skip

    def start_ahead(self, count: int, first_idle: float | None = None) -> int:
        """Start workers until `count` are live (a cold start's head start: head_start.py),
        each retiring if no job came within `first_idle` seconds (default: `idle_seconds`);
        how many were started."""
        seconds = self.idle_seconds if first_idle is None else first_idle
        started = 0
        while self._start_one(lambda: self._live < count, seconds):
            started += 1
        return started

    def run(self, job_dir: str, out_dir: str) -> int:
        """The job's status from an idle worker, or a new one; `CompileWorkerLost` when the
        worker dies or cannot start."""
        with self._lock:
            worker = self._idle.pop() if self._idle else self._started()
        try:
            status = worker.run(job_dir, out_dir)
        except CompileWorkerLost:
            with self._lock:
                self._live -= 1  # it died: not given back
                self.lost.append(worker.process.pid)
            raise
        with self._lock:
            stamp = self._idle_now(worker)
        self._retire_after(worker, stamp, self.idle_seconds)
        return status

    def retire_idle(self) -> list[int | None]:
        """Retire every idle worker now; their exit statuses (each waited for)."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._live -= len(idle)
            self.retired.extend(worker.process.pid for worker in idle)
        return [worker.close(wait=RETIRE_WAIT) for worker in idle]

    def _started(self) -> _Worker:
        """A new worker (the caller holds the lock)."""
        try:
            worker = _Worker(sorted(self.namespaces))
        except OSError as exc:  # no room for its log, no process left
            raise CompileWorkerLost(f"cannot start a compile worker: {exc}") from exc
        self._live += 1
        self.started.append(worker.process.pid)
        return worker

    def _start_one(self, wanted: Callable[[], bool], idle_seconds: float) -> bool:
        """Start a worker if `wanted()` (asked under the lock), idle in the same hold as it
        is counted live - a job's `run` in between would find none idle and start one more
        than the node's slots - and retiring after `idle_seconds` without a job."""
        with self._lock:
            if not wanted():
                return False
            worker = self._started()
            stamp = self._idle_now(worker)
        self._retire_after(worker, stamp, idle_seconds)
        return True

    def _idle_now(self, worker: _Worker) -> float:
        """Put `worker` among the idle ones (the caller holds the lock); its idle stamp."""
        stamp = worker.idle_since = time.monotonic()
        self._idle.append(worker)
        return stamp

    def _retire_after(self, worker: _Worker, stamp: float, seconds: float) -> None:
        """Retire `worker` if it is still idle since `stamp` in `seconds`."""

        def retire() -> None:
            with self._lock:
                if worker not in self._idle or worker.idle_since != stamp:
                    return  # working again, or already retired
                self._idle.remove(worker)
                self._live -= 1
                self.retired.append(worker.process.pid)
            worker.close(wait=RETIRE_WAIT)

        timer = threading.Timer(seconds, retire)
        timer.daemon = True
        timer.start()


POOL = WorkerPool()
"""The process's workers (one pool: the slots, not the pool, bound the node's compiles)."""


def prepare_job(toolchain: Toolchain, gm: Any, example_inputs: Sequence[Any], *,
                workers: int, pool: WorkerPool = POOL) -> PreparedJob | None:  # fmt: skip
    """Prepare `gm` for a compile off the tracing thread, in the calling (tracing) thread:
    exported for a worker (host toolchain), or lowered for its own compiler process
    (`Toolchain.lower`: Neuron). None when the toolchain does neither or the job cannot be
    written (said once; the graph compiles in place). `workers`: how many compiles this
    process runs at once (its share of the node's slots)."""
    from ..toolchains.host import HostToolchain  # lazy: imports torch only when compiling

    if not isinstance(toolchain, HostToolchain):
        return lowered_job(toolchain, gm, example_inputs)
    from ..toolchains.host_jobs import export_job

    job_dir = None
    _load_vllm_kernels_in_workers(pool)
    try:
        with contextlib.suppress(CompileWorkerLost):  # no start now: `run` tries again
            pool.reserve(workers)  # its imports overlap the export
        sweep_dead_jobs()
        job_dir, owner = owned_job_dir()
        pool.namespaces.update(export_job(toolchain, gm, example_inputs, job_dir).namespaces)
    except (OSError, RuntimeError, CompileWorkerLost) as exc:  # RuntimeError: torch's writer
        # No room for the job, or a graph export refuses: the in-place compile says the
        # graph's own problem in its own words, with the cache's failure handling.
        if job_dir is not None:
            shutil.rmtree(job_dir, ignore_errors=True)
            owner.close()
        warn_once(f"vllm_neuron: a compile worker cannot take this graph ({exc}); it is "
                   "compiled in the tracing process")
        return None
    return CompileJob(job_dir, pool, owner)


def start_worker_early(toolchain: Toolchain, *, workers: int, pool: WorkerPool = POOL) -> bool:
    """Start up to `EARLY_WORKERS` of this process's share (`workers`) of the node's compile
    workers before any graph is traced (head_start.py says when): their start-up - torch,
    vLLM's kernels, Inductor's CPU probe - then runs while the engine loads its model, not
    after its first graph is exported. They wait for their first job up to
    `EARLY_IDLE_SECONDS` (a model's loading can take minutes). Only the host toolchain has
    workers. True when any was started; a worker that cannot start is said by the first job
    that needs one."""
    from ..toolchains.host import HostToolchain  # lazy: imports torch only when compiling

    if not isinstance(toolchain, HostToolchain) or workers < 1:
        return False
    _load_vllm_kernels_in_workers(pool)
    try:  # more start as jobs come: how many graphs the model has is not known yet
        return pool.start_ahead(min(workers, EARLY_WORKERS), first_idle=EARLY_IDLE_SECONDS) > 0
    except CompileWorkerLost:
        return False


def _load_vllm_kernels_in_workers(pool: WorkerPool) -> None:
    """A graph traced inside vLLM calls its kernels: new workers load them before a job."""
    if loaded_vllm_kernel_library() is not None:
        pool.namespaces.add("_C")


def _disk_fault(recorded: str) -> OSError:
    """The worker's disk fault (its ERROR record) as the OSError it was, path included: the
    cache judges a refused permission by where it happened."""
    try:
        fault = msgspec.json.decode(recorded, type=dict[str, Any])
        return OSError(int(fault["errno"]), str(fault["strerror"]), fault.get("filename"))
    except (msgspec.DecodeError, KeyError, TypeError, ValueError):
        return OSError(errno.ENOSPC, recorded or "a compile worker's write failed")


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _tail(path: str, size: int = 2000) -> str:
    return _read(path)[-size:].strip()
