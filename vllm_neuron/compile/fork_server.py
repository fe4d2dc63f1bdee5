"""Compile workers forked from a process that has imported torch already.

A compile worker started as a new interpreter spends seconds of CPU before its first job:
torch, vLLM's kernel library, Inductor's CPU verdicts. On a cold start those seconds are
paid by every tracing process's workers at the busiest moment of the start (a TP=2 engine:
two ranks tracing, two workers importing, the node's first AOTInductor headers compiling).
vLLM's first process starts one process once it has configured the engine, before the
engine's processes exist (head_start.py); it imports what a worker needs once, while vLLM
starts its engine, and then serves *forks*: a tracing process that wants a worker asks it
over a Linux abstract socket, and gets a process that is a worker at once.

The protocol (one ``SOCK_SEQPACKET`` exchange per worker):

* the tracing process connects to the address named by VLLM_NEURON_COMPILE_FORK_SERVER,
  checks that the server runs as its own user, and sends its environment and the op
  namespaces to preload, with three descriptors: the worker's standard input (jobs), output
  (answers) and error (its start-up log);
* the server checks that the asker runs as its own user, and that the asker's environment
  agrees with its own where torch read it at import (`_import_time_difference`), then forks;
  the child takes the descriptors and the asker's environment and serves jobs exactly as
  ``worker_process --serve`` does, exiting when the asker does (a pidfd of the asker);
* the server answers the child's pid with a pidfd of it, so the asker can wait for it and
  stop it without the races of a pid; or answers why it refused, and the asker starts its
  worker as a new interpreter, as it would without a server.

The server runs no torch operation, ever: a process forked after OpenMP's thread pool exists
hangs at its first parallel operation (measured: a matmul in the parent, then one in the
child). It only imports, as a process that `import torch`-ed and forks DataLoader workers
does.

Linux only (abstract sockets, pidfds); anywhere else, or with anything unexpected, workers
start as new interpreters. The server exits with the process that started it, or when no one
has asked for a while (`FIRST_IDLE_SECONDS`, then `IDLE_SECONDS`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

import msgspec

from vllm_neuron.envs import load_fork_server_address

__all__ = ["ForkedProcess", "available", "exited", "fork_worker", "listen", "new_address",
           "serve_forks"]

logger = logging.getLogger("vllm_neuron.compile")

ASK_TIMEOUT = 15.0  # seconds an asker waits for its fork before it starts a worker itself
FIRST_IDLE_SECONDS = 600.0  # a server never asked this long exits (a model loads meanwhile)
IDLE_SECONDS = 120.0  # ... and one not asked again this long after a request
POLL = 0.5  # seconds between the server's looks at its parent and its children
MAX_MESSAGE = 1 << 20  # an environment is a few kilobytes

# What torch, its libraries and Python read from the environment when they are imported (or
# cache on first use): the fork server has done that already, with its own environment. A
# worker forked for an asker whose values differ would compile with the server's.
# OpenMP's variables are not among them: vLLM pins each CPU rank's OpenMP threads to its
# cores (GOMP_CPU_AFFINITY, OMP_NUM_THREADS), but a worker runs no model, and takes the
# node's cores rather than its rank's (`worker_process._use_all_cores`).
_IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "ONEDNN", "DNNL", "MKL", "LD_", "PYTHON", "TMP",
                         "TEMP", "CC", "CXX", "CUDA", "VLLM_CPU_ISA", "VLLM_TARGET_DEVICE",
                         "VLLM_PLUGINS", "ATEN", "USER", "LOGNAME", "HOME", "XDG_CACHE_HOME")
# ... except what is read at each use, and may differ between processes of one start (vLLM
# points its engine processes' Inductor cache into its own cache directory).
_READ_AT_USE = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"})


class _Request(msgspec.Struct, frozen=True):
    env: dict[str, str]
    preload: list[str]


class _Answer(msgspec.Struct, frozen=True):
    pid: int = 0
    refused: str = ""


def available() -> bool:
    """Whether this platform has what a fork server needs (abstract sockets, pidfds)."""
    return (sys.platform.startswith("linux") and hasattr(os, "pidfd_open")
            and hasattr(socket, "send_fds") and hasattr(signal, "pidfd_send_signal"))  # fmt: skip


def new_address() -> str:
    """A fresh name for a server of this user: unguessable, so no other process holds it."""
    return f"vllm-neuron-fork-{os.getuid()}-{secrets.token_hex(16)}"


def listen(address: str) -> socket.socket:
    """The server's socket, bound and listening (askers that come before the server serves
    wait in its backlog); `OSError` when the name is taken or sockets are refused."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind("\0" + address)
        listener.listen(64)
    except OSError:
        listener.close()
        raise
    return listener


