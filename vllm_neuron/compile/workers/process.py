"""A compile worker's process: ``python -m vllm_neuron.compile.workers.process --serve PID
[NAMESPACE...]`` (started by `compile_workers.WorkerPool`, which is the other end of it);
or, with ``--probe PID``, only a worker's CPU probe, run ahead of a cold start (head_start.py).

It pays its start-up once - torch, the op libraries its graphs call, Inductor's CPU probe -
then compiles one job after another, each named on its standard input and answered with a
status line (`compile_workers.GRAPH_FAILED`, `NO_ROOM`, 0) on what was its standard output;
what the compiler prints goes into the job's own ``output.txt``. It exits when its input
closes (its process retired it, or died) or, mid-compile, when its parent is gone.

No orphans: the pool starts each worker as the leader of a process group of its own (a new
session: a Ctrl-C at the server's terminal reaches neither it nor its compilers), and the
worker asks Linux for `PARENT_DEATH_SIGNAL` when its parent dies, even by SIGKILL
(``PR_SET_PDEATHSIG``); on it, or on SIGTERM, it kills its whole group - itself and every
compiler it started - at once (`_die_with_group`). Linux sends that signal also when the
parent's *thread* that started the worker ends (the cache's threads do): the worker then
finds its parent alive and carries on, the signal still armed for the parent's next thread.
Where there is no ``prctl``, a thread polls for the parent every `PARENT_POLL` seconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import msgspec

from vllm_neuron.backends import Store, fault_point, open_store
from vllm_neuron.backends.records import encode
from vllm_neuron.backends.writable import unwritable_cause

from ..toolchains.base import ToolchainError
from .pool import ARTIFACT, ERROR, GRAPH_FAILED, NO_ROOM, OUTPUT

__all__ = ["main", "probe", "serve"]

PARENT_POLL = 0.5  # seconds between a worker's looks at whether its parent is alive
PARENT_DEATH_SIGNAL = signal.SIGUSR1
"""What Linux sends a worker when its parent dies (``PR_SET_PDEATHSIG``): one of its own, so a
SIGTERM from anyone else is told apart."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LOST_PARENT = 70  # a worker's exit status when its parent is gone


def _die_with_group(status: int) -> NoReturn:
    """Kill this worker's process group - itself and every compiler it started, which would
    otherwise run to the end of their compile with nobody to publish it - and exit. Only a
    group of its own (the pool's workers lead one): never its parent's."""
    with contextlib.suppress(OSError):
        if os.getpgrp() == os.getpid():
            os.killpg(0, signal.SIGKILL)
    os._exit(status)


def _arm_parent_death_signal() -> bool:
    """Ask Linux for `PARENT_DEATH_SIGNAL` when the parent dies; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _exit_with_parent(parent: int) -> None:
    """Exit when the process that started this worker is gone, even mid-compile, with every
    compiler it started: nobody would publish what they compile, and a killed server must
    not leave compilers behind (see the module). SIGTERM ends the group as well."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL)
        _die_with_group(LOST_PARENT)

    def on_parent_death(signum: int, frame: Any) -> None:
        if os.getppid() != parent:  # else a thread of the parent ended: still armed
            _die_with_group(LOST_PARENT)

    signal.signal(signal.SIGTERM, lambda signum, frame: _die_with_group(128 + signum))
    signal.signal(PARENT_DEATH_SIGNAL, on_parent_death)
    armed = _arm_parent_death_signal()
    if os.getppid() != parent:  # gone before the signal was asked for
        _die_with_group(LOST_PARENT)
    if not armed:
        threading.Thread(target=watch, daemon=True, name="vllm-neuron-parent-watch").start()


def _compile_one(job_dir: str, out_dir: str) -> int:
    """One job: its status (`GRAPH_FAILED`, `NO_ROOM` or 0, its artifact record in
    ``ARTIFACT``); anything else raises (the worker is lost to its parent)."""
    from ..toolchains.host_jobs import compile_job

    fault_point("worker.started")
    try:
        artifact = compile_job(job_dir, out_dir)
    except Exception as exc:
        # A refused permission is the place's only in the tier (out_dir's directory, as the
        # in-place compile judges it), never in the compiler's own work directories.
        fault = unwritable_cause(exc, os.path.dirname(out_dir.rstrip("/")))
        _job_store(job_dir).write(ERROR, msgspec.json.encode(
            {"errno": fault.errno, "strerror": fault.strerror, "filename": fault.filename})
            if fault is not None else str(exc).encode())  # fmt: skip
        if fault is not None:
            return NO_ROOM
        if isinstance(exc, ToolchainError):
            return GRAPH_FAILED
        raise
    _job_store(job_dir).write(ARTIFACT, encode(artifact))  # whole, or not at all
    return 0


