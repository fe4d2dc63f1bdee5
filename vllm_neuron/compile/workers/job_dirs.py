"""Where a graph prepared for a compile off the tracing thread waits: its job directory.

A job directory is private to the process that prepared it (``vllm_neuron_compile_job_<pid>_*``,
made ``0700`` in the temporary directory, or in this user's own when another user could
replace a directory there: toolchains/private_dirs.py `private_temp_root`), holds an owner
file that process keeps locked, and is removed when the job is done (`PreparedJob.discard`).
A process that dies leaves it behind; the next process of the host that prepares a job
removes every directory of this user's whose owner's lock is gone (`sweep_dead_jobs`).

Two kinds of job live in one: an exported graph for a compile worker (`pool.py`,
the host toolchain), and a graph lowered by a toolchain whose compiler is a process of its
own (`LoweredJob`: Neuron's HLO for ``neuronx-cc``), which needs no worker: the cache's
thread runs the compiler on it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Sequence
from typing import IO, Any

from ..entry.outcomes import CompileWorkerLost
from ..toolchains.base import CompiledArtifact, CompilerKilled, LoweredGraph, Toolchain
from ..toolchains.private_dirs import private_temp_root

__all__ = ["JOB_PREFIX", "LoweredJob", "PreparedJob", "job_space_floor", "lowered_job",
           "owned_job_dir", "sweep_dead_jobs", "warn_once"]

logger = logging.getLogger("vllm_neuron.compile")


class PreparedJob:
    """A graph prepared for a compile off the tracing thread: its job directory (a private
    temporary directory, removed by `discard`, swept if its process dies)."""

    def __init__(self, job_dir: str, owner: IO[bytes] | None = None) -> None:
        self.job_dir = job_dir
        self._owner = owner  # its lock says the job is alive (`sweep_dead_jobs`)

    def compile(self, out_dir: str) -> CompiledArtifact:
        """Compile the graph, writing the artifact's files into `out_dir`."""
        raise NotImplementedError

    def discard(self) -> None:
        shutil.rmtree(self.job_dir, ignore_errors=True)
        if self._owner is not None:
            self._owner.close()


class LoweredJob(PreparedJob):
    """A graph its toolchain lowered in the tracing thread (`Toolchain.lower`), whose
    compiler the cache's thread runs: the job directory holds what the lowering wrote."""

    def __init__(self, job_dir: str, owner: IO[bytes]) -> None:
        super().__init__(job_dir, owner)
        self.lowered: LoweredGraph | None = None

    def compile(self, out_dir: str) -> CompiledArtifact:
        assert self.lowered is not None
        try:
            return self.lowered.compile(out_dir)
        except CompilerKilled as exc:  # not the graph's failure: compiled in place instead
            raise CompileWorkerLost(str(exc)) from exc


def lowered_job(toolchain: Toolchain, gm: Any,
                 example_inputs: Sequence[Any]) -> PreparedJob | None:  # fmt: skip
    """A toolchain whose compiler is a process of its own (``neuronx-cc``) needs no worker:
    the graph is lowered here (`Toolchain.lower`) and its compiler run from a thread of the
    cache. None when the toolchain does not lower, or this graph does not (said once; the
    in-place compile says why in its own words, with the cache's failure handling)."""
    if type(toolchain).lower is Toolchain.lower:
        return None  # it compiles only in one piece
    sweep_dead_jobs()
    try:
        job_dir, owner = owned_job_dir()
    except OSError as exc:
        warn_once(f"vllm_neuron: no room to lower this graph for a background compile "
                   f"({exc}); it is compiled in the tracing process")  # fmt: skip
        return None
    job = LoweredJob(job_dir, owner)
    try:
        job.lowered = toolchain.lower(gm, example_inputs, job_dir)
    except Exception as exc:  # noqa: BLE001 - compiled in place, which reports it
        job.discard()
        warn_once(f"vllm_neuron: this graph could not be lowered for a background compile "
                   f"({exc}); it is compiled in the tracing process")  # fmt: skip
        return None
    if job.lowered is None:
        job.discard()
        return None
    return job


GIB = 1 << 30
JOB_SPACE_FLOOR_BYTES = GIB
JOB_SPACE_FLOOR_FRACTION = 0.1


