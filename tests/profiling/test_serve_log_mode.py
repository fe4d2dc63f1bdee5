"""The profiled server's ``logs/serve.log`` holds its own output, unredacted (its command
line, what it prints of its environment): it is created ``0600``, for this user only,
whatever the umask (profiling/lifecycle.py `ServerProcess.launch`, through the store's
appender: backends/appenders.py `FdAppender`)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from vllm_neuron.profiling.lifecycle import ServerProcess


def test_the_servers_log_is_readable_by_its_user_only(tmp_path: Path) -> None:
    log_path = tmp_path / "run" / "logs" / "serve.log"
    before = os.umask(0o000)  # the most permissive: the mode must come from the open itself
    try:
        server = ServerProcess.launch(
            [sys.executable, "-c", "import os; print('HF_TOKEN=' + os.environ['HF_TOKEN'])"],
            env={**os.environ, "HF_TOKEN": "canary-serve-log-5a1e"}, cwd=str(tmp_path),
            log_path=str(log_path))
    finally:
        os.umask(before)
    assert server.proc.wait(timeout=60) == 0
    server.teardown(grace=1)
    assert stat.S_IMODE(log_path.stat().st_mode) == 0o600
    assert "canary-serve-log-5a1e" in log_path.read_text()  # the server's own, as written
