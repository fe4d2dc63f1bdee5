"""Compile workers forked ready by the start's fork server (fork_server.py).

Real processes throughout: a fork server started as vLLM's first process starts it
(``worker_process --fork-server PARENT ADDRESS``), tracing processes that ask it for their
workers, real TorchInductor compiles in the forked workers. Asserted: the workers are the
server's children and compile every graph right (two at once); a worker serves the process
that asked and exits with it, even mid-compile; an asker whose environment differs where
torch read it at import, a server of another user, or no server at all, gets a worker
started as a new interpreter, as before; the server serves no other user, and exits with
its parent or when no one asks.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cache_workers import SAFETY, finish_workers, wait_until_gone, worker_command, worker_env

from vllm_neuron.compile import fork_server
from vllm_neuron.compile.compile_workers import ERROR, OUTPUT, WorkerPool
from vllm_neuron.envs.host_mode import VLLM_NEURON_COMPILE_FORK_SERVER

pytestmark = pytest.mark.skipif(not fork_server.available(),
                                reason="fork servers need Linux (abstract sockets, pidfds)")

HERE = Path(__file__).resolve().parent


def _start_server(env: dict[str, str], parent: int | None = None,
                  user: int | None = None) -> tuple[str, subprocess.Popen[bytes]]:  # fmt: skip
    """A fork server for this process (or `parent`), listening when returned."""
    address = fork_server.new_address()
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm_neuron.compile.worker_process", "--fork-server",
         str(parent or os.getpid()), address],
        env=env, stdin=subprocess.DEVNULL, user=user)
    _wait_listening(address, server)
    return address, server


def _wait_listening(address: str, server: subprocess.Popen[bytes]) -> None:
    """Wait for the server's socket to take connections (it binds before its imports)."""
    deadline = time.monotonic() + SAFETY
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the fork server exited with {server.returncode}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            try:
                probe.connect("\0" + address)
                return
            except ConnectionRefusedError:
                time.sleep(0.02)  # not bound yet: the interpreter is starting
    raise AssertionError("the fork server never listened")


def _stop(server: subprocess.Popen[bytes]) -> None:
    server.kill()
    server.wait(timeout=SAFETY)


