"""Server lifecycle with real child processes: own group, readiness, guarded teardown."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest
from profiling_support import group_alive, wait_until

from vllm_neuron.profiling.lifecycle import (
    ReadyTimeout,
    ServerExited,
    ServerProcess,
    UnsafeSignal,
    check_signalable_group,
    group_members,
)


def launch(argv: list[str], tmp_path: Path, **env: str) -> ServerProcess:
    log_path = str(tmp_path / "logs" / "s.log")
    return ServerProcess.launch(argv, env={**os.environ, **env}, cwd=str(tmp_path),
                                log_path=log_path)


def test_http_server_child_in_own_group_is_torn_down(tmp_path: Path, port: int) -> None:
    server = launch([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                    tmp_path)
    try:
        assert server.pgid == server.pid
        assert server.pgid != os.getpgrp()
        # Its own group, but our session: one scheduling group with the capture (lifecycle.py).
        assert os.getsid(server.pid) == os.getsid(0)
        waited = server.wait_ready(f"http://127.0.0.1:{port}/", timeout=30)
        assert waited < 30
    finally:
        rec = server.teardown(grace=10)
    assert rec.signals == ["SIGTERM"]
    assert rec.exit_code is not None
    assert rec.survivors == [] and rec.clean and rec.error is None
    assert group_alive(server.pgid) == []
    assert server.teardown() is rec  # idempotent


def test_teardown_reaches_grandchildren_and_escalates_to_sigkill(
    tmp_path: Path, port: int, fake_entrypoint: list[str], fake_model: str
) -> None:
    """The fake server and its forked child ignore SIGTERM: teardown must SIGKILL the group."""
    server = launch([*fake_entrypoint, "--model", fake_model, "--port", str(port)], tmp_path,
                    FAKE_VLLM_IGNORE_TERM="1")
    try:
        server.wait_ready(f"http://127.0.0.1:{port}/v1/models", timeout=30)
        assert wait_until(lambda: len(group_alive(server.pgid)) >= 2, 10), "child not forked"
    finally:
        rec = server.teardown(grace=1.0)
    assert rec.signals == ["SIGTERM", "SIGKILL"]
    assert rec.exit_code == -signal.SIGKILL
    assert rec.survivors == [] and rec.clean
    assert group_members(server.pgid, include_zombies=False) == []


def test_guard_never_signals_the_own_group() -> None:
    with pytest.raises(UnsafeSignal, match="own group"):
        check_signalable_group(os.getpgrp())
    for pgid in (0, 1, -5):
        with pytest.raises(UnsafeSignal):
            check_signalable_group(pgid)


def test_teardown_refuses_a_server_record_pointing_at_our_group(
    tmp_path: Path, port: int
) -> None:
    server = launch([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                    tmp_path)
    real_pgid = server.pgid
    try:
        server.pgid = os.getpgrp()  # a corrupted record must not make us kill ourselves
        rec = server.teardown(grace=1)
        assert rec.error is not None and "own group" in rec.error
        assert rec.signals == []
        assert not rec.clean
        assert group_alive(real_pgid)  # the server was left alone, and so were we
    finally:
        os.killpg(real_pgid, signal.SIGKILL)
        server.proc.wait(10)


def test_early_death_is_reported_with_the_log(tmp_path: Path) -> None:
    server = launch([sys.executable, "-c", "print('boom: no model'); raise SystemExit(3)"],
                    tmp_path)
    with pytest.raises(ServerExited) as info:
        server.wait_ready("http://127.0.0.1:9/v1/models", timeout=30, interval=0.05)
    assert info.value.returncode == 3
    assert "boom: no model" in info.value.log_tail
    rec = server.teardown(grace=1)
    assert rec.signals == [] and rec.exit_code == 3 and rec.clean


def test_ready_timeout(tmp_path: Path, port: int) -> None:
    server = launch([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path)
    try:
        with pytest.raises(ReadyTimeout):
            server.wait_ready(f"http://127.0.0.1:{port}/v1/models", timeout=0.5, interval=0.1)
    finally:
        rec = server.teardown(grace=5)
    assert rec.signals == ["SIGTERM"] and rec.clean


# A server whose child leads a session of its own (as a compile worker does) and starts a
# grandchild in it (its compiler); then it writes their pids and waits to be stopped.
_SERVER_WITH_A_SESSION_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(g.pid, flush=True)
time.sleep(600)
'''], start_new_session=True, stdout=subprocess.PIPE, text=True)
grandchild = child.stdout.readline().strip()
open(sys.argv[1] + ".tmp", "w").write(f"{child.pid} {grandchild}")
import os; os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


def test_teardown_finds_and_kills_what_left_the_servers_group(tmp_path: Path) -> None:
    """A compile worker leads a group of its own: the group's signals miss it; the server's
    marker in its environment finds it, and it dies with its own group (its compiler)."""
    import psutil

    pids_file = tmp_path / "pids"
    server = launch([sys.executable, "-c", _SERVER_WITH_A_SESSION_CHILD, str(pids_file)],
                    tmp_path)
    try:
        assert wait_until(pids_file.exists, 30), server.log_tail()
        child, grandchild = (int(x) for x in pids_file.read_text().split())
        assert os.getpgid(child) == child != server.pgid  # outside the server's group
        assert os.getpgid(grandchild) == child
    finally:
        rec = server.teardown(grace=10)
    try:
        assert rec.strays == sorted([child, grandchild])
        assert rec.survivors == [] and rec.clean
        for pid in (child, grandchild):
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    finally:  # a failed check leaves nothing behind either
        with contextlib.suppress(OSError):
            os.killpg(child, signal.SIGKILL)
