"""What a cold start begins before its first graph (head_start.py): Inductor's CPU probe in a
process of its own, once per start, only on a node likely to compile - a real probe, real
test programs in a private Inductor cache directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cache_workers import SAFETY, worker_env

from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.head_start import look_within, start_cpu_probe_if_cold
from vllm_neuron.compile.tiers.location import holds_entries
from vllm_neuron.compile.toolchains.aoti_wrapper import RUNTIME_DIR
from vllm_neuron.compile.toolchains.node_files import NODE_DIR
from vllm_neuron.envs import CompileCacheSettings
from vllm_neuron.envs.compile_cache import VLLM_NEURON_NODE_FILES, VLLM_NEURON_SHARED_NODE_FILES
from vllm_neuron.envs.host_mode import VLLM_NEURON_CPU_PROBE_STARTED


@pytest.fixture
def first_process(monkeypatch, tmp_path):
    """This process as vLLM's first one on a new machine: no probe looked at yet, a private
    Inductor cache, and a fresh temporary directory as a Kubernetes ``emptyDir`` mounts it
    (world-writable, not sticky): what the probe keeps goes into the local tier's node
    files (toolchains/node_files.py), nothing into the temporary directory."""
    for marker in (VLLM_NEURON_CPU_PROBE_STARTED, VLLM_NEURON_NODE_FILES,
                   VLLM_NEURON_SHARED_NODE_FILES):
        monkeypatch.setenv(marker, "restored after the test")
        monkeypatch.delenv(marker)
    inductor = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp").chmod(0o777)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    return inductor


def _local(tmp_path: Path) -> str:
    return str(tmp_path / "root" / "neuron" / "compile_cache")


@pytest.mark.timeout(2 * SAFETY)
def test_a_cold_node_probes_the_cpu_ahead_once_per_start(tmp_path, first_process):
    settings = CompileCacheSettings(cache_root=str(tmp_path / "root"))
    probe = start_cpu_probe_if_cold(settings)
    assert probe is not None
    assert os.environ[VLLM_NEURON_CPU_PROBE_STARTED] == str(os.getpid())  # its children's
    assert start_cpu_probe_if_cold(settings) is None  # once per start
    assert probe.wait(timeout=SAFETY) == 0
    # Its CPU test programs and AOTInductor's precompiled headers are in Inductor's cache for
    # the workers: built, not to be built again.
    assert list(first_process.rglob("*.so")), sorted(first_process.rglob("*"))
    node = Path(_local(tmp_path)) / NODE_DIR
    assert list(node.glob("*/headers/*.gch")), sorted(node.rglob("*"))
    # ... and the runtime part of AOTInductor's wrapper, compiled once (aoti_wrapper.py),
    # whatever the emptyDir-like temporary directory, in which nothing of ours is left.
    assert len(list(node.glob(f"*/{RUNTIME_DIR}/*.o"))) == 1, sorted(node.rglob("*"))
    assert not any((tmp_path / "tmp").iterdir()), sorted((tmp_path / "tmp").rglob("*"))


@pytest.mark.parametrize("change", [
    {"toolchain": "neuron"},
    {"defer_compiles": False},
    {"disable_compile_cache": True},
    {"disable_warmup_compile": True},  # pre-compiled only: nothing is compiled here
    {"compile_workers": 0},
])
def test_a_node_that_would_not_compile_in_workers_starts_no_probe(tmp_path, first_process,
                                                                   change):
    settings = CompileCacheSettings(cache_root=str(tmp_path / "root"), **change)
    assert start_cpu_probe_if_cold(settings) is None
    assert not first_process.exists() and not any((tmp_path / "tmp").iterdir())


def test_a_node_whose_tier_holds_an_entry_starts_no_probe(tmp_path, first_process, compile_fn):
    local = _local(tmp_path)
    assert not holds_entries(local)  # no tier yet: a new node
    TwoTierCache(local).get_or_compile("ab" * 16, compile_fn("ab" * 16))
    assert holds_entries(local)
    assert start_cpu_probe_if_cold(CompileCacheSettings(cache_root=str(tmp_path / "root"))) is None
    assert not first_process.exists() and not any((tmp_path / "tmp").iterdir())


def test_a_marker_from_a_process_that_is_no_ancestor_stops_no_probe(tmp_path, first_process,
                                                                      monkeypatch):
    settings = CompileCacheSettings(cache_root=str(tmp_path / "root"),
                                    toolchain="neuron")  # fmt: skip  (so none is started)
    for marker in (str(os.getppid()), str(os.getpid())):  # an ancestor, this process
        monkeypatch.setenv(VLLM_NEURON_CPU_PROBE_STARTED, marker)
        assert start_cpu_probe_if_cold(settings) is None
        assert os.environ[VLLM_NEURON_CPU_PROBE_STARTED] == marker  # looked already
    # A launcher's, inherited from outside this start (pid 1 is no process we descend from
    # through vLLM; an unused number is none at all): this process looks, and says so.
    for marker in ("1", str(2**22 + 1), "not a pid"):
        monkeypatch.setenv(VLLM_NEURON_CPU_PROBE_STARTED, marker)
        assert start_cpu_probe_if_cold(settings) is None  # the neuron toolchain: no probe
        assert os.environ[VLLM_NEURON_CPU_PROBE_STARTED] == str(os.getpid())


_ENTRY_POINTS = """
import json, os, select, sys
from vllm_neuron import plugin

# This Python has no vLLM: its CPU platform taken as fenced (vllm_internals.py; the fence
# itself is tested in vLLM's environment), as test_hooks.py does in-process.
plugin.resolve = lambda qualname: object()

