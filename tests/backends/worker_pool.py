"""Real worker processes for the race and crash tests (each runs store_worker.py)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("store_worker.py")


class Worker:
    """One store_worker.py process; `message()` returns its next JSON line."""

    def __init__(self, args: dict[str, Any], stderr_path: Path) -> None:
        self.args = args
        self.stderr_path = stderr_path
        self._stderr = open(stderr_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=dict(os.environ),
        )
        self._lines: queue.Queue[bytes] = queue.Queue()
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(b"")

    def message(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"worker {self.args['cmd']} silent for {timeout} s: {self.stderr_tail()}"
            ) from None
        if not line:
            self.proc.wait(timeout=10)
            raise AssertionError(
                f"worker {self.args['cmd']} exited with {self.proc.returncode}: "
                + self.stderr_tail()
            )
        return json.loads(line)  # type: ignore[no-any-return]

    def stderr_tail(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")[-2000:]

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        self._pump_thread.join(timeout=10)  # it ends at EOF, before its pipe is closed
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._stderr.close()


class Workers:
    """Starts workers, releases them together, and kills whatever is left at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path / "workers"
        self.dir.mkdir()
        self.stop = str(self.dir / "stop")
        self.all: list[Worker] = []

    def start(
        self, cmd: str, url: str, options: dict[str, Any] | None = None, **args: Any
    ) -> Worker:
        worker_args = {"cmd": cmd, "url": url, "options": options or {}, "stop": self.stop, **args}
        worker = Worker(worker_args, self.dir / f"{len(self.all)}.stderr")
        self.all.append(worker)
        return worker

    def start_many(
        self, n: int, cmd: str, url: str, options: dict[str, Any] | None = None, **args: Any
    ) -> list[Worker]:
        """Start `n` workers and wait until every one is ready."""
        started = [self.start(cmd, url, options, id=i, **args) for i in range(n)]
        for worker in started:
            assert worker.message(timeout=120).get("ready") is True
        return started

    def release(self, workers: list[Worker] | None = None) -> None:
        """Tell every started worker (or those given) to go; they act at once."""
        for worker in self.all if workers is None else workers:
            worker.go()

    def stop_all(self) -> None:
        """Create the stop file (rewriters finish their current write and report)."""
        Path(self.stop).touch()

    def results(self, workers: list[Worker], timeout: float = 120) -> list[Any]:
        return [w.message(timeout=timeout)["result"] for w in workers]

    def close(self) -> None:
        for worker in self.all:
            worker.close()