def _job_store(job_dir: str) -> Store:
    """The job's directory as a store (the storage layer is the only door to bytes): a
    node-local scratch place, nothing to fsync."""
    return open_store(job_dir, create=False, profile="local")


@contextlib.contextmanager
def _output_to(path: str) -> Iterator[None]:
    """The worker's standard output and error into `path` for the block (the compiler's
    messages belong to the job they are about), back to the start-up log after."""
    _flush()  # what was printed before the job stays in the start-up log
    saved = os.dup(2)
    try:
        with open(path, "ab") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
        yield
    finally:
        try:
            _flush()
        finally:
            os.dup2(saved, 1)
            os.dup2(saved, 2)
            os.close(saved)


def _flush() -> None:
    with contextlib.suppress(OSError, ValueError):  # a full disk: what was said is lost
        sys.stdout.flush()
        sys.stderr.flush()


def _probe_cpu() -> None:
    """Inductor's CPU probe, paid before the first job: only the vector ISA its kernels
    will use is tested (`vector_isa`), not every one the CPU claims."""
    from ..toolchains.vector_isa import pick_vector_isa

    pick_vector_isa()


def serve(parent: int, preload: Sequence[str]) -> int:
    """``python -m vllm_neuron.compile.workers.process --serve PARENT_PID [NAMESPACE...]``:
    load the op libraries of the namespaces, compile the jobs named on standard input
    (``JOB_DIR NUL OUT_DIR`` lines), answer each with its status line on what was standard
    output; exit when the input closes or the parent is gone."""
    _exit_with_parent(parent)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever torch or the compiler prints must not corrupt the answers
    # The node's cores: vLLM pins a CPU rank to its own, and the worker inherits them (not
    # Linux, or a cpuset that forbids it: it keeps its parent's).
    with contextlib.suppress(AttributeError, OSError, ValueError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    from vllm_neuron.envs import fault_settings

    from ..toolchains import host_jobs  # noqa: F401 - torch's import, paid before the first job
    from ..toolchains.host_collectives import register_collective_ops
    from ..toolchains.op_libraries import MissingOpLibrary, load_namespaces

    fault_settings()  # VLLM_NEURON_FAULT, inherited from the serving process (crash tests)
    register_collective_ops()  # what a graph with collectives calls
    with contextlib.suppress(MissingOpLibrary):  # a job that needs it says so itself
        load_namespaces(preload, "a compile worker")  # paid before the first job comes
    try:
        _probe_cpu()
    except Exception:  # the first job pays it again (and says what failed); said here once
        print("vllm_neuron: Inductor's CPU probe failed in a compile worker:", file=sys.stderr)
        traceback.print_exc()
    for line in sys.stdin:
        job_dir, _, out_dir = line.rstrip("\n").partition("\0")
        with _output_to(os.path.join(job_dir, OUTPUT)):
            try:
                status = _compile_one(job_dir, out_dir)
            except BaseException:  # the worker's own trouble: said in the job's output
                traceback.print_exc()
                raise
        answers.write(f"{status}\n")
    return 0


def probe(parent: int) -> int:
    """``python -m vllm_neuron.compile.workers.process --probe PARENT_PID``: what a cold
    start's first worker compile would pay once per Inductor cache directory, paid ahead
    (head_start.py): Inductor's CPU probe, then a tiny graph compiled with the host toolchain
    as far as the precompiled headers of AOTInductor's wrapper and kernels and the wrapper's
    runtime part. They stay in Inductor's cache directory (the headers and the runtime part
    under the temporary directory's ``torchinductor_<user>``) for the workers to find. At a
    lower priority (nice 10), on the node's cores: it takes mostly what vLLM's own start-up
    leaves idle, yet is not starved on a busy host while it holds the Inductor file locks a
    worker may wait on (measured: nice 0 made the engine's start no faster)."""
    _exit_with_parent(parent)
    with contextlib.suppress(AttributeError, OSError, ValueError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    with contextlib.suppress(OSError):
        os.nice(10)
    _probe_cpu()
    from vllm_neuron.envs import cold_start_without

    if cold_start_without("prepare-runtime"):  # the A/B benchmark's other side
        return 0
    from ..toolchains.host_jobs import prepare_host_compiles
    from .job_dirs import owned_job_dir

    # Its throwaway output in a job directory: swept like any job's if this process is killed.
    job_dir, owner = owned_job_dir()
    try:
        prepare_host_compiles(job_dir)
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
        owner.close()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("--serve", "--probe") or not argv[1].isdigit():
        print("usage: python -m vllm_neuron.compile.workers.process --serve PARENT_PID "
              "[NAMESPACE...] | --probe PARENT_PID", file=sys.stderr)
        return 2
    if argv[0] == "--probe":
        return probe(int(argv[1]))
    return serve(int(argv[1]), argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