# vLLM asks for its platform first (seconds before it loads the general plugins), more
# than once, then runs the general plugin: the probe starts at the first ask, once.
def probes_running():
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().split(b"\\0")
            if parent == os.getpid() and b"--probe" in command:
                found[int(pid)] = os.pidfd_open(int(pid))  # held: its number is not reused
        except (OSError, IndexError, ValueError):
            continue
    return found

assert plugin.platform_plugin() == plugin.HOST_PLATFORM
assert os.environ["_VLLM_NEURON_CPU_PROBE_STARTED"] == str(os.getpid())
# Looked for at once and again after the general plugin (a probe lives for seconds: it
# starts an interpreter and imports torch), so a loaded host finishing it early loses none.
probes = probes_running()
assert plugin.platform_plugin() == plugin.HOST_PLATFORM
plugin.register()
probes.update((pid, fd) for pid, fd in probes_running().items() if pid not in probes)
for fd in probes.values():  # its work done, it exits: waited on through a pidfd, bounded
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(float(os.environ["PROBE_PATIENCE"]) * 1000), "the probe did not finish"
print(json.dumps(sorted(probes)))
"""


@pytest.mark.timeout(2 * SAFETY)
def test_the_platform_plugin_starts_the_probe_before_the_general_plugin(tmp_path,
                                                                         first_process):
    # As `vllm serve` runs: a console script named vllm, its first argument serve.
    script = tmp_path / "bin" / "vllm"
    script.parent.mkdir()
    script.write_text(_ENTRY_POINTS)
    env = worker_env(VLLM_NEURON_HOST_MODE="1", VLLM_CACHE_ROOT=str(tmp_path / "root"),
                     PROBE_PATIENCE=str(SAFETY))
    done = subprocess.run([sys.executable, str(script), "serve", "tiny"], env=env,
                          capture_output=True, text=True, timeout=2 * SAFETY, check=False)
    assert done.returncode == 0, done.stderr
    (probe,) = json.loads(done.stdout.splitlines()[-1])  # one probe, not one per entry point
    said = [line for line in done.stderr.splitlines() if "CPU probe runs ahead" in line]
    assert len(said) == 1 and f"in pid {probe}" in said[0], done.stderr
    # A real probe: the runtime part of AOTInductor's wrapper is made (aoti_wrapper.py).
    node = Path(_local(tmp_path)) / NODE_DIR
    assert len(list(node.glob(f"*/{RUNTIME_DIR}/*.o"))) == 1, sorted(node.rglob("*"))


@pytest.mark.parametrize(("argv", "server"), [
    (["/venv/bin/vllm", "serve", "model"], True),
    (["/venv/lib/python3.11/site-packages/vllm/entrypoints/openai/api_server.py", "--model",
      "m"], True),
    (["/venv/bin/vllm", "chat"], False),  # a client: vLLM's platform asked, nothing compiled
    (["/venv/bin/vllm"], False),
    (["-c"], False),  # LLM(...) in a script: the general plugin starts the probe
    (["/venv/bin/vllm-neuron", "snapshot", "replay"], False),
    ([], False),
])
def test_only_a_vllm_servers_first_process_probes_at_the_platform_ask(argv, server):
    from vllm_neuron import plugin

    assert plugin._starts_a_vllm_server(argv) is server


def test_a_process_of_ours_that_loads_vllms_kernels_starts_no_probe(tmp_path, first_process):
    # A snapshot replay's rank or `debug env` loads vLLM's kernels, which has vLLM ask the
    # platform plugin for its platform: no vLLM start, so no probe, here or in its children.
    code = ("import os\n"
            "from vllm_neuron import plugin\n"
            "from vllm_neuron.compile.toolchains.op_libraries import import_vllm_kernels\n"
            "plugin.resolve = lambda qualname: object()  # vLLM's CPU platform, as fenced\n"
            "try:\n"
            "    import_vllm_kernels()\n"
            "except ImportError:\n"
            "    pass  # no vLLM in this Python: what vLLM would ask, asked below\n"
            "assert os.environ['_VLLM_NEURON_CPU_PROBE_STARTED'] == str(os.getpid())\n"
            "assert plugin.platform_plugin() == plugin.HOST_PLATFORM\n")
    env = worker_env(VLLM_NEURON_HOST_MODE="1", VLLM_CACHE_ROOT=str(tmp_path / "root"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=2 * SAFETY, check=False)
    assert done.returncode == 0, done.stderr
    assert "CPU probe runs ahead" not in done.stderr
    assert not first_process.exists() and not any((tmp_path / "tmp").iterdir())


def test_a_remote_look_that_never_answers_does_not_hold_the_start(
        caplog: pytest.LogCaptureFixture) -> None:
    """A call into a hung NFS mount never returns: the start-up's look gives up at its
    deadline with its default, said once naming the look; the blocked thread holds nothing."""
    release = threading.Event()
    told: list[threading.Event] = []

    def hung(gave_up: threading.Event) -> str:
        told.append(gave_up)
        release.wait()  # released after the assertions: nothing else ends it
        return "late"

    with caplog.at_level("INFO", logger="vllm_neuron.compile"):
        assert look_within(hung, "default", "a look at a hung mount", deadline=0.2) == "default"
    assert [r.levelname for r in caplog.records if "a look at a hung mount" in r.message] == [
        "WARNING"]
    assert told[0].is_set()  # a look that writes stops there
    release.set()
    caplog.clear()
    with caplog.at_level("INFO", logger="vllm_neuron.compile"):
        assert look_within(lambda _: "answer", "default", "a quick look") == "answer"

        def broken(_: threading.Event) -> str:
            raise OSError("stale file handle")

        assert look_within(broken, "default", "a broken look") == "default"
    said = [r.message for r in caplog.records]
    assert len(said) == 1 and "a broken look" in said[0] and "stale file handle" in said[0]