def job_space_floor(total: int) -> int:
    """The free space (bytes) a file system of `total` bytes keeps when a job is written:
    a tenth of it, at most 1 GiB."""
    return min(JOB_SPACE_FLOOR_BYTES, int(total * JOB_SPACE_FLOOR_FRACTION))


JOB_PREFIX = "vllm_neuron_compile_job_"
OWNER = ".owner"  # locked (flock) by the process that prepared the job, while it lives
ORPHAN_AGE = 3600.0  # seconds after which a job directory without its owner file is debris
_swept = False


def owned_job_dir(*, keep_free: bool = True) -> tuple[str, IO[bytes]]:
    """A new job directory and its owner file, locked for as long as this process keeps it
    open: the kernel drops the lock when the process dies, which is how `sweep_dead_jobs`
    tells a dead job from a live one (in any process, container or PID namespace that
    shares the temporary directory).

    Refused (an OSError, ENOSPC) when the temporary directory's free space is below
    `job_space_floor`: every deferred graph's job waits there until a slot comes (a Neuron
    job holds the graph's weights), so a model's worth of them could fill the file system the
    whole node uses. The graph is then compiled in place, one at a time, as without deferral.
    Not with `keep_free=False`: a directory held for a moment only (a package unpacked to
    be loaded, then removed), where the alternative would leave its bytes for good.
    """
    root = private_temp_root()  # the temporary directory, unless another user can change it
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        usage = None  # nothing to judge by: the write says it if there is no room
    if keep_free and usage is not None and usage.free < job_space_floor(usage.total):
        raise OSError(errno.ENOSPC, f"{usage.free / GIB:.1f} GiB free, below the "
                      f"{job_space_floor(usage.total) / GIB:.1f} GiB that compile jobs leave "
                      "free", root)  # fmt: skip
    job_dir = tempfile.mkdtemp(prefix=f"{JOB_PREFIX}{os.getpid()}_", dir=root)  # 0700
    try:
        owner = open(os.path.join(job_dir, OWNER), "wb")  # noqa: SIM115 - held by the job
        fcntl.flock(owner, fcntl.LOCK_EX)
    except OSError:
        shutil.rmtree(job_dir, ignore_errors=True)
        raise
    return job_dir, owner


def sweep_dead_jobs() -> None:
    """Remove the job directories that processes which are gone (a server that was killed)
    left in the temporary directory; once per process, when its first job is prepared or
    its cache's upkeep pass runs. Never raises, and never blocks: the temporary directory
    is shared with every user of the node, so an entry that is not this user's own
    directory is passed over unopened (`_abandoned`)."""
    global _swept
    if _swept:
        return
    _swept = True
    with contextlib.suppress(OSError):  # no usable temporary directory: nothing to sweep
        root = private_temp_root()
        with os.scandir(root) as entries:
            names = [entry.name for entry in entries if entry.name.startswith(JOB_PREFIX)]
        for name in names:
            path = os.path.join(root, name)
            if _abandoned(path):
                shutil.rmtree(path, ignore_errors=True)


_OPEN_OWNER = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _abandoned(job_dir: str) -> bool:
    """Whether `job_dir` is a job directory of this user's whose process is gone. Only a
    directory this user owns (not followed if a link) is looked into, and only a regular
    owner file of this user's is locked: opened without following a link and without
    blocking (a FIFO planted there would hold an open, and with it the upkeep's lock, for
    good), its lock tried without waiting."""
    uid = os.getuid()
    try:
        st = os.lstat(job_dir)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        return False  # another user's, or not a directory: never ours to open or remove
    try:
        fd = os.open(os.path.join(job_dir, OWNER), _OPEN_OWNER)
    except FileNotFoundError:  # its process died before it locked it
        return time.time() - st.st_mtime > ORPHAN_AGE
    except OSError:  # a link, or not to be opened: not a job of ours
        return False
    try:
        owner = os.fstat(fd)
        if not stat.S_ISREG(owner.st_mode) or owner.st_uid != uid:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its process lives
            return False
        return True
    finally:
        os.close(fd)


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Log `message` once per process: a condition met by every graph is said once, not once
    per graph."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning("%s", message)