def _peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of `conn`, as the kernel says."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))  # fmt: skip
    return pid, uid


def _import_time_difference(theirs: Mapping[str, str], ours: Mapping[str, str]) -> str | None:
    """The variables read at import whose values differ between the two environments."""
    differ = [name for name in sorted(set(theirs) | set(ours))
              if name.startswith(_IMPORT_TIME_PREFIXES) and name not in _READ_AT_USE
              and _meaning(name, theirs.get(name)) != _meaning(name, ours.get(name))]  # fmt: skip
    return f"{', '.join(differ)} differ from the server's" if differ else None


def _meaning(name: str, value: str | None) -> object:
    """What a variable's value means: a search path's directories, each once (a library
    imported in each process of a chain - OpenCV - prepends its own again), else the text."""
    if value is None or not (name.endswith("PATH") or name == "LD_PRELOAD"):
        return value
    return tuple(dict.fromkeys(entry for entry in value.replace(" ", ":").split(":") if entry))


ServeChild = Callable[[int, Sequence[str], int], int]
"""What a forked child runs: (asker's pid, namespaces to preload, asker's pidfd) -> status."""


def serve_forks(listener: socket.socket, parent: int, serve_child: ServeChild, *,
                first_idle: float = FIRST_IDLE_SECONDS, idle: float = IDLE_SECONDS) -> int:
    """Serve forks on `listener` until `parent` is gone, or no one has asked for
    `first_idle` seconds (before the first request: a model can take minutes to load) or
    `idle` seconds (after one). No thread is started: a fork copies only the thread that
    forks."""
    ours = dict(os.environ)
    since, wait = _now(), first_idle
    while os.getppid() == parent and _now() - since <= wait:
        _reap()
        if not exited(listener.fileno(), POLL):  # readable: an asker waits to be accepted
            continue
        try:
            conn, _ = listener.accept()
        except OSError:
            continue
        with conn:
            _answer(conn, ours, serve_child, listener)
        since, wait = _now(), idle
    return 0


def _answer(conn: socket.socket, ours: Mapping[str, str], serve_child: ServeChild,
            listener: socket.socket) -> None:  # fmt: skip
    """One asker: refused (said why), or a child forked for it (its pid and a pidfd)."""
    fds: list[int] = []
    try:
        asker, uid = _peer(conn)
        if uid != os.getuid():
            return  # not ours to serve: closed without a word
        conn.settimeout(ASK_TIMEOUT)
        message, fds, _flags, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        request = msgspec.json.decode(message, type=_Request)
        refused = ("it sent no descriptors" if len(fds) != 3
                   else _import_time_difference(request.env, ours))  # fmt: skip
        if refused:
            conn.sendall(msgspec.json.encode(_Answer(refused=refused)))
            return
        asker_fd = os.pidfd_open(asker)
        try:
            child = _fork(fds, request, asker, asker_fd, serve_child, (conn, listener))
            child_fd = os.pidfd_open(child)
            try:
                socket.send_fds(conn, [msgspec.json.encode(_Answer(pid=child))], [child_fd])
            finally:
                os.close(child_fd)
        finally:
            os.close(asker_fd)
    except (OSError, msgspec.DecodeError) as exc:  # the asker starts its worker itself
        logger.debug("vllm_neuron: a fork request was not served: %s", exc)
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _fork(fds: Sequence[int], request: _Request, asker: int, asker_fd: int,
          serve_child: ServeChild, sockets: Sequence[socket.socket]) -> int:  # fmt: skip
    """Fork the child that serves `asker` on `fds` (its stdin, stdout, stderr)."""
    child = os.fork()
    if child:
        return child
    status = 70
    try:
        for held in sockets:
            held.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request.env)
        status = serve_child(asker, request.preload, asker_fd)
    except BaseException:  # noqa: BLE001 - a child never returns into the server's loop
        with contextlib.suppress(Exception):
            import traceback

            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)


