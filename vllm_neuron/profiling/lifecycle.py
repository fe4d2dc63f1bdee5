"""A profiling server's lifecycle: launch in its own process group, readiness, teardown.

A profiling server holds devices; one that is not torn down makes the next launch fail.
So the server is started in **its own process group** (whose id is its pid), every process
it forks stays in that group, and teardown signals the recorded group id: SIGTERM, a grace
period, then SIGKILL. The group is not the terminal's foreground group, so a Ctrl-C reaches
only the capture, which tears the server down itself.

The server stays in the capture's **session**, deliberately. Linux schedules each session
as one group (``kernel.sched_autogroup_enabled``, on by default in most distributions): a
server in a session of its own gets as much CPU as everything else in the capture's session
put together. On a busy host, with other load in that session, the engine then kept
stepping while the capture's log follower and workload threads waited seconds for a CPU:
the batch's requests reached the server one at a time, and the stats ticks were read after
the batch they described had finished, so profiling windows missed their phase. In one
session the server and the capture share the CPU on equal terms.

Teardown refuses to signal the launching process's own group (or the init/kernel groups):
a bare background launch shares its group with whatever started it, which is what makes a
group kill hit the wrong processes. Never tear a server down by name (``pkill -f``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from .files import file_store

# A new process group (pgid == pid) in the launcher's session; see the module docstring.
_OWN_PROCESS_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
)


class UnsafeSignal(RuntimeError):
    """Teardown was asked to signal a process group it must never touch."""


class ServerExited(RuntimeError):
    """The server process died before it became ready."""

    def __init__(self, returncode: int, log_tail: str) -> None:
        self.returncode = returncode
        self.log_tail = log_tail
        super().__init__(f"server exited with code {returncode} before it was ready")


class ReadyTimeout(TimeoutError):
    """The server did not answer readiness polls in time."""


def check_signalable_group(pgid: int) -> None:
    """Raise `UnsafeSignal` unless signalling group `pgid` cannot reach this process."""
    if pgid <= 1:
        raise UnsafeSignal(f"refusing to signal process group {pgid}")
    own = os.getpgrp()
    if pgid == own:
        raise UnsafeSignal(
            f"refusing to signal process group {pgid}: it is the launching process's own group"
        )
    with contextlib.suppress(OSError):
        if pgid == os.getpgid(os.getppid()):
            raise UnsafeSignal(
                f"refusing to signal process group {pgid}: it is the launching session's group"
            )


def group_members(pgid: int, *, include_zombies: bool = False) -> list[int]:
    """Pids of the processes whose process group is `pgid` (zombies only when asked).

    psutil lists the processes (portably, where /proc parsing was Linux's alone);
    `os.getpgid` names each one's group, since psutil has no accessor for it. A process
    that exits while the list is read is simply not a member.
    """
    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) != pgid:
                continue
        except OSError:  # gone meanwhile (ProcessLookupError), or not ours to ask
            continue
        if include_zombies or proc.info["status"] != psutil.STATUS_ZOMBIE:
            members.append(proc.pid)
    return sorted(members)


SERVER_MARKER = "_VLLM_NEURON_SERVER"
"""Set in a launched server's environment to a token of its own; every process it starts
inherits it (compile workers, their compilers), also one that leads a group or session of its
own (compile/workers/process.py), which the group's signals and `group_members` miss.
Outside vLLM's ``VLLM_*`` namespace (vLLM validates those); read only from other processes'
environment (`marked_processes`), never from this process's."""


def marked_processes(token: str) -> list[int]:
    """Pids of the live processes whose environment has ``SERVER_MARKER=token`` (one of
    this user's: another's environment cannot be read, and is no server of ours)."""
    found = []
    for proc in psutil.process_iter(["status"]):
        if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if proc.environ().get(SERVER_MARKER) == token:
                found.append(proc.pid)
        except (psutil.Error, OSError):  # gone meanwhile, or not ours to read
            continue
    return sorted(found)


@dataclass
class TeardownRecord:
    """What teardown did; recorded separately from the capture's own result."""

    pgid: int | None
    signals: list[str] = field(default_factory=list)
    exit_code: int | None = None
    seconds: float = 0.0
    survivors: list[int] = field(default_factory=list)
    error: str | None = None
    strays: list[int] = field(default_factory=list)
    """Processes the server started outside its group (`SERVER_MARKER`), found once the
    group was gone, and SIGKILLed (with their own groups)."""

    @property
    def clean(self) -> bool:
        return self.error is None and not self.survivors


class ServerProcess:
    """A server launched in its own process group, with its output in a log file.

    The log is named by path (what the caller hands the server, e.g. through a store's
    `local_output` door) and is written and read through the store of its directory: the
    server's stdout is an append descriptor of that store, its tail is read back from it.
    """

    def __init__(self, proc: subprocess.Popen[bytes], pgid: int, log_path: str,
                 token: str = "") -> None:
        self.token = token  # its `SERVER_MARKER`: "" when not marked (nothing looked for)
        self.proc = proc
        self.pgid = pgid
        self.log_path = log_path
        self._log = file_store(log_path)
        self.teardown_record: TeardownRecord | None = None

    @classmethod
    def launch(
        cls,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | None,
        log_path: str,
    ) -> ServerProcess:
        store, key = file_store(log_path, create=True)
        # An O_APPEND descriptor, as a file opened in "ab" mode has: the server and every
        # process it forks append their output; ours is closed once the child has its copy.
        out = store.open_appender(key, truncate=False)
        try:
            if out.fileno() < 0:
                raise ValueError(f"server log {log_path}: its store cannot append in place")
            token = uuid.uuid4().hex
            proc = subprocess.Popen(
                list(argv),
                env={**env, SERVER_MARKER: token},
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out.fileno(),
                stderr=subprocess.STDOUT,
                **_OWN_PROCESS_GROUP,
            )
        finally:
            out.close()
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:  # already gone and reaped
            pgid = proc.pid
        if pgid == os.getpgrp():  # pragma: no cover - a new process group guarantees otherwise
            raise UnsafeSignal(f"server {proc.pid} shares the launcher's process group")
        return cls(proc, pgid, log_path, token)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def returncode(self) -> int | None:
        return self.proc.poll()

    def log_tail(self, max_bytes: int = 4000) -> str:
        store, key = self._log
        try:
            with store.open_read(key) as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - max_bytes))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def wait_ready(
        self, url: str, *, timeout: float, interval: float = 0.5, request_timeout: float = 5.0
    ) -> float:
        """Poll `url` (e.g. ``.../v1/models``) until it answers 200; returns seconds waited.

        Raises `ServerExited` as soon as the process dies, `ReadyTimeout` after `timeout`.
        """
        start = time.monotonic()
        deadline = start + timeout
        while True:
            code = self.returncode()
            if code is not None:
                raise ServerExited(code, self.log_tail())
            try:
                with urllib.request.urlopen(url, timeout=request_timeout) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() >= deadline:
                raise ReadyTimeout(f"server did not answer {url} within {timeout:g} s")
            time.sleep(interval)

    def teardown(self, *, grace: float = 30.0, kill_wait: float = 10.0) -> TeardownRecord:
        """SIGTERM the group, wait up to `grace`, SIGKILL what is left.

        Idempotent once it has completed; a teardown cut short by an exception is not
        remembered, so calling it again finishes the job.
        """
        if self.teardown_record is not None:
            return self.teardown_record
        record = TeardownRecord(pgid=self.pgid)
        start = time.monotonic()
        try:
            check_signalable_group(self.pgid)
            if self._signal(signal.SIGTERM, record):
                self._wait_group_gone(grace)
            if self._group_alive():
                self._signal(signal.SIGKILL, record)
                self._wait_group_gone(kill_wait)
        except UnsafeSignal as exc:
            record.error = str(exc)
        # Reap the leader so it is not left as a zombie in our process table.
        with contextlib.suppress(subprocess.TimeoutExpired):
            record.exit_code = self.proc.wait(timeout=1.0)
        if record.error is None:  # never after a refused signal: the record is not trusted
            record.strays = self._kill_strays(kill_wait)
        record.survivors = sorted(set(group_members(self.pgid)) | set(self._marked()))
        record.seconds = round(time.monotonic() - start, 3)
        self.teardown_record = record
        return record

    def _marked(self) -> list[int]:
        return marked_processes(self.token) if self.token else []

    def _kill_strays(self, timeout: float) -> list[int]:
        """SIGKILL what the server started outside its group (with each one's own group,
        when it leads one: a compile worker's compilers are in it), and wait for it to go."""
        strays = self._marked()
        for pid in strays:
            with contextlib.suppress(OSError):
                pgid = os.getpgid(pid)
                try:
                    check_signalable_group(pgid)
                    own_group = pgid == pid
                except UnsafeSignal:
                    own_group = False
                if own_group:
                    os.killpg(pgid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while strays and self._marked() and time.monotonic() < deadline:
            time.sleep(0.05)
        return strays

    def _signal(self, sig: signal.Signals, record: TeardownRecord) -> bool:
        if not self._group_alive():
            return False
        check_signalable_group(self.pgid)
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            return False
        record.signals.append(sig.name)
        return True

    def _group_alive(self) -> bool:
        self.proc.poll()  # reap the leader if it exited, so it stops counting
        return bool(group_members(self.pgid))

    def _wait_group_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._group_alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True
