"""Helpers shared by the profile-capture tests (a unique module name: every test folder
has its own conftest.py, so tests import helpers from here, never from ``conftest``)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DATA = HERE / "data"
FAKE_VLLM = HERE / "fake_vllm.py"


def group_alive(pgid: int) -> list[int]:
    """Live (non-zombie) members of process group `pgid`."""
    from vllm_neuron.profiling.lifecycle import group_members

    return group_members(pgid)


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


class CpuBurners:
    """Two processes spinning on the CPU from the moment a capture's server is up until the
    test ends (`once_ready`).

    A capture on a shared host competes for the cores; on 2 cores two spinners starve the
    processes that wait (the server's stats logger and HTTP handler, the capture's log
    follower) while the engine keeps stepping, which is what makes a profiling window miss.
    They start once the server's log says it is up, not before: a start-up at half speed
    would only cost the suite minutes and is not what the tests are about.
    """

    READY = "Application startup complete"

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self._stop = threading.Event()
        self.started = threading.Event()  # set once both spin
        self._thread: threading.Thread | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def once_ready(self, serve_log: Path) -> None:
        """Start the spinners when `serve_log` (the capture's ``logs/serve.log``) says the
        server is up; followed by a thread, so the capture runs meanwhile."""

        def follow() -> None:
            while not self._stop.is_set():
                try:
                    up = self.READY in serve_log.read_text(errors="replace")
                except FileNotFoundError:
                    up = False
                if up:
                    self.procs.extend(subprocess.Popen([sys.executable, "-c", "while True: pass"])
                                      for _ in range(2))  # fmt: skip
                    self.started.set()
                    return
                self._stop.wait(0.1)  # a log file has no handshake: looked at, bounded

        self._thread = threading.Thread(target=follow, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