@pytest.fixture
def private_env(tmp_path) -> Iterator[dict[str, str]]:
    """The environment of a start: a private temporary and Inductor cache directory."""
    (tmp_path / "tmp").mkdir()
    yield worker_env(TMPDIR=str(tmp_path / "tmp"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind"),
                     VLLM_CACHE_ROOT=str(tmp_path / "root"), VLLM_NEURON_TOOLCHAIN="host")


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return int(stat.read().rsplit(b")", 1)[1].split()[1])


@pytest.mark.timeout(2 * SAFETY)
def test_a_processes_compile_workers_are_forked_ready_by_the_fork_server(tmp_path, private_env):
    address, server = _start_server(private_env)
    try:
        proc = subprocess.Popen(
            worker_command("pieces", {"widths": [16, 24, 32]}),
            env={**private_env, VLLM_NEURON_COMPILE_FORK_SERVER: address,
                 "VLLM_NEURON_COMPILE_WORKERS": "2"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        (result,) = finish_workers([proc], timeout=SAFETY)
    finally:
        _stop(server)
    assert result["matches"] == [True, True, True], result
    assert result["sources"] == ["compiled"] * 3
    # Two slots: two workers, both forked by the server (its children, not the tracer's).
    assert len(result["worker_pids"]) == 2, result
    assert result["workers_forked"] == result["worker_pids"], result
    assert set(result["worker_parents"].values()) == {server.pid}, result
    assert result["workers_lost"] == []
    wait_until_gone(result["worker_pids"], "a forked worker outlived the process it served")


@pytest.mark.timeout(2 * SAFETY)
def test_a_forked_worker_exits_with_the_process_it_serves_even_mid_compile(tmp_path,
                                                                          private_env):
    address, server = _start_server(private_env)
    out = tmp_path / "out"
    out.mkdir()
    client = subprocess.Popen(
        [sys.executable, str(HERE / "fork_client.py"), str(out)],
        env={**private_env, VLLM_NEURON_COMPILE_FORK_SERVER: address},
        stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert client.stdout is not None
        said = json.loads(client.stdout.readline())
        (worker,) = said["forked"]
        assert said["started"] == [worker] and _parent_of(worker) == server.pid
        job = Path(said["job_dir"])
        _wait_for(lambda: (job / OUTPUT).exists() or client.poll() is not None)
        assert client.poll() is None, "the client ended before its worker took the job"
        client.kill()  # mid-compile: the worker is neither its child nor told by a pipe
        client.wait(timeout=SAFETY)
        wait_until_gone([worker], "a forked worker outlived the process it served")
        assert not (job / "artifact.json").exists() and not (job / ERROR).exists()
        assert not list(out.iterdir())  # it stopped, it did not finish
        assert server.poll() is None  # the server itself serves on
    finally:
        client.kill()
        _stop(server)


def _wait_for(ready: Any) -> None:
    deadline = time.monotonic() + SAFETY
    while not ready():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("variable", ["TORCHINDUCTOR_CPP_DYNAMIC_THREADS", "LD_PRELOAD",
                                      "TMPDIR"])  # fmt: skip
def test_an_asker_whose_environment_differs_where_torch_read_it_starts_its_own(
        tmp_path, private_env, monkeypatch, caplog, variable):  # fmt: skip
    libraries = str(tmp_path / "lib")
    address, server = _start_server({**private_env, "LD_LIBRARY_PATH": libraries})
    try:
        for name, value in private_env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv(VLLM_NEURON_COMPILE_FORK_SERVER, address)
        # What does not change a worker's compile is no reason to refuse: OpenMP's pinning
        # of a rank, Inductor's cache directory (read at each use), a library path that a
        # library imported again (OpenCV) prepended again.
        monkeypatch.setenv("GOMP_CPU_AFFINITY", "0")
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "vllm-inductor"))
        monkeypatch.setenv("LD_LIBRARY_PATH", f"{libraries}:{libraries}")
        pool = WorkerPool(idle_seconds=3600.0)
        pool.start_ahead(1)
        assert pool.forked == pool.started and len(pool.started) == 1
        assert pool.retire_idle() == [None]  # exited when its input closed; not our child

        monkeypatch.setenv(variable, str(tmp_path / "something else"))
        with caplog.at_level(logging.INFO, logger="vllm_neuron.compile"):
            pool.start_ahead(1)
        assert pool.forked == pool.started[:1] and len(pool.started) == 2  # a new interpreter
        assert f"refused: {variable} differ" in caplog.text
        assert pool.retire_idle() == [0]
    finally:
        _stop(server)


def test_no_server_at_the_address_means_workers_start_as_before(monkeypatch, caplog):
    monkeypatch.setenv(VLLM_NEURON_COMPILE_FORK_SERVER, fork_server.new_address())
    pool = WorkerPool(idle_seconds=3600.0)
    with caplog.at_level(logging.INFO, logger="vllm_neuron.compile"):
        pool.start_ahead(1)
    assert pool.forked == [] and len(pool.started) == 1
    assert _parent_of(pool.started[0]) == os.getpid()
    assert "compile workers start as new interpreters" in caplog.text
    assert pool.retire_idle() == [0]


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs a second user (run as root)")
NOBODY = 65534


@root_only
def test_a_fork_server_forks_nothing_for_another_user(private_env):
    address, server = _start_server(private_env)
    try:
        asker = subprocess.run(
            [sys.executable, "-c", _ASK_AS_ANOTHER_USER, address], user=NOBODY,
            capture_output=True, text=True, timeout=SAFETY)  # fmt: skip
        assert asker.returncode == 0, asker.stderr
        assert asker.stdout.strip() == "closed without an answer", asker.stdout
        assert _children_of(server.pid) == []
    finally:
        _stop(server)


_ASK_AS_ANOTHER_USER = """
import os, socket, sys
conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
conn.connect("\\0" + sys.argv[1])
r, w = os.pipe()
socket.send_fds(conn, [b'{"env": {}, "preload": []}'], [r, w, 2])
try:
    print("closed without an answer" if conn.recv(4096) == b"" else "answered")
except ConnectionResetError:  # closed with the request unread
    print("closed without an answer")
"""


def _children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


@root_only
def test_no_process_asks_a_fork_server_of_another_user(private_env, monkeypatch, caplog):
    # Its environment (secrets included) is never sent to a server another user runs.
    env = {**private_env, "HOME": "/"}
    address, server = _start_server(env, user=NOBODY)
    try:
        monkeypatch.setenv(VLLM_NEURON_COMPILE_FORK_SERVER, address)
        with caplog.at_level(logging.INFO, logger="vllm_neuron.compile"):
            assert fork_server.fork_worker([], sys.stderr.buffer) is None
        assert "runs as another user" in caplog.text
        assert _children_of(server.pid) == []
    finally:
        _stop(server)


def test_a_fork_server_exits_with_its_parent(private_env):
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCH_A_SERVER], env=private_env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert launcher.stdout is not None
    server_pid = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait(timeout=SAFETY)
    wait_until_gone([server_pid], "a fork server outlived the process that started it")


_LAUNCH_A_SERVER = """
import os, subprocess, sys
from vllm_neuron.compile import fork_server
server = subprocess.Popen([sys.executable, "-m", "vllm_neuron.compile.worker_process",
                           "--fork-server", str(os.getpid()), fork_server.new_address()])
print(server.pid, flush=True)
sys.stdin.read()
"""


def test_a_fork_server_no_one_asks_exits(monkeypatch):
    listener = fork_server.listen(fork_server.new_address())
    with listener:
        started = time.monotonic()
        assert fork_server.serve_forks(listener, os.getppid(), _never, first_idle=0.2) == 0
        assert time.monotonic() - started < SAFETY


def _never(asker: int, preload: Any, asker_fd: int) -> int:
    raise AssertionError("nothing asked for a fork")


def test_the_worker_process_names_its_modes():
    bad = subprocess.run([sys.executable, "-m", "vllm_neuron.compile.worker_process",
                          "--fork-server", str(os.getpid())],
                         capture_output=True, text=True, timeout=SAFETY)  # fmt: skip
    assert bad.returncode == 2 and "--fork-server PARENT_PID ADDRESS" in bad.stderr
