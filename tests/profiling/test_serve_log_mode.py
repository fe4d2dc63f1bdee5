"""The profiled server's ``logs/serve.log`` holds its own output, unredacted (its command
line, what it prints of its environment): it is created ``0600``, for this user only,
whatever the umask (profiling/lifecycle.py `ServerProcess.launch`, through the store's
appender: backends/appenders.py `FdAppender`). So are the other files of a run that hold a
command line or an environment (redacted): ``run_spec.json`` and ``manifest.json`` (the
storage layer's ``write(..., mode=PRIVATE_FILE)``), and the compile manifest."""

from __future__ import annotations

import os
import socket
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_neuron.backends import PRIVATE_FILE, open_store
from vllm_neuron.profiling.lifecycle import ServerProcess


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The most permissive umask: a file's mode must come from how it is made."""
    before = os.umask(0o000)
    try:
        yield
    finally:
        os.umask(before)


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


def test_a_runs_spec_and_manifest_are_readable_by_their_user_only(
    tmp_path: Path, open_umask: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real capture whose "server" prints its command line and dies: every file of the
    run that holds a command line or an environment is ``0600``."""
    from vllm_neuron.profiling.capture import run_capture
    from vllm_neuron.profiling.options import CaptureOptions

    for name in ("NEURON_PROJECT_ROOT", "VLLM_NEURON_VENV_PATH", "VLLM_NEURON_DIR", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run_capture(CaptureOptions(
        recipe="prefill", model=str(model), project_root=str(tmp_path / "project"),
        run_name="modes", profiler="torch", port=port,
        entrypoint=[sys.executable, "-c", "import sys; print(sys.argv); sys.exit(3)"],
        server_env={"NOTE": "an environment"}, ready_timeout=30, teardown_grace=5,
    ), log=lambda line: None)  # fmt: skip
    assert result.manifest.status == "failed"
    run = Path(result.run_dir)
    modes = {name: stat.S_IMODE((run / name).stat().st_mode)
             for name in ("run_spec.json", "manifest.json", "logs/serve.log")}
    assert modes == dict.fromkeys(modes, 0o600), modes


def test_a_compile_manifest_is_readable_by_its_user_only(tmp_path: Path, open_umask: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_neuron.manifest import emit_manifest
    from vllm_neuron.manifest.config import config_from_mapping

    monkeypatch.setenv("VLLM_NEURON_RUN_ID", "modes")
    emit_manifest(str(tmp_path / "manifests"), config_from_mapping({"model": "m"}),
                  cache_root=None, prefix="nodev", cleanup=False,
                  environment={"python": "3.11.7"})  # fmt: skip
    path = tmp_path / "manifests" / "nodev" / "manifest.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_a_folder_stores_write_takes_the_mode_it_is_given(tmp_path: Path, umask: int) -> None:
    """Exactly the mode asked for, whatever the umask; without one, as before (0644 less
    the umask); a store without file modes (memory, S3) takes the option and ignores it."""
    store = open_store(str(tmp_path / "store"))
    before = os.umask(umask)
    try:
        store.write("a/private.json", b"{}", mode=PRIVATE_FILE)
        store.write("a/private.json", b"{}", mode=PRIVATE_FILE)  # a rewrite: a new file
        store.write("a/shared.json", b"{}")
        store.write("a/group.json", b"{}", mode=0o640)
    finally:
        os.umask(before)
    got = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "store" / "a").iterdir()}
    assert got == {"private.json": 0o600, "shared.json": 0o644 & ~umask, "group.json": 0o640}
    memory = open_store("memory://modes")
    memory.write("x", b"1", mode=PRIVATE_FILE)
    assert memory.read("x") == b"1"
