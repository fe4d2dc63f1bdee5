"""Compile workers: a process's own compiles run in child processes, while it traces on.

vLLM's piecewise backend hands over every piece of a model before it calls any. A process
that compiled each piece in place would compile them one after another; instead the piece is
exported here (the tracer's part, `CompileJob.prepare`), and its compile - the toolchain's
long part - runs in a worker process (``python -m vllm_neuron.compile.compile_workers JOB
OUT``), started by a background thread of the cache (`TwoTierCache.begin`) inside one of the
node's compile slots. Processes, not threads: Inductor's and ``neuronx-cc``'s compiles are not
thread-safe.

What can go wrong, and what it costs:

* the graph does not compile (the worker exits `GRAPH_FAILED`, the compiler's message in
  ``error.txt``): a `ToolchainError`, a failure like an in-place compile's (failure note,
  every waiter raises it);
* the worker cannot run (no room for the job, an import that fails, a signal, an exit
  without a result): `CompileWorkerLost`, which is not the graph's fault - no failure note -
  and the graph is compiled in place at its first call instead;
* the serving process dies: the worker notices its parent is gone and exits (a watchdog
  thread), leaving a staging directory that `cache gc` collects like any killed compile's.

Only the host toolchain (AOTInductor: the exported program travels as a file) has workers;
the Neuron toolchain compiles in place (its HLO could travel the same way; not done).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from vllm_neuron.backends import fault_point
from vllm_neuron.backends.records import encode
from vllm_neuron.backends.writable import unwritable_cause

from .outcomes import CompileWorkerLost
from .toolchains.base import ARTIFACTS, CompiledArtifact, Toolchain, ToolchainError

__all__ = ["GRAPH_FAILED", "CompileJob", "prepare_job"]

logger = logging.getLogger("vllm_neuron.compile")

GRAPH_FAILED = 3
"""The worker's exit status when the compiler rejected the graph (its message in ERROR)."""
NO_ROOM = 4
"""The worker's exit status when a write failed for want of room or permission (a full or
read-only disk: the place's fault, not the graph's); the errno and message in ERROR."""
ARTIFACT = "artifact.json"
ERROR = "error.txt"
PARENT_POLL = 0.5  # seconds between a worker's looks at whether its parent is alive


class CompileJob:
    """One exported graph waiting for a worker: its job directory (a private temporary
    directory, removed by `discard`)."""

    def __init__(self, job_dir: str) -> None:
        self.job_dir = job_dir

    def compile(self, out_dir: str) -> CompiledArtifact:
        """Run a worker on the job, writing the artifact's files into `out_dir`."""
        command = [sys.executable, "-m", "vllm_neuron.compile.compile_workers",
                   self.job_dir, out_dir]  # fmt: skip
        try:
            done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, errors="replace",
                                  check=False)  # fmt: skip
        except OSError as exc:
            raise CompileWorkerLost(f"cannot start a compile worker: {exc}") from exc
        if done.returncode == GRAPH_FAILED:
            raise ToolchainError(_read(os.path.join(self.job_dir, ERROR)) or done.stderr[-2000:])
        if done.returncode == NO_ROOM:  # the cache's disk handling sees the OSError itself
            code, _, message = _read(os.path.join(self.job_dir, ERROR)).partition(" ")
            raise OSError(int(code) if code.isdigit() else errno.ENOSPC, message)
        artifact = os.path.join(self.job_dir, ARTIFACT)
        if done.returncode != 0 or not os.path.exists(artifact):
            raise CompileWorkerLost(
                f"the compile worker exited with status {done.returncode} without a result: "
                f"{done.stderr.strip()[-2000:] or '(no output)'}")
        with open(artifact, "rb") as f:
            return ARTIFACTS.decode(f.read(), source=artifact)

    def discard(self) -> None:
        shutil.rmtree(self.job_dir, ignore_errors=True)


def prepare_job(toolchain: Toolchain, gm: Any, example_inputs: Sequence[Any]
                ) -> CompileJob | None:  # fmt: skip
    """Export `gm` for a worker, in the calling (tracing) thread; None when `toolchain` has
    no workers or the job cannot be written (said once; the graph compiles in place)."""
    from .toolchains.host import HostToolchain  # lazy: imports torch only when compiling

    if not isinstance(toolchain, HostToolchain):
        return None
    from .toolchains.host_jobs import export_job

    job_dir = None
    try:
        job_dir = tempfile.mkdtemp(prefix="vllm_neuron_compile_job_")
        export_job(toolchain, gm, example_inputs, job_dir)
    except (OSError, RuntimeError) as exc:  # RuntimeError: torch's writer (ToolchainError too)
        # No room for the job, or a graph export refuses: the in-place compile says the
        # graph's own problem in its own words, with the cache's failure handling.
        if job_dir is not None:
            shutil.rmtree(job_dir, ignore_errors=True)
        _warn_once(f"vllm_neuron: a compile worker cannot take this graph ({exc}); it is "
                   "compiled in the tracing process")
        return None
    return CompileJob(job_dir)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning("%s", message)


# ------------------------------------------------------------------------------- the worker


def _exit_with_parent() -> None:
    """Exit when the process that started this worker is gone: nobody would publish what
    it compiles, and a killed server must not leave compilers behind."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL)
        os._exit(70)

    threading.Thread(target=watch, daemon=True, name="vllm-neuron-parent-watch").start()


def main(argv: list[str]) -> int:
    """``python -m vllm_neuron.compile.compile_workers JOB_DIR OUT_DIR``."""
    job_dir, out_dir = argv
    _exit_with_parent()
    # The node's cores: vLLM pins a CPU rank to its own, and the worker inherits them (not
    # Linux, or a cpuset that forbids it: it keeps its parent's).
    with contextlib.suppress(AttributeError, OSError, ValueError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    from vllm_neuron.envs import fault_settings

    from .toolchains.host_collectives import register_collective_ops
    from .toolchains.host_jobs import compile_job

    fault_settings()  # VLLM_NEURON_FAULT, inherited from the serving process (crash tests)
    fault_point("worker.started")
    register_collective_ops()  # what a graph with collectives calls
    try:
        artifact = compile_job(job_dir, out_dir)
    except Exception as exc:
        fault = unwritable_cause(exc)
        with open(os.path.join(job_dir, ERROR), "w") as f:
            f.write(f"{fault.errno} {fault}" if fault is not None else str(exc))
        if fault is not None:
            return NO_ROOM
        if isinstance(exc, ToolchainError):
            return GRAPH_FAILED
        raise  # anything else is the worker's trouble: CompileWorkerLost in the parent
    temporary = os.path.join(job_dir, ARTIFACT + ".tmp")
    with open(temporary, "wb") as f:
        f.write(encode(artifact))
    os.replace(temporary, os.path.join(job_dir, ARTIFACT))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