def exited(pidfd: int, timeout: float | None) -> bool:
    """Whether the process of `pidfd` exits within `timeout` seconds (None: waits). poll,
    not select: a serving process's descriptor numbers pass select's limit of 1024."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else int(timeout * 1000)))


def _reap() -> None:
    """Reap the children that have exited (no zombies; their askers saw them end)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _now() -> float:
    return time.monotonic()


class ForkedProcess:
    """A worker forked by the server, seen from the process it serves: the part of
    `subprocess.Popen` the worker pool uses. It is not this process's child, so its exit
    status is not known here (`wait` returns None once it has exited)."""

    def __init__(self, pid: int, pidfd: int, stdin: IO[str], stdout: IO[str]) -> None:
        self.pid = pid
        self.stdin: IO[str] | None = stdin
        self.stdout: IO[str] | None = stdout
        self._pidfd: int | None = pidfd

    def wait(self, timeout: float | None = None) -> int | None:
        if self._pidfd is not None:
            if not exited(self._pidfd, timeout):
                raise subprocess.TimeoutExpired(f"compile worker {self.pid}", timeout or 0.0)
            self._close_pidfd()
        return None

    def kill(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def _close_pidfd(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self._close_pidfd()


def fork_worker(preload: Sequence[str], stderr: IO[bytes]) -> ForkedProcess | None:
    """A compile worker forked by this start's fork server, serving this process; None when
    there is no server, it refused (said at debug level), or anything went wrong: the
    caller then starts the worker as a new interpreter."""
    address = load_fork_server_address()
    if address is None or not available():
        return None
    theirs_in, ours_in = os.pipe()  # jobs: the worker reads, this process writes
    ours_out, theirs_out = os.pipe()  # answers: the worker writes, this process reads
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(ASK_TIMEOUT)
            conn.connect("\0" + address)
            if _peer(conn)[1] != os.getuid():
                raise PermissionError(f"the fork server at {address} runs as another user")
            request = _Request(env=dict(os.environ), preload=list(preload))
            socket.send_fds(conn, [msgspec.json.encode(request)],
                            [theirs_in, theirs_out, stderr.fileno()])  # fmt: skip
            message, fds, _flags, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
        answer = msgspec.json.decode(message, type=_Answer)
        if answer.refused or len(fds) != 1 or answer.pid <= 0:
            for fd in fds:
                os.close(fd)
            raise OSError(f"refused: {answer.refused or 'no process'}")
    except (OSError, msgspec.DecodeError) as exc:
        _say_once(f"vllm_neuron: compile workers start as new interpreters: the fork server "
                  f"at {address} gave none ({exc})")  # fmt: skip
        for fd in (ours_in, ours_out):
            os.close(fd)
        return None
    finally:
        for fd in (theirs_in, theirs_out):
            os.close(fd)
    _say_once(f"vllm_neuron: compile workers are forked ready by this start's fork server "
              f"({address})")  # fmt: skip
    return ForkedProcess(answer.pid, fds[0], os.fdopen(ours_in, "w"), os.fdopen(ours_out))


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    """Said at INFO once per process: where its compile workers come from, and why."""
    if message not in _SAID:
        _SAID.add(message)
        logger.info("%s", message)
