"""No orphans (issue 42): a compile worker and every compiler it started die with the process
that owns them, even when that process is SIGKILLed mid-compile - checked by the worker's
process group, not by sleeping; and a CPU probe broken by a torch change says why, once.

Real processes: the owner is a Python process that starts a worker through the pool's own
`_Worker`; the worker runs Inductor's real CPU probe, whose compiler is a stand-in ``g++``
that says its pid on a handshake file and then runs for ten minutes (a compile that will
not end before the owner is killed). Version questions go to the real g++.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cache_workers import SAFETY, gone, worker_env

from vllm_neuron.compile.head_start import start_cpu_probe_if_cold
from vllm_neuron.envs import CompileCacheSettings
from vllm_neuron.envs.host_mode import VLLM_NEURON_CPU_PROBE_STARTED

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, pidfd")

DEATH = 60.0  # seconds the group is given to be gone once its owner is killed (a signal's way)

COMPILER = """#!/bin/sh
case " $* " in
  *" --version "*|*" -dumpversion "*|*" -dumpfullversion "*|*" -E "*) exec {gxx} "$@";;
esac
echo $$ >> "{handshake}"
exec sleep 600
"""

OWNER = """
import os, sys, threading
from vllm_neuron.compile.workers.pool import _Worker
if sys.argv[1] == "thread":  # as the cache's background thread does, which then ends
    def start():
        print(_Worker([]).process.pid, flush=True)
        sys.stdin.readline()  # until its worker compiles: then this thread ends
    started = threading.Thread(target=start)
    started.start()
    started.join()
    while os.path.exists(f"/proc/self/task/{started.native_id}"):  # gone in the kernel too
        os.sched_yield()
    print("ended", flush=True)
else:
    print(_Worker([]).process.pid, flush=True)
sys.stdin.read()  # until the test kills it
"""


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(entry))
    return members


def _gone_within(pid: int, seconds: float) -> bool:
    """Whether `pid` exits within `seconds`: waited on through a pidfd, which turns readable
    when the process exits."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        poller = select.poll()  # not select(): a busy process's fd numbers pass 1024
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(seconds * 1000)) or gone(pid)
    finally:
        os.close(fd)


def _wait_for_line(path: Path, proc: subprocess.Popen[str]) -> int:
    """The first pid written to `path` (a compiler started): looked for each time the
    owner's pidfd poll times out (100 ms), bounded, failing at once if the owner died."""
    fd = os.pidfd_open(proc.pid)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        for _ in range(int(SAFETY * 10)):
            if path.exists() and path.read_text().strip():
                return int(path.read_text().split()[0])
            assert not poller.poll(100), "the owner exited before its worker compiled"
    finally:
        os.close(fd)
    raise AssertionError("no compile started in the worker")


@pytest.mark.timeout(2 * SAFETY)
@pytest.mark.parametrize("started_from", ["main", "thread"])
def test_a_worker_and_its_compiler_die_with_their_owner_killed_mid_compile(tmp_path,
                                                                            started_from):
    handshake = tmp_path / "compilers"
    compiler = tmp_path / "bin" / "g++"
    compiler.parent.mkdir()
    compiler.write_text(COMPILER.format(gxx="/usr/bin/g++", handshake=handshake))
    compiler.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    env = worker_env(CXX=str(compiler), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
                     TMPDIR=str(tmp_path / "tmp"))
    env.pop("ATEN_CPU_CAPABILITY", None)  # the probe must compile
    owner = subprocess.Popen([sys.executable, "-c", OWNER, started_from], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        worker = int(owner.stdout.readline())
        compiling = _wait_for_line(handshake, owner)
        if started_from == "thread":  # Linux sends the parent-death signal on its end too
            assert owner.stdin is not None
            owner.stdin.write("\n")
            owner.stdin.flush()
            assert owner.stdout.readline() == "ended\n"
            assert not gone(worker)  # the end of the owner's thread did not end it (nor
            # disarm it: the owner's death below is signalled too, with no poll to fall on)
        # The worker leads a group of its own, with its compiler in it (a thread of the
        # owner that started it and ended did not end it).
        assert os.getpgid(worker) == worker and os.getpgid(compiling) == worker
        owner.kill()
        owner.wait(timeout=SAFETY)
        assert _gone_within(worker, DEATH), "a compile worker outlived its owner"
        for pid in [compiling, *_group(worker)]:
            assert _gone_within(pid, DEATH), f"a compiler outlived its worker's owner: {pid}"
        assert _group(worker) == [], "the worker's process group outlived its owner"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        started = [int(p) for p in handshake.read_text().split()] if handshake.exists() else []
        for pid in [*(_group(worker) if "worker" in locals() else []), *started]:
            with contextlib.suppress(ProcessLookupError):  # never leave one behind
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(2 * SAFETY)
def test_a_probe_broken_by_a_torch_change_says_why_once(tmp_path, monkeypatch, caplog):
    """A torch whose import fails (as a renamed internal would make a probe fail) in the
    probe's process: its exit status and traceback are logged, once."""
    broken = tmp_path / "shadow" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        'raise ImportError("torch changed under the probe (test)")\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(broken.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv(VLLM_NEURON_CPU_PROBE_STARTED, "restored after the test")
    monkeypatch.delenv(VLLM_NEURON_CPU_PROBE_STARTED)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    caplog.set_level(logging.WARNING, logger="vllm_neuron.compile")
    probe = start_cpu_probe_if_cold(CompileCacheSettings(cache_root=str(tmp_path / "root")))
    assert probe is not None
    assert probe.wait(timeout=SAFETY) != 0
    reaper = [t for t in threading.enumerate() if t.name == "vllm-neuron-cpu-probe"]
    for thread in reaper:
        thread.join(timeout=SAFETY)
    said = [r.getMessage() for r in caplog.records if "CPU probe" in r.getMessage()]
    assert len(said) == 1, said
    assert "exit status 1" in said[0] and "torch changed under the probe (test)" in said[0]
    assert "Traceback" in said[0], said[0]
    assert not list((tmp_path / "tmp").iterdir())  # what it printed was kept nameless
